"""Chapters 2.2.4-2.2.6 teach what kvlab measures: each runs in fast mode and prints the conclusions its prose draws,
and these tests hold the printed conclusions (a planted bug in what a chapter measures changes a line here).
Timing figures are never asserted; the conclusions asserted are counts, verdicts and simulated seconds. The
figures that differ between fast and full mode are checked at both sizes where they are cheap (the claims at both
sizes are in ``tests/test_claims.py``)."""
from __future__ import annotations

import re

import nbformat
import pytest

from kvlab.exercises import ch2_2_4
from _util import CHAPTERS

LATE = ("2_2_4_defragmentation.ipynb", "2_2_5_performance.ipynb", "2_2_6_applications.ipynb")


@pytest.fixture(scope="module")
def printed(executed):
    """``printed(name)``: all that chapter ``name`` printed, from the session's one run of it (tests/conftest.py)."""
    def get(name: str) -> str:
        nb, _ = executed(CHAPTERS / name)
        outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
        assert not [o for o in outs if o.output_type == "error"]
        return "".join(o.get("text", "") for o in outs if o.output_type == "stream")
    return get


def _sources(name: str) -> list[nbformat.NotebookNode]:
    return nbformat.read(CHAPTERS / name, as_version=4).cells


# ---------------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("name", LATE)
def test_each_late_chapter_has_boxes_slides_predictions_and_exercises(name):
    cells = _sources(name)
    text = "\n".join(c.source for c in cells)
    assert "教师栏 (Instructor box)" in text and "学习目标" in text and "先修" in text and "时间" in text
    assert "在 vLLM 里 (In vLLM)" in text
    assert all(c.metadata.get("slideshow", {}).get("slide_type") in ("slide", "subslide", "fragment", "skip", "-")
               for c in cells)
    assert sum(c.metadata["slideshow"]["slide_type"] == "slide" for c in cells) >= 5
    chapter = name[:5].replace("_", ".")
    from kvlab import exercises
    kinds = {exercises.exercise(k).kind for k in exercises.list_exercises(chapter)}
    assert len(kinds - {"compute"}) >= 2, kinds  # at least two of errata / interpret / parameter
    for key in exercises.list_exercises(chapter):
        assert f'exercises.check("{key}"' in text, key
    for key in exercises.list_predictions(chapter):
        predicted, revealed = text.find(f'exercises.predict("{key}"'), text.find(f'exercises.reveal("{key}"')
        assert 0 <= predicted < revealed, f"{key}: predicted before it is revealed"
    assert f'exercises.summary("{chapter}")' in text


def test_the_chapter_sizes_are_the_ones_the_claims_tests_hold():
    """tests/test_claims.py checks fast == full verdicts for (600, 100) and (2000, 400): the chapter's sizes."""
    src = "\n".join(c.source for c in _sources("2_2_6_applications.ipynb"))
    assert "REQUESTS = exercises.sized(2000, 600)" in src and "LONG_REQUESTS = exercises.sized(400, 100)" in src


# ---------------------------------------------------------------------------------------------- 2.2.4
@pytest.mark.parametrize("n", [512, 128])  # the chapter's full and fast sizes
def test_compaction_cost_rises_then_falls_and_one_size_has_no_unusable_memory(n):
    rows = [ch2_2_4.compaction_experiment(f, n=n) for f in ch2_2_4.FRACTIONS]
    moves = [r[0] for r in rows]
    assert 0 < moves.index(max(moves)) < len(moves) - 1, moves
    freed = [int(f * n) for f in ch2_2_4.FRACTIONS]
    assert [r[3] for r in rows] == [k // 4 for k in freed]  # after compaction every 4 free blocks form one window
    one = [ch2_2_4.compaction_experiment(f, n=n, block_sizes=(16,)) for f in ch2_2_4.FRACTIONS]
    assert {r[1] for r in one} == {0} and [r[0] for r in one] == moves


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_chapter_2_2_4_prints_its_conclusions(printed):
    out = printed(LATE[0])
    assert re.search(r"a 64-token request fails", out)
    assert "four equal FREE 64 KiB buffers:              75 -> should_defragment: True" in out
    assert "kvlab, one block size, four FREE blocks:     {'fragmentation_percent': 0" in out
    assert "(a) FREE blocks without data: []" in out
    assert ("(b) moves in one call: [(1, 2)] | source still ALLOCATED with refs 1 | target ALLOCATED refs 0 "
            "capacity 8 KiB") in out
    assert "under 1 MB: False" in out
    assert re.search(r"all bitwise equal after compaction: True \| refcounts of their blocks: \{1\}", out)
    assert "the 64-token request now succeeds" in out
    assert "moves rise, then fall (most at 50% freed); one block size: unusable free memory always {0}" in out


# ---------------------------------------------------------------------------------------------- 2.2.5
@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_chapter_2_2_5_prints_its_conclusions(printed):
    out = printed(LATE[1])
    assert re.search(r"with pre-allocation only the first burst splits \(\d+ = \d+ / \d+ bursts: True\)", out)
    assert re.search(r"without pre-allocation :\s+\d+ splits", out)
    assert "holds up to 16 blocks (6% of the pool) in reserve" in out  # one burst (fast mode: BURST = 16)
    wide = re.search(r"the reserve grows to \d+ blocks \((\d+) bursts' worth\) for the same splits \((\d+)\)", out)
    assert wide and int(wide[1]) > 1 and f"only the first burst splits ({wide[2]} =" in out
    assert "locks at n=1 are equal ( 2 = 2 ): the n=1 row compares identical work" in out
    assert "batching takes 16 times fewer locks (n = 16)" in out
    assert "reserved for tenant 1: 48 | free for everyone else: 16" in out


# ---------------------------------------------------------------------------------------------- 2.2.6
@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_chapter_2_2_6_prints_its_conclusions(printed):
    out = printed(LATE[2])
    assert "the max-length baseline never runs more than 8 requests (max 8)" in out
    assert "exact-length runs within 20% of paging's concurrency" in out
    assert re.search(r"mean latency \d+% lower than max-length, under 10% apart from exact-length", out)
    assert "the reservation shortens the calm tenant's latency by 20% or more" in out
    assert re.search(r"vs max-length, paging needs \d+% less memory per token held \(at least the text's 40%\)", out)
    assert re.search(r"vs exact-length, paging needs \d+% less memory per token held \(less than the text's 40%\)", out)
    assert "paged throughput is under 1.5x either baseline" in out
    assert "the cache never serves more than the unbounded bound: True" in out
    assert "with 8x the memory nothing is evicted (0) and the cache reaches the bound: True" in out
    rows = {line.split(")")[0] + ")": line.split()[-2:] for line in out.splitlines()
            if re.match(r"^\S+ \(.*\)\s+(supported|NOT)\s+(supported|NOT)$", line)}
    assert list(rows.values()) == [["supported", "supported"], ["supported", "NOT"], ["supported", "NOT"],
                                   ["supported", "supported"], ["supported", "NOT"], ["NOT", "NOT"]]
    # The real model (SmolLM2-135M, wall clock) beside metadata mode: the same block accounting, the same TTFT order.
    assert "| clock: wall" in out
    assert "block accounting identical in both modes (steps, blocks, prefix hits, preemptions): True" in out
    assert re.search(r"(\d+) of (\d+) requests run at once in both modes; every request gets its first token in the "
                     r"same step, so TTFTs rank alike in both clocks: True", out)
    assert re.search(r"request\(s\) \[\d+(, \d+)*\] waited longest for the first token \(\d+ steps\)", out)


# ---------------------------------------------------------------------------------------------- 2.2.7
@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_chapter_2_2_7_measures_transfer_against_recomputing_the_real_model(printed):
    out = printed("2_2_7_beyond_one_machine.ipynb")
    assert "smollm2-135m: 46,080 bytes of K/V per token (float32), 512 for TinyConfig" in out
    assert ("on the real model, moving the KV beats recomputing it at every length measured (256-1,024 tokens): "
            "True") in out
    assert re.search(r"recomputing takes at least \d+x as long as moving the KV over loopback; a link faster than "
                     r"\d+ MB/s", out)


# ---------------------------------------------------------------------------------------------- checkers
def _reference_fragmentation(free, top_order):
    total = int(free.sum())
    if not total:
        return 0
    k = 1 << top_order
    windows = free[: len(free) // k * k].reshape(-1, k)
    return int(round(100 * (1 - k * int(windows.all(axis=1).sum()) / total)))


def _ignores_alignment(free, top_order):
    """Counts every run of 2**top_order free blocks as usable, wherever it starts."""
    total, k, usable, run = int(free.sum()), 1 << top_order, 0, 0
    for f in [*free.tolist(), False]:
        if f:
            run += 1
        else:
            usable, run = usable + run // k * k, 0
    return int(round(100 * (1 - usable / total))) if total else 0


def _text_formula(free, top_order):
    """The text's (total_free - largest_free) / total_free over the free blocks, here all of one size."""
    n = int(free.sum())
    return int((n - 1) / n * 100) if n else 0


def test_the_fragmentation_checker_tells_the_reference_from_the_usual_wrong_functions():
    from kvlab import exercises

    assert exercises.check("2.2.4-fragmentation", _reference_fragmentation)
    for wrong in (_ignores_alignment, _text_formula, lambda free, top_order: 0):
        result = exercises.check("2.2.4-fragmentation", wrong)
        assert not result and "你的函数返回" in result.message, wrong


def test_the_errata_checker_names_each_wrong_part():
    from kvlab import exercises

    assert ch2_2_4.reallocation_scenario() == (1, 2, 0, 8)
    assert exercises.check("2.2.4-errata", [1, 2, 0, 8])
    wrong = exercises.check("2.2.4-errata", (1, 1, 1, 16))  # what the text's code means to do
    assert not wrong and [d.startswith("✓") for d in wrong.details] == [True, False, False, False]


def test_choice_exercises_refuse_an_answer_that_is_no_choice_without_measuring(monkeypatch):
    from kvlab import exercises
    from kvlab.exercises import ch2_2_6

    def never(*a, **k):
        raise AssertionError("measured for a malformed answer")
    monkeypatch.setattr(ch2_2_6, "long_sequence_bottleneck", never)
    monkeypatch.setattr(ch2_2_6, "memory_trend", never)
    for key in ("2.2.6-bottleneck", "2.2.6-memory", "2.2.4-curve", "2.2.5-gain"):
        result = exercises.check(key, "memory?")
        assert not result and "选一个" in result.message, key
