"""Chapters 2.2.4-2.2.7 teach what kvlab measures: each runs in fast mode and prints the conclusions its prose draws,
and these tests hold the printed conclusions (a planted bug in what a chapter measures changes a line here).
Timing figures are never asserted; the conclusions asserted are counts, verdicts and simulated seconds. The
figures that differ between fast and full mode are checked at both sizes where they are cheap (the claims at both
sizes are in ``tests/test_claims.py``)."""
from __future__ import annotations

import json
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
    assert re.search(r"\d+ 个对齐的 4 块窗口全空 \(aligned 4-block windows wholly free\)；池的 64-token 请求失败", out)
    assert re.search(r"kvlab 的 DynamicAllocator \(on the same layout\) -> SERVED，策略 \(strategy\) merge", out)
    assert "四个一样大的 64 KiB 空闲缓冲区 (four equal FREE 64 KiB buffers):     75 -> should_defragment: True" in out
    assert ("kvlab，一种块大小，四个 FREE 块 (kvlab, one block size, four FREE blocks): "
            "{'fragmentation_percent': 0") in out
    assert "(a) FREE 块没有数据 (FREE blocks without data)：_reallocate_active_blocks() -> False" in out
    assert ("(b) 一次调用 (one call)：块 1 复制到块 [2]，源块仍是 (source still) ALLOCATED、引用 1；"
            "目标 (target) ALLOCATED、引用 0、容量 (capacity) 8 KiB；块 1 的数据现在在 2 个块里") in out
    assert re.search(r"Llama-3-8B .* 块大小 16: 全部层 \(all layers\)   2\.00 MiB -> "
                     r"小于 1MB \(under 1 MB\): False", out)
    assert re.search(r"压缩后逐位相同 \(all bitwise equal after compaction\): True \| "
                     r"它们的块的引用计数 \(refcounts of their blocks\): \{1\}", out)
    assert "池的 64-token 请求现在成功了 (the 64-token request now succeeds)" in out
    assert ("搬动数先升后降 (rise, then fall)（释放 50% 时最多 (most at 50% freed)）；"
            "一种块大小时不可用空闲内存始终 (one block size: unusable free memory always) {0}") in out


def _conclusions(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("CONCLUSIONS ")]
    assert len(lines) == 1, "a chapter prints one CONCLUSIONS line"
    return json.loads(lines[0].removeprefix("CONCLUSIONS "))


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_chapter_2_2_4_conclusions(printed):
    c = _conclusions(printed(LATE[0]))
    code = [x for x in _sources(LATE[0]) if x.cell_type == "code"]
    tagged = [i for i, x in enumerate(code) if "conclusions" in x.metadata.get("tags", [])]
    assert tagged == [len(code) - 1], "one cell tagged 'conclusions', the chapter's last code cell"
    # the pool's own call fails only for want of merging: aligned free windows exist and the allocator merges
    assert c["pool_call_fails"] and c["aligned_windows_free"]
    assert c["dynamic_allocator_serves_it"] == ["SERVED", "merge"]
    assert (c["text_formula_four_equal_blocks"], c["kvlab_one_size_fragmentation"]) == (75, 0)
    assert c["text_free_blocks_without_data_move"] is False
    assert c["text_one_call"] == list(ch2_2_4.reallocation_scenario()) == [1, 2, 0, 8]
    # (returned, FREE KiB, the text's free KiB, its fragmentation %, holders of block 1's data, of block 0's)
    assert c["text_calls"] == [[None, 128, 128, 75, 1, 1], [True, 96, 120, 66, 2, 1], [True, 64, 112, 50, 3, 1],
                               [True, 32, 104, 0, 4, 1], [False, 32, 104, 0, 4, 1], [False, 32, 104, 0, 4, 1]]
    assert c["under_1mb"] == {"Llama-3-8B": {"16": [False, True], "64": [False, True]},
                              "Llama-3.2-1B": {"16": [True, True], "64": [False, True]},
                              "SmolLM2-135M": {"16": [True, True], "64": [False, True]}}
    assert c["survived"] and c["refcounts_after"] == [1] and c["big_block_after_compaction"]
    assert c["moves_rise_then_fall"] and c["one_size_unusable"] == [0]
    m = c["magnitudes"]
    assert m["base_blocks"] == 128 and 0 < m["aligned_windows"] <= m["free_base_blocks"] // 4
    assert m["fragmentation_percent_after"] < m["fragmentation_percent_before"]


@pytest.mark.parametrize("n", [512, 128])  # the chapter's full and fast sizes
def test_2_2_4_the_pool_call_fails_only_for_want_of_merging_at_both_sizes(n):
    from kvlab import DynamicAllocator, KVSpec, OutOfBlocksError
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, device="cpu")
    pool, _ = ch2_2_4.fragmented_pool(spec, n)
    assert ch2_2_4.aligned_free_windows(pool) > 0
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1, size_class=2)
    twin, _ = ch2_2_4.fragmented_pool(spec, n)
    assert (twin.snapshot()["status"] == pool.snapshot()["status"]).all()
    assert DynamicAllocator(twin).allocate_optimal_block(size_class=2).strategy == "merge"


# ---------------------------------------------------------------------------------------------- 2.2.5
def _untimed(c: dict) -> dict:
    """A chapter's conclusions without its magnitudes and its timing verdicts (keys ``timing_...``): what the
    tests assert (no timing assertions)."""
    return {k: v for k, v in c.items() if k != "magnitudes" and not k.startswith("timing_")}


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_chapter_2_2_5_prints_its_conclusions(printed):
    out = printed(LATE[1])
    assert "missing from font" not in out  # the figures' Chinese labels are drawn (kvlab.viz.use_cjk_font)
    assert re.search(r"结论：有预分配时只有第一个高峰切分（\d+ = \d+ / \d+ 个高峰：True）", out)
    assert re.search(r"结论：切分只随预分配变：无预分配 逐个 (\d+) = 批量 \1，有预分配 逐个 (\d+) = 批量 \2 ", out)
    assert re.search(r"结论：锁只随批量变：逐个 无预分配 (\d+) = 有预分配 \1，批量 无预分配 (\d+) = 有预分配 \2 ", out)
    assert "空闲时最多预留 16 块（池的 6%）" in out  # one burst (fast mode: BURST = 16)
    wide = re.search(r"预留涨到 \d+ 块（(\d+) 个高峰的量），切分一样多（(\d+)）", out)
    assert wide and int(wide[1]) > 1 and f"只有第一个高峰切分（{wide[2]} =" in out
    assert "结论：n=1 时锁次数相等（2 = 2）：n=1 那一行比较的是同样的工作" in out
    assert "结论：批量拿锁的次数少 16 倍（n = 16）" in out
    assert "给租户 1 预留 (reserved for tenant 1): 48 | 别人可用的空闲块 (free for everyone else): 16" in out
    assert "结论：两种做法拿到的是同一批块：True" in out


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_chapter_2_2_5_conclusions(printed):
    c = _conclusions(printed(LATE[1]))
    assert set(c) >= {"timing_fast_pool_batched_over_2x", "magnitudes"}
    assert _untimed(c) == {
        "splits_follow_preallocation_only": True, "locks_follow_batching_only": True,
        "only_first_burst_splits": True, "wider_window_more_reserve_same_splits": True,
        "reserve_for_tenant_1": [48, 16], "tenant_2_refused": True, "locks_n1_equal": True,
        "locks_per_call": [[2, 2]], "contention_lock_ratio": 16, "batching_same_blocks": True}
    m = c["magnitudes"]
    assert m["splits_without"] == 10 * m["splits_with"] and m["reserve"] == 16 < m["wide_reserve"]  # fast mode


# ---------------------------------------------------------------------------------------------- 2.2.6
YES, NO = "(yes)", "(no)"
# claim -> (vs max-length, vs exact-length), as tests/test_claims.py holds them at both sizes
VERDICTS_2_2_6 = [[YES, YES], [YES, NO], [YES, NO], [YES, YES], [YES, NO], [NO, NO]]


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_chapter_2_2_6_prints_its_conclusions(printed):
    out = printed(LATE[2])
    assert "missing from font" not in out
    assert "结论：最大长度基线同时最多只跑 8 个请求（实测最多 8）" in out
    assert "结论：精确长度基线的并发与分页相差不到 20%" in out
    assert re.search(r"结论：平均时延比最大长度基线低 \d+%，与精确长度基线相差不到 10%", out)
    assert "结论：预留让小租户的平均时延缩短 20% 以上：True" in out
    assert re.search(r"结论：对最大长度基线，分页每个 token 少用 \d+% 的内存（达到文本的 40%）", out)
    assert re.search(r"结论：对精确长度基线，分页每个 token 少用 \d+% 的内存（不到文本的 40%）", out)
    assert "结论：分页的吞吐对两个基线都不到 1.5 倍" in out
    # the latency on long sequences: the percentages are printed, the verdict is the direction only
    assert re.search(r"比最大长度基线 \+\d+%，比精确长度基线 \+\d+%（100 个请求）", out)
    assert "结论：分页的平均时延不低于任何一个基线：True" in out and "结论：平均首 token 时间分页最低：True" in out
    assert re.search(r"结论：照文本的写法，引擎要多走 \d+ 倍的步数", out)
    assert "结论：缓存的命中从不超过无界上限：True" in out
    assert "结论：8 倍内存时没有淘汰（0），命中正好达到上限：True" in out
    assert re.search(r"结论：预取把换入的等待缩短了 \d+%，总时间只缩短 [\d.]+%（不到 5%）", out)
    rows = [line.split()[:4] for line in out.splitlines()
            if re.match(r"^(成立|不成立)\s+\((yes|no)\)\s+(成立|不成立)\s+\((yes|no)\)\s+\S", line)]
    assert [[r[1], r[3]] for r in rows] == VERDICTS_2_2_6
    # The real model (SmolLM2-135M, wall clock) beside metadata mode: the same block accounting, the same TTFT order.
    assert "钟 (clock): wall" in out
    assert "结论：两种模式的块账目完全相同（步数、块、前缀命中、抢占）：True" in out
    assert re.search(r"结论：两种模式下都是 (\d+) / (\d+) 个请求同时运行；每个请求在同一步拿到第一个 token，"
                     r"所以 TTFT 在两个钟上排序相同：True", out)
    assert re.search(r"结论：请求 \[\d+(, \d+)*\] 等第一个 token 最久（\d+ 步）", out)


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_chapter_2_2_6_conclusions(printed):
    from kvlab.serve.claims import CLAIMS
    c = _conclusions(printed(LATE[2]))
    yes = {YES: True, NO: False}
    assert _untimed(c) == {
        "max_length_cap": 8, "max_length_max_running": 8, "exact_within_20pct_concurrency": True,
        "latency_cut_vs_max_length_at_least_half": True, "latency_vs_exact_within_10pct": True,
        "reservation_shortens_calm_by_20pct": True,
        "memory_less_at_least_40pct": {"max-length": True, "exact-length": False},
        "throughput_under_1_5x_both": True, "long_latency_paged_not_lower": True, "long_ttft_paged_lowest": True,
        "rag_as_text_over_10x_steps": True, "prefix_hits_within_bound": True,
        "prefix_reaches_bound_without_eviction": True, "prefetch_cuts_swap_in_stall": True,
        "prefetch_time_cut_under_5pct": True, "sequence_100k_finished": True,
        "verdicts": {t: [yes[a], yes[b]] for t, (a, b) in zip(CLAIMS, VERDICTS_2_2_6)},
        "real_model": {"accounting_identical": True, "ttft_ranks_alike": True}}
    m = c["magnitudes"]
    assert min(m["long_latency_above_baseline"].values()) >= 0 and m["rag_steps_ratio"] > 10


# ---------------------------------------------------------------------------------------------- 2.2.7
CH7 = "2_2_7_beyond_one_machine.ipynb"


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_chapter_2_2_7_measures_transfer_against_recomputing_the_real_model(printed):
    out = printed(CH7)
    assert "missing from font" not in out
    assert "贪心生成的 token 与单进程相同 (greedy tokens equal to one process)：True" in out
    assert "tp=3：tp=3 does not divide the 4 query heads" in out
    assert "smollm2-135m：每个 token 的 K/V 46,080 字节（float32），TinyConfig 是 512" in out
    assert "结论：真实模型上，在测过的每个长度（256–1,024 token）传 KV 都比重新计算快：True" in out
    assert re.search(r"结论：重新计算至少是经回环传输的 \d+ 倍；对这台 CPU，链路只要快过 \d+ MB/s", out)
    # the shortest prompt's ratio is printed and judged by nothing
    assert re.search(r"最短的提示（512 token）：重新计算 / 传输 = [\d.]+，"
                     r"两个几毫秒的时间之比，每次运行都会变，不作判断", out)


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_chapter_2_2_7_conclusions(printed):
    c = _conclusions(printed(CH7))
    assert {k for k in c if k.startswith("timing_")} == {
        "timing_recompute_grows_faster_than_prompt", "timing_transfer_wins_at_longest_prompt",
        "timing_real_model_transfer_wins_everywhere"}
    tp = {"tokens_equal": True, "logits_within_1e-4": True, "block_bytes_halved": True}
    assert _untimed(c) == {
        "skipped_blocks_are_the_shared_prefix": True, "disagg_tokens_equal": True, "disagg_logits_identical": True,
        "two_pools_differ": True, "rechunked_tokens_equal": True, "spec_mismatch_on_both_ranks": True,
        "spec_mismatch_pools_untouched": True, "silent_peer_error": "TransferTimeoutError", "survivor_clean": True,
        "tp": {"tp=2": tp, "tp=4": tp}, "tp3_refused": True, "router_blocks_vs_pool": "fewer",
        "router_is_cached_plus_registered": True, "router_missed_no_batch": True}
    assert c["magnitudes"]["blocks_skipped"] == 16  # fast mode: 4 prompts x 64 shared tokens / 16
    r = c["magnitudes"]["router"]  # the router's blocks: the cached ones and the registered full ones, no others
    assert r["blocks"] == r["cached"] + r["registered"] < r["held"] and r["partial"] > 0


def test_2_2_7_move_or_recompute_moves_the_bytes_of_each_length():
    import kvlab.distributed as kd
    rows = kd.move_or_recompute([64, 160], threads=True, rounds=1, timeout=30)
    assert [(r.tokens, r.bytes) for r in rows] == [(64, 64 * 512), (160, 160 * 512)]  # TinyConfig: 512 bytes/token
    assert all(r.ratio == r.recompute / r.transfer and r.break_even_mb_s == r.bytes / r.recompute / 1e6 for r in rows)
    table = kd.move_or_recompute_table(rows).splitlines()
    assert table[0].startswith("列 (columns)：") and len(table) == 2 + len(rows)


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
