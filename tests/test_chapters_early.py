"""Chapters 2.2.1-2.2.3 (and 2.2.2's errata appendix) draw the conclusions they print, in fast mode, and the
conclusions do not depend on the mode.

Each chapter ends with a cell tagged ``conclusions`` that prints ``CONCLUSIONS {json}``; the tests execute the
chapter (as ``tests/test_notebooks.py`` does), read that line and assert each conclusion against the library,
so a chapter whose prose stopped matching its numbers (or a library change that flips a result, e.g. LRU
planted in reverse) fails here.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest

import kvlab
from kvlab import exercises as ex

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"
EARLY = ("2_2_1_block_size.ipynb", "2_2_2_block_management.ipynb", "2_2_2_appendix_errata.ipynb",
         "2_2_3_allocation.ipynb")


def execute(name: str) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    nb = nbformat.read(CHAPTERS / name, as_version=4)
    env = {"KVLAB_FAST": "1", "CUDA_VISIBLE_DEVICES": ""}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, kernel_name="python3", timeout=240, resources={"metadata": {"path": str(CHAPTERS)}},
                       startup_timeout=60).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def conclusions(nb: nbformat.NotebookNode) -> dict:
    cells = [c for c in nb.cells if "conclusions" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "a chapter has exactly one cell tagged 'conclusions'"
    text = "".join(o.get("text", "") for o in cells[0].outputs if o.output_type == "stream")
    line = next(ln for ln in text.splitlines() if ln.startswith("CONCLUSIONS "))
    return json.loads(line.removeprefix("CONCLUSIONS "))


@pytest.fixture(scope="module")
def run():
    seen: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in seen:
            seen[name] = conclusions(execute(name))
        return seen[name]
    return get


def test_every_early_chapter_has_an_instructor_box_a_vllm_box_and_slide_tags():
    for name in EARLY:
        nb = nbformat.read(CHAPTERS / name, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        assert "教师栏 (Instructor box)" in text and "分钟" in text, name
        assert "在 vLLM 里 (In vLLM)" in text, name
        assert all("slide_type" in c.metadata.get("slideshow", {}) for c in nb.cells), name
        assert nb.cells[0].metadata["slideshow"]["slide_type"] == "slide", name


def test_every_reveal_follows_a_prediction_of_the_same_key():
    for name in EARLY:
        src = [c.source for c in nbformat.read(CHAPTERS / name, as_version=4).cells if c.cell_type == "code"]
        predicted: set[str] = set()
        for s in src:
            for key in ex.list_predictions():
                if f'predict("{key}"' in s:
                    predicted.add(key)
                if f'reveal("{key}"' in s:
                    assert key in predicted, f"{name}: reveal of {key} before its prediction"


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_2_2_1_conclusions(run):
    c = run("2_2_1_block_size.ipynb")
    assert c["azure_conv_prompt_mean"] == pytest.approx(1154.7, abs=0.05)  # the GUIDE's 1,155
    assert c["chat_waste_trend"] == "rises"
    assert c["balanced_below_text_band"] and c["memory_efficient_smallest"] and c["overhead_falls"]
    # the recommendations are counts: a direct sweep (no attention timing at all) gives the same picks
    for name in ("chat", "code"):
        res = kvlab.sweep(kvlab.make_workload(name, 2000, seed=0), attention=False, progress=False)
        assert c["measured"][name] == {g: res.recommend(g) for g in kvlab.sizing.GOALS}, name
    azure = kvlab.load_trace("azure-conv-2023")
    res = kvlab.sweep(kvlab.Workload("azure-conv-2023", azure.requests[:2000]), attention=False, progress=False)
    assert c["measured"]["azure-conv-2023"]["balanced"] == res.recommend("balanced") == 128
    assert ex.ch2_2_1.band_of(128) == "64-128 conservative"
