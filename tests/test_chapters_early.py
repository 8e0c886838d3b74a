"""Chapters 2.2.1-2.2.3 (and 2.2.2's errata appendix) draw the conclusions they print, in fast mode, and the
conclusions do not depend on the mode.

Each chapter ends with a cell tagged ``conclusions`` that prints ``CONCLUSIONS {json}``; the tests execute the
chapter (as ``tests/test_notebooks.py`` does), read that line and assert each conclusion against the library,
so a chapter whose prose stopped matching its numbers (or a library change that flips a result, e.g. LRU
planted in reverse) fails here.
"""
from __future__ import annotations

import json

import nbformat
import pytest

import kvlab
from kvlab import exercises as ex
from _util import CHAPTERS

EARLY = ("2_2_1_block_size.ipynb", "2_2_2_block_management.ipynb", "2_2_2_appendix_errata.ipynb",
         "2_2_3_allocation.ipynb")


def conclusions(nb: nbformat.NotebookNode) -> dict:
    cells = [c for c in nb.cells if "conclusions" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "a chapter has exactly one cell tagged 'conclusions'"
    text = "".join(o.get("text", "") for o in cells[0].outputs if o.output_type == "stream")
    line = next(ln for ln in text.splitlines() if ln.startswith("CONCLUSIONS "))
    return json.loads(line.removeprefix("CONCLUSIONS "))


@pytest.fixture(scope="module")
def run(executed):
    """The chapter's conclusions, from the session's one run of it (tests/conftest.py)."""
    def get(name: str) -> dict:
        return conclusions(executed(CHAPTERS / name)[0])
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
        assert c["measured"][name] == {g: res.recommend(g) for g in kvlab.memory.sizing.GOALS}, name
    azure = kvlab.load_trace("azure-conv-2023")
    res = kvlab.sweep(kvlab.Workload("azure-conv-2023", azure.requests[:2000]), attention=False, progress=False)
    assert c["measured"]["azure-conv-2023"]["balanced"] == res.recommend("balanced") == 128
    assert ex.ch2_2_1.band_of(128) == "64-128 conservative"


def lru_hit_rate_by_hand(n_blocks: int, n_requests: int, seed: int = 0, n_docs: int = 400) -> float:
    """The Zipf experiment's LRU cache without kvlab: an ordered dict, oldest first."""
    from collections import OrderedDict

    import numpy as np
    docs = (np.random.default_rng(seed).zipf(1.3, n_requests) % n_docs).tolist()
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for d in docs:
        if d in cache:
            hits += 1
            cache.move_to_end(d)
        else:
            if len(cache) == n_blocks:
                cache.popitem(last=False)
            cache[d] = None
    return hits / n_requests


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_2_2_2_conclusions(run):
    c = run("2_2_2_block_management.ipynb")
    S = kvlab.BlockStatus
    legal = {f"{o.name}->{n.name}" for o, n in [(S.FREE, S.PENDING), (S.FREE, S.ALLOCATED), (S.PENDING, S.ALLOCATED),
                                                  (S.PENDING, S.FREE), (S.ALLOCATED, S.EVICTING), (S.ALLOCATED, S.FREE),
                                                  (S.EVICTING, S.FREE)]}
    assert set(c["legal_transitions"]) == legal
    assert [(s, refs, cached) for _, s, refs, _, cached in c["lifecycle"]] == [
        ("PENDING", 1, False), ("ALLOCATED", 1, False), ("ALLOCATED", 2, False), ("ALLOCATED", 0, True),
        ("ALLOCATED", 1, False), ("EVICTING", 0, False), ("FREE", 0, False)]
    assert c["lru_demo_victim"] == 4  # released 4, 1, 5, 0 in that order: 4 is least recently used
    rates = c["rates"]
    assert rates["lru"] == pytest.approx(lru_hit_rate_by_hand(32, c["n_requests"]), abs=1e-4)
    assert rates["clock"] == rates["lru"]  # every block referenced between sweeps: CLOCK degenerates to LRU
    assert rates["opt"] > rates["lfu"] > rates["lru"] > rates["fifo"] and c["best_online"] == "lfu"
    assert c["race_opt_is_ceiling"]
    assert c["scan_grows"] > 3 * c["evict_grows"]


def test_2_2_2_best_policy_is_the_same_in_full_mode():
    """The chapter runs 5,000 requests in fast mode and 20,000 in full: the ranking is the same."""
    rate = ex.ch2_2_2.zipf_hit_rate
    for n in (5_000, 20_000):
        r = {p: rate(p, n_requests=n) for p in ex.ch2_2_2.HIT_POLICIES}
        assert r["opt"] > r["lfu"] > r["lru"] > r["fifo"], n


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_2_2_2_appendix_conclusions(run):
    c = run("2_2_2_appendix_errata.ipynb")
    assert c["capacity_story"] == [4096, 1024, 0, "False"]  # shrinks, drops to 0, refuses the next use
    assert c["text_best"] is None and c["released_handed_out"] and c["leak"]
    assert c["free_list_after_evictions"] == 0
    assert (c["text_fragmentation"], c["kvlab_uniform_fragmentation"]) == (75, 0)
    assert c["winners_per_race"] == [1]
    assert c["bytes_per_token_layer"] == 4096 and c["units_found"] is None
    assert c["total_memory_free"] == -11264


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_2_2_3_conclusions(run):
    c = run("2_2_3_allocation.ipynb")
    # 128 free: the first 16 splits (leaving 16, 32, 64), then each request finds its class free
    assert c["strategies"] == ["split", "exact", "exact", "exact"] == [
        t.strategy for t in (lambda a: [a.allocate_optimal_block(size_class=k) for k in (0, 0, 1, 2)])(
            kvlab.DynamicAllocator(kvlab.BlockPool(8, spec=kvlab.KVSpec(block_size=16, device="cpu"),
                                                   block_sizes=[16, 32, 64, 128])))]
    assert c["text_handout"] == [0, 0, 0] and c["kvlab_handout"] == [0, 1, 2]
    assert c["text_retry"] == "fails"
    assert c["planned_eviction"] == ["evict", 4, 2]  # the only aligned all-cached window: blocks 4 and 5
    per_user, shared_prefix = -(-500 // 16), 300 // 16
    assert c["plain_blocks"] == c["users"] * per_user
    assert c["shared_blocks"] == shared_prefix + c["users"] * (per_user - shared_prefix)


def test_the_glossary_names_what_the_code_computes():
    """Every measure the glossary names exists under that name in kvlab, and the two fragmentation measures
    are different numbers on one pool."""
    text = (CHAPTERS / "GLOSSARY.md").read_text(encoding="utf-8")
    for name in ("internal waste", "unusable free memory", "external fragmentation (contiguity)", "attention slots",
                 "prefix-sharing loss", "prefix-hit bound"):
        assert f"{name}**" in text, name
    row = kvlab.measure_block_size(kvlab.make_workload("chat", 5, 0), 16)
    for field in ("waste", "prefix_loss", "table_entries", "alloc_calls", "attention_slots", "attention_ms",
                  "attention_spread"):
        assert hasattr(row, field) and f"SweepRow.{field}" in text, field
    pool = kvlab.BlockPool(8, spec=kvlab.KVSpec(block_size=16, device="cpu"), with_storage=False)
    pool.free(pool.allocate(8)[::2])
    report = kvlab.FragmentationDetector(pool).detect_fragmentation()
    for key in ("internal_waste", "fragmentation_percent", "external_fragmentation", "scatter"):
        assert key in report and f'"{key}"' in text, key
    assert report["fragmentation_percent"] == 0 and report["external_fragmentation"] == pytest.approx(0.75)


def test_2_2_1_balanced_optimum_is_below_the_texts_band_for_every_seed():
    """The chapter's claim that survives a change of requests: the pick moves by a notch, never into 256-512."""
    for name in ("chat", "code"):
        picks = {kvlab.sweep(kvlab.make_workload(name, 2000, seed=s), attention=False, progress=False)
                 .recommend("balanced") for s in (0, 1, 2)}
        assert picks <= {32, 64, 128}, (name, picks)
