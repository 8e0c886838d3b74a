"""The executed copies in ``docs/chapters/`` (``make executed``) are what a reader without a kernel sees on a code
host. They must be the chapters as they are now, run to the end in full mode; and what each chapter concludes in
full mode must be what it concludes in fast mode, except the figures it files under ``"magnitudes"`` (sizes and
timings that differ between the modes and are never graded as the same answer) and the verdicts it names
``timing_...`` (a timing of this machine, printed with its margin and labelled so: tests assert no timing)."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from kvlab.app.render import _relinked
from _util import CHAPTERS, conclusions

ROOT = CHAPTERS.parent
EXECUTED = ROOT / "docs" / "chapters"
NAMES = sorted(str(p.relative_to(CHAPTERS)) for p in CHAPTERS.rglob("*.ipynb"))
WITH_CONCLUSIONS = [n for n in NAMES if "/" not in n and n != "index.ipynb"]
STALE = "docs/chapters is out of step with chapters/: run `make executed` (about 6 minutes) and commit it"


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def test_there_is_one_executed_copy_per_notebook_and_no_other():
    assert sorted(str(p.relative_to(EXECUTED)) for p in EXECUTED.rglob("*.ipynb")) == NAMES, STALE


@pytest.mark.parametrize("name", NAMES)
def test_each_copy_has_the_chapters_cells_and_ran_to_the_end_in_full_mode(name):
    original, copy = _read(CHAPTERS / name), _read(EXECUTED / name)
    _relinked(original, (CHAPTERS / name).parent.resolve(), (EXECUTED / name).resolve())
    assert [(c.id, c.cell_type, c.source) for c in copy.cells] == \
        [(c.id, c.cell_type, c.source) for c in original.cells], STALE
    assert copy.metadata.get("kvlab", {}).get("mode") == "full"
    code = [c for c in copy.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{name}: a cell did not run"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert "widgets" not in copy.metadata  # megabytes of state no code host can run


@pytest.mark.notebooks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", WITH_CONCLUSIONS)
def test_full_mode_concludes_what_fast_mode_concludes_apart_from_magnitudes(name, executed):
    fast, full = conclusions(executed(CHAPTERS / name)[0]), conclusions(_read(EXECUTED / name))
    assert set(fast) == set(full), name

    def graded(c: dict) -> dict:
        return {k: v for k, v in c.items() if k != "magnitudes" and not k.startswith("timing_")}

    assert graded(fast) == graded(full), name


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def _links(path: Path) -> list[str]:
    if path.suffix == ".md":
        text = path.read_text(encoding="utf-8")
    else:
        text = "\n".join(c.source for c in _read(path).cells if c.cell_type == "markdown")
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("folder", [CHAPTERS, EXECUTED], ids=["chapters", "executed"])
def test_every_relative_link_in_the_course_resolves(folder):
    files = sorted(folder.rglob("*.ipynb")) + sorted(folder.glob("*.md"))
    dead = [(str(f.relative_to(ROOT)), t) for f in files for t in _links(f) if not (f.parent / t).exists()]
    assert not dead


def _words(text: str) -> int:
    """Words as a reader meets them: each Chinese character one, each run of Latin letters or digits one."""
    return len(re.findall(r"[\u4e00-\u9fff]", text)) + len(re.findall(r"[A-Za-z0-9_]+", text))


@pytest.mark.parametrize("name", WITH_CONCLUSIONS)
def test_each_chapter_reads_as_prose_with_code_not_code_with_prose(name):
    """A chapter is read more than run: its markdown holds at least 1.5 words for each word of its code, and no
    code cell is longer than a screen (30 lines; the harness goes into the library, where it is tested).
    Characters would mislead here: a Chinese sentence says in ten characters what its English says in forty."""
    nb = _read(CHAPTERS / name)
    prose = sum(_words(c.source) for c in nb.cells if c.cell_type == "markdown")
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert prose >= 1.5 * sum(map(_words, code)), (prose, sum(map(_words, code)))
    long = [(i, n) for i, n in enumerate(len(src.splitlines()) for src in code) if n > 30]
    assert not long, f"code cells over 30 lines (index, lines): {long}"
