"""ChunkSizeOptimizer (text §2.2.1): the text's rule of thumb, fixed, and the measured sweep."""
from __future__ import annotations

import io
import math
import warnings
from dataclasses import astuple, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab import (BlockPool, ChunkSizeOptimizer, ConfigError, KVSpec, Request, TextChunkSizeOptimizer, TinyConfig,
                   TinyLlama, Workload, make_workload, measure_block_size, plot_sweep, sweep)
from kvlab.memory import sizing
from kvlab.memory.sizing import (GOALS, MEMORY_ONLY, OVERHEAD_LADDER, PickGrid, SweepResult, SweepRow,
                                 contiguous_runs, kv_reads, measure_attention_ms, measure_decode_ms, pick_grid,
                                 plot_pick_grid, prefix_granularity_loss)


def optimizer_with_p95(p95: float) -> ChunkSizeOptimizer:
    opt = ChunkSizeOptimizer()
    opt.sequence_length_stats = {"mean": p95, "median": p95, "p95": p95, "p99": p95, "max": int(p95)}
    return opt


def text_rule(p95: float, goal: str):
    """The text's own code (kvlab.TextChunkSizeOptimizer) at ``p95``, a numpy float as its statistics give it."""
    opt = TextChunkSizeOptimizer()
    opt.sequence_length_stats = {"p95": np.float64(p95)}
    return opt.recommend_chunk_size(goal)


def test_the_texts_optimizer_before_any_analysis_crashes_only_for_balanced():
    """The text reads p95 from an empty defaultdict(int): 0. Two goals answer silently, one raises."""
    opt = TextChunkSizeOptimizer()
    assert opt.recommend_chunk_size("memory_efficient") == 512
    assert opt.recommend_chunk_size("performance_optimal") == 256
    with np.errstate(divide="ignore"), pytest.raises(OverflowError):
        opt.recommend_chunk_size("balanced")
    with np.errstate(divide="ignore"), pytest.raises(OverflowError):
        opt.recommend_chunk_size("fastest")  # an unknown goal is the balanced branch


def test_the_texts_optimizer_returns_numpy_floats_from_its_clamps():
    opt = TextChunkSizeOptimizer()
    assert opt.analyze_sequence_distribution([[0] * 3000] * 4)["p95"] == 3000
    got = {g: opt.recommend_chunk_size(g) for g in GOALS}
    assert got == {"memory_efficient": 750, "performance_optimal": 500, "balanced": 1024}
    assert isinstance(got["memory_efficient"], np.floating) and isinstance(got["balanced"], int)


# ---------------------------------------------------------------------------------------------------- analysis
def test_analyze_matches_numpy_for_token_sequences_lengths_and_workloads():
    seqs = [[0] * n for n in (5, 50, 120, 7, 300)]
    stats = ChunkSizeOptimizer().analyze_sequence_distribution(seqs)
    lens = np.array([5, 50, 120, 7, 300])
    assert stats == {"mean": lens.mean(), "median": 50.0, "p95": np.percentile(lens, 95),
                     "p99": np.percentile(lens, 99), "max": 300}
    assert ChunkSizeOptimizer().analyze_sequence_distribution(lens.tolist()) == stats
    w = make_workload("code", 100, 0)
    assert ChunkSizeOptimizer().analyze_sequence_distribution(w)["max"] == int(w.sequence_lengths().max())


@pytest.mark.parametrize("bad", [[], [3, -1], [3, 2.5], [True], [object()]])
def test_analyze_rejects_bad_input(bad):
    with pytest.raises(ConfigError):
        ChunkSizeOptimizer().analyze_sequence_distribution(bad)


def test_recommend_needs_statistics_and_a_known_goal():
    with pytest.raises(ConfigError, match="analyze_sequence_distribution"):
        ChunkSizeOptimizer().recommend_chunk_size()
    with pytest.raises(ConfigError, match="'fastest'"):
        optimizer_with_p95(500).recommend_chunk_size("fastest")


# ---------------------------------------------------------------------------------------------------- the rule
def test_the_texts_balanced_rule_crashes_below_p95_100_and_ours_does_not():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy warns about log2(0) before int() raises
        with pytest.raises(OverflowError):
            text_rule(60.0, "balanced")
    assert optimizer_with_p95(60.0).recommend_chunk_size("balanced") == 64
    assert optimizer_with_p95(0.0).recommend_chunk_size("balanced") == 64


@pytest.mark.parametrize("p95, size", [(0, 64), (99.9, 64), (100, 64), (199, 64), (200, 128), (399, 128),
                                       (400, 256), (799, 256), (800, 512), (1599, 512), (1600, 1024),
                                       (10**6, 1024)])
def test_balanced_table(p95, size):
    assert optimizer_with_p95(p95).recommend_chunk_size("balanced") == size


@settings(max_examples=200, deadline=None)
@given(p95=st.floats(100, 1e7), goal=st.sampled_from(GOALS))
def test_rule_equals_the_text_wherever_the_text_runs(p95, goal):
    got = optimizer_with_p95(p95).recommend_chunk_size(goal)
    assert type(got) is int and got == text_rule(p95, goal)


@settings(max_examples=100, deadline=None)
@given(p95=st.floats(0, 2047.99))
def test_memory_efficient_floor_ignores_the_data(p95):
    """Documented arbitrariness: below p95 = 2048 the floor answers 512 whatever the lengths."""
    assert optimizer_with_p95(p95).recommend_chunk_size("memory_efficient") == 512


@pytest.mark.parametrize("name, p95, sizes", [  # the table in kvlab/memory/sizing.py's docstring
    ("chat", 390.0, (512, 256, 128)),
    ("document", 3344.1, (836, 557, 1024)),
    ("code", 1873.1, (512, 312, 1024)),
    ("retrieval", 7250.8, (1812, 1024, 1024)),
])
def test_rule_on_the_texts_scenarios(name, p95, sizes):
    opt = ChunkSizeOptimizer()
    assert opt.analyze_sequence_distribution(make_workload(name, 2000, 0))["p95"] == pytest.approx(p95, abs=0.05)
    assert tuple(opt.recommend_chunk_size(g) for g in GOALS) == sizes


def test_rule_on_retrieval_queries_alone_is_the_texts_crash_case():
    queries = [r.prompt_len - r.prefix_len for r in make_workload("retrieval", 2000, 0)]
    opt = ChunkSizeOptimizer()
    assert opt.analyze_sequence_distribution(queries)["p95"] < 100
    assert tuple(opt.recommend_chunk_size(g) for g in GOALS) == (512, 256, 64)


# ---------------------------------------------------------------------------------------------------- measuring
TINY = Workload("tiny", [Request(0, 0.0, 10, 3, prefix_id="sys", prefix_len=6),
                         Request(1, 1.0, 7, 2, prefix_id="sys", prefix_len=6),
                         Request(2, 2.0, 5, 0)])


@pytest.mark.parametrize("bs, blocks, tokens, entries, calls, lost", [
    # B=2: the prefix's 3 full blocks are shared; nothing lost.  r0: 7 blocks (5 prompt in 1 call, 2 decode
    # calls); r1: 5 entries, 3 shared, 1 prompt call + 1 decode; r2: 3 blocks in 1 call.
    (2, 7 + 2 + 3, 13 + 3 + 5, 7 + 5 + 3, 3 + 2 + 1, 0),
    # B=4: one shared block, 2 prefix tokens sit in a partly filled block and are stored again by r1.
    (4, 4 + 2 + 2, 13 + 5 + 5, 4 + 3 + 2, 2 + 2 + 1, 2),
    # B=8: the 6-token prefix fills no block: nothing can be shared, all 6 are lost.
    (8, 2 + 2 + 1, 13 + 9 + 5, 2 + 2 + 1, 1 + 2 + 1, 6),
])
def test_measure_block_size_by_hand(bs, blocks, tokens, entries, calls, lost):
    row = measure_block_size(TINY, bs, check=True)
    assert (row.blocks, row.tokens, row.table_entries, row.alloc_calls) == (blocks, tokens, entries, calls)
    assert (row.prefix_tokens, row.prefix_lost) == (6, lost)
    assert row.waste == pytest.approx(1 - tokens / (blocks * bs))
    assert row.prefix_loss == pytest.approx(lost / 6)
    assert math.isnan(row.attention_ms)


def reference(workload: Workload, B: int) -> tuple[int, ...]:
    """The same counts by arithmetic alone: no pool."""
    seen: set[str] = set()
    blocks = tokens = entries = calls = ptok = lost = 0
    for r in workload:
        nb, pb = -(-r.total_len // B), -(-r.prompt_len // B)
        shared = 0
        if r.prefix_id in seen:
            shared = r.prefix_len // B
            ptok, lost = ptok + r.prefix_len, lost + r.prefix_len % B
        elif r.prefix_id:
            seen.add(r.prefix_id)
        blocks, tokens = blocks + nb - shared, tokens + r.total_len - shared * B
        entries, calls = entries + nb, calls + (pb > shared) + (nb - pb)
    return blocks, tokens, entries, calls, ptok, lost


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), name=st.sampled_from(["chat", "code", "mixed"]), n=st.integers(1, 30),
       bs=st.sampled_from([1, 3, 16, 64, 2048]))
def test_measure_block_size_equals_reference(seed, name, n, bs):
    w = make_workload(name, n, seed)
    r = measure_block_size(w, bs, check=True)
    assert (r.blocks, r.tokens, r.table_entries, r.alloc_calls, r.prefix_tokens, r.prefix_lost) == reference(w, bs)
    assert r.tokens <= r.slots


def test_sweep_counts_and_cost_model_by_hand():
    res = sweep(TINY, [8, 2, 4], attention=False, progress=False)
    assert [r.block_size for r in res.rows] == [2, 4, 8]
    # the counts, field by field; the timings are NaN (not measured), and Python 3.13's dataclass == says NaN != NaN
    assert [astuple(r)[:-2] for r in res.rows] == [astuple(measure_block_size(TINY, b))[:-2] for b in (2, 4, 8)]
    assert all(math.isnan(r.attention_ms) for r in res.rows)
    # entries + calls: 21, 14, 9 -> normalised by 21; waste 3/24, 9/32, 13/40; prefix loss 0, 1/3, 1
    # attention slots (entries x B): 30, 36, 40 -> normalised by 40
    assert [r.attention_slots for r in res.rows] == [30, 36, 40]
    assert res.costs("balanced") == pytest.approx({2: 3 / 24 + 0.5 * 1 + 0.5 * 30 / 40,
                                                   4: 9 / 32 + 0.5 / 3 + 0.5 * 14 / 21 + 0.5 * 36 / 40,
                                                   8: 13 / 40 + 0.5 * 1 + 0.5 * 9 / 21 + 0.5 * 40 / 40})
    assert res.costs("memory_efficient") == pytest.approx({2: 3 / 24 + 0.1 + 0.1 * 30 / 40,
                                                           4: 9 / 32 + 1 / 3 + 0.1 * 14 / 21 + 0.1 * 36 / 40,
                                                           8: 13 / 40 + 1 + 0.1 * 9 / 21 + 0.1})
    assert res.recommend("balanced") == res.recommend("memory_efficient") == 2
    md = res.to_markdown()
    assert "| 2 | 12 | 12.5 | 15 | 6 | 0.0 | 30 | - | 1.000 **<-** |" in md and md.count("**<-**") == 1
    with pytest.raises(ConfigError):
        res.recommend("smallest")


def test_attention_slots_enter_the_cost_and_timings_do_not():
    rows = [SweepRow(b, 1, b, 1, 1, 0, 0, slots) for b, slots in ((16, 64), (32, 16))]
    res = SweepResult("x", 1, rows)
    assert res.costs("performance_optimal") == pytest.approx({16: 0.5 + 1.0, 32: 0.5 + 0.25})
    assert res.recommend("performance_optimal") == 32
    assert res.costs("balanced") == pytest.approx({16: 0.5 + 0.5, 32: 0.5 + 0.5 * 0.25})
    assert res.costs("memory_efficient") == pytest.approx({16: 0.1 + 0.1, 32: 0.1 + 0.1 * 0.25})
    for fast, slow in ((1.0, 9.0), (9.0, 1.0)):  # any timings, in either order: the same costs
        timed = SweepResult("x", 1, [replace(rows[0], attention_ms=fast, attention_spread=(fast, fast)),
                                     replace(rows[1], attention_ms=slow, attention_spread=(slow, slow))])
        assert all(timed.costs(g) == res.costs(g) for g in GOALS)


def test_with_weights_moves_the_recommendation_and_refuses_bad_weights():
    res = sweep(TINY, [2, 4, 8], attention=False, progress=False)
    assert res.recommend("balanced") == 2
    heavy_overhead = res.with_weights("balanced", (0, 0, 1, 0))
    assert heavy_overhead.recommend("balanced") == 8 and heavy_overhead.weights["balanced"] == (0.0, 0.0, 1.0, 0.0)
    assert heavy_overhead.recommend("memory_efficient") == res.recommend("memory_efficient")
    assert res.weights["balanced"] == (1.0, 0.5, 0.5, 0.5)  # the original is untouched
    for bad in [(1, 2, 3), (0, 0, 0, 0), (1, -1, 0, 0), (1, float("nan"), 0, 0), (1, True, 0, 0), ("1", 0, 0, 0)]:
        with pytest.raises(ConfigError, match="weights"):
            res.with_weights("balanced", bad)
    with pytest.raises(ConfigError, match="'fast'"):
        res.with_weights("fast", (1, 1, 1, 1))


def balanced_by_hand(res: SweepResult) -> dict[int, float]:
    """The balanced cost of measured rows, with the weights written out (waste, prefix loss, overhead, attention)."""
    over = max(r.table_entries + r.alloc_calls for r in res.rows)
    reads = max(r.attention_slots for r in res.rows)
    return {r.block_size: 1.0 * r.waste + 0.5 * r.prefix_loss + 0.5 * (r.table_entries + r.alloc_calls) / over
            + 0.5 * r.attention_slots / reads for r in res.rows}


@pytest.mark.parametrize("sizes", [[], [16, 16], [0, 16], [16.0], [True]])
def test_sweep_rejects_bad_sizes(sizes):
    with pytest.raises(ConfigError, match="block sizes"):
        sweep(TINY, sizes, attention=False, progress=False)


def test_measure_rejects_bad_block_size_and_empty_workload():
    with pytest.raises(ConfigError, match="block size"):
        measure_block_size(TINY, 0)
    with pytest.raises(ConfigError, match="no requests"):
        measure_block_size(Workload("empty", []), 16)
    with pytest.raises(ConfigError, match="rounds"):
        measure_attention_ms(TINY, [2], rounds=0)


def test_sweep_times_real_paged_attention():
    w = make_workload("chat", 40, 0)
    steps = []
    ms = measure_attention_ms(w, [16, 64], batch=3, num_heads=2, head_dim=16, rounds=2, device="cpu",
                              on_step=lambda: steps.append(1))
    assert len(steps) == 4 and all(0 < lo <= med <= hi < math.inf for med, lo, hi in ms.values())
    opt = ChunkSizeOptimizer()
    res = opt.sweep(w, [16, 1024], progress=False, batch=3, num_heads=2, head_dim=16, rounds=3, device="cpu")
    assert all(0 < r.attention_spread[0] <= r.attention_ms <= r.attention_spread[1] < math.inf for r in res.rows)
    assert "paged_attention" in res.attention and "2x16" in res.attention and "median of 3 rounds" in res.attention
    assert set(opt.performance_metrics) == {16, 1024} and opt.sequence_length_stats["max"] > 0
    assert res.costs("balanced") == pytest.approx(balanced_by_hand(res), abs=1e-12)
    no_attention = sweep(w, [16, 1024], attention=False, progress=False)
    assert all(no_attention.costs(g) == res.costs(g) for g in GOALS)  # timings are shown, never counted
    assert res.recommend() == res.recommend("balanced") == 16
    assert res.recommend("memory_efficient") == 16


def test_plot_sweep_draws_four_panels():
    res = sweep(TINY, [2, 4, 8], attention=False, progress=False)
    fig = plot_sweep(res, "balanced")
    assert len(fig.axes) == 4
    assert "推荐 (recommended): 2" in [t.get_text() for t in fig.axes[3].get_legend().get_texts()]
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_recommend_breaks_a_tie_toward_the_smaller_block_size():
    rows = [SweepRow(16, 4, 64, 4, 4, 0, 0, 64), SweepRow(32, 2, 64, 2, 2, 0, 0, 64)]  # both waste nothing
    r = SweepResult("w", 1, rows).with_weights("balanced", (1.0, 0.0, 0.0, 0.0))
    assert r.costs("balanced") == {16: 0.0, 32: 0.0} and r.recommend("balanced") == 16


def test_a_refused_sweep_leaves_the_optimizer_as_it_was():
    opt = ChunkSizeOptimizer()
    opt.analyze_sequence_distribution([10, 20, 30])
    before = (dict(opt.sequence_length_stats), dict(opt.performance_metrics))
    with pytest.raises(ConfigError, match="block sizes"):
        opt.sweep(make_workload("chat", 3), [0], attention=False)
    assert (opt.sequence_length_stats, opt.performance_metrics) == before


# ---------------------------------------------------------------------------------------------- a model's decode step
@pytest.mark.parametrize("model, sizes, kw, what", [
    (None, [16], {}, "model"), ("smollm2-135m", [16], {}, "model"), (TinyConfig(), [16], {}, "model"),
    ("tiny", [], {}, "block sizes"), ("tiny", [16, 16], {}, "block sizes"), ("tiny", [0], {}, "block sizes"),
    ("tiny", [16], {"rounds": 0}, "rounds"), ("tiny", [16], {"batch": 0}, "batch"),
    ("tiny", [16], {"max_len": 2.5}, "max_len"), ("tiny", [16], {"seed": -1}, "seed"),
    ("tiny", [16], {"on_step": "tick"}, "on_step"), ("tiny", [16], {"workload": Workload("empty", [])}, "no requests"),
])
def test_measure_decode_refuses_bad_input_before_any_work(monkeypatch, model, sizes, kw, what):
    monkeypatch.setattr(sizing, "_model_step_ms", lambda *a: pytest.fail("a refused call timed a step"))
    model = TinyLlama(TinyConfig()) if model == "tiny" else model
    workload = kw.pop("workload", TINY)
    with pytest.raises(ConfigError, match=what):
        measure_decode_ms(model, workload, sizes, **kw)


def test_measure_decode_times_every_size_of_a_tiny_model():
    steps = []
    ms = measure_decode_ms(TinyLlama(TinyConfig()), make_workload("chat", 40, 0), [64, 16], batch=3, max_len=256,
                           rounds=2, on_step=lambda: steps.append(1))
    assert list(ms) == [16, 64] and len(steps) == 4  # ascending sizes; rounds x sizes timings
    for t in ms.values():
        for med, lo, hi in (t.step, t.attention):
            assert 0 < lo <= med <= hi < math.inf
        assert 0 < t.attention_share < math.inf


def test_timing_pools_hand_out_their_blocks_scattered():
    ids = sizing._scattered_pool(64, KVSpec(block_size=4, device="cpu"), seed=0).allocate(64)
    assert sorted(ids) == list(range(64)) and ids != sorted(ids) and ids != sorted(ids, reverse=True)


@pytest.mark.llm
def test_measure_decode_times_the_real_model():
    model = kvlab.load_model("smollm2-135m", progress=False)
    with kvlab.torch_threads(1):  # a second thread mostly waits for a core on a shared machine (3 s steps, not 0.1)
        ms = measure_decode_ms(model, make_workload("chat", 40, 0), [16, 64], batch=2, max_len=256, rounds=1)
    assert list(ms) == [16, 64] and all(0 < t.attention[1] <= t.attention[0] and 0 < t.step[1] <= t.step[0]
                                        for t in ms.values())


# ---------------------------------------------------------------------------------------- which weights pick what
def test_between_sweeps_fewer_sizes_and_renormalises():
    res = sweep(TINY, [2, 4, 8], attention=False, progress=False)
    part = res.between(2, 4)
    assert [r.block_size for r in part.rows] == [2, 4] and part.rows == res.rows[:2]
    # entries + calls 21, 14 now normalised by 21 (as before); attention slots 30, 36 by 36 (not 40)
    assert part.costs("balanced") == pytest.approx({2: 3 / 24 + 0.5 * 1 + 0.5 * 30 / 36,
                                                    4: 9 / 32 + 0.5 / 3 + 0.5 * 14 / 21 + 0.5 * 36 / 36})
    assert len(res.rows) == 3  # the original is untouched
    with pytest.raises(ConfigError, match="no swept block size"):
        res.between(16, 64)


def test_pick_grid_by_hand():
    res = sweep(TINY, [2, 4, 8], attention=False, progress=False)
    grid = pick_grid(res, {"overhead": (0, 0, 1, 0), "waste": (1, 0, 0, 0)}, ranges=((2, 8), (4, 8)))
    assert isinstance(grid, PickGrid) and (grid.workload, grid.goal) == ("tiny", "balanced")
    assert grid.picks == {"overhead": {(2, 8): 8, (4, 8): 8}, "waste": {(2, 8): 2, (4, 8): 4}}
    assert grid.smallest == {(2, 8): 2, (4, 8): 4} and grid.ranges == [(2, 8), (4, 8)]
    assert grid.weights == {"overhead": (0.0, 0.0, 1.0, 0.0), "waste": (1.0, 0.0, 0.0, 0.0)}
    assert grid.sizes() == [2, 4, 8] and grid.cells_in(3, 4) == [("waste", (4, 8))]
    assert grid.picks_smallest("waste") and not grid.picks_smallest("overhead")
    assert grid.never_smaller(("waste", "overhead")) and not grid.never_smaller(("overhead", "waste"))
    with pytest.raises(ConfigError, match="at least one"):
        pick_grid(res, {}, ranges=((2, 8),))
    with pytest.raises(ConfigError, match="weights"):
        pick_grid(res, {"bad": (0, 0, 0, 0)}, ranges=((2, 8),))
    with pytest.raises(ConfigError, match="no swept block size"):
        pick_grid(res)  # the default ranges start at 16


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), name=st.sampled_from(["chat", "code", "document", "retrieval", "mixed"]),
       n=st.integers(20, 150))
def test_what_holds_for_every_weighting(seed, name, n):
    """The two statements the chapter makes across weights and sweep ranges: the memory terms alone pick the
    smallest size swept, and a heavier overhead weight never picks a smaller block."""
    grid = pick_grid(sweep(make_workload(name, n, seed), attention=False, progress=False))
    assert grid.picks_smallest(MEMORY_ONLY)
    assert grid.never_smaller(OVERHEAD_LADDER)


def test_the_azure_pick_moves_with_the_weights_and_the_sweep_range():
    """The chapter's example: "64-128" came from the default weights; overhead 1.0 or equal weights give 256,
    inside the text's 256-512, and so does the default with the sweep starting at 32 or 64."""
    azure = kvlab.load_trace("azure-conv-2023")
    grid = pick_grid(sweep(Workload("azure-conv-2023", azure.requests[:2000]), attention=False, progress=False))
    row = lambda name: [grid.picks[name][r] for r in grid.ranges]  # noqa: E731
    assert grid.ranges == [(16, 2048), (32, 2048), (64, 2048), (16, 512)]
    assert row("默认 (default)") == [128, 256, 256, 128]
    assert row("开销 1 (overhead)")[0] == row("等权 (equal)")[0] == 256
    assert grid.sizes() == [16, 32, 64, 128, 256, 512]


def test_plot_pick_grid_frames_the_cells_in_the_band():
    res = sweep(TINY, [2, 4, 8], attention=False, progress=False)
    grids = [pick_grid(res, {"overhead": (0, 0, 1, 0), "waste": (1, 0, 0, 0)}, ranges=((2, 8), (4, 8)))] * 2
    fig = plot_pick_grid(grids, band=(4, 4))
    assert sum(a.get_visible() for a in fig.axes) == 2
    assert all(len(a.patches) == len(grids[0].cells_in(4, 4)) == 1 for a in fig.axes)
    assert [t.get_text() for t in fig.axes[0].texts] == ["8", "8", "2", "4"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Chinese label without a CJK face warns "Glyph ... missing"
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
    for bad in ([], [res]):
        with pytest.raises(ConfigError, match="PickGrid"):
            plot_pick_grid(bad)


# ---------------------------------------------------------------------------------------- reads and prefix hits
def test_contiguous_runs_follow_the_tensors_layout():
    """KV tensor [2, layers, blocks, 3 tokens, 2 heads, 4 dims], fp32: a block of one layer is 3 * 2 * 4 * 4 = 96
    contiguous bytes; one head's part of it is 3 rows of 16 bytes, 32 bytes apart."""
    pool = BlockPool(4, spec=KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=3, device="cpu"))
    assert contiguous_runs(pool, [1, 2]) == [192]  # neighbours in the table and in memory: one read
    assert contiguous_runs(pool, [2, 1]) == [96, 96]
    assert contiguous_runs(pool, [1], head=1) == [16, 16, 16]
    assert contiguous_runs(pool, [0, 1], layer=1) == [192]
    one_head = BlockPool(4, spec=KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=3, device="cpu"))
    assert contiguous_runs(one_head, [0, 1], head=0) == [96]  # a single head: its tile is the block


@pytest.mark.parametrize("B", [16, 64, 256])
def test_kv_reads_of_a_scattered_sequence(B):
    all_heads, one_head = kv_reads(1000, B), kv_reads(1000, B, head=0)
    blocks = -(-1000 // B)
    assert sum(all_heads) == blocks * B * 8 * 128 * 2 and len(all_heads) <= blocks
    assert len(all_heads) >= blocks - 3  # scattered: hardly any two table neighbours are memory neighbours
    assert one_head == [256] * (blocks * B)  # 8 heads side by side: one head's row is 128 fp16 values, alone
    with pytest.raises(ConfigError, match="tokens"):
        kv_reads(0, B)


def test_prefix_granularity_loss_by_hand():
    """TINY: request 1 finds the 6-token prefix cached (prompt 7: at most 6 tokens can hit). Blocks of 4 share
    one block (4 tokens), of 8 none."""
    assert prefix_granularity_loss(TINY, [1, 4, 8]) == pytest.approx({1: 0.0, 4: 1 / 3, 8: 1.0})
    assert prefix_granularity_loss(Workload("alone", [Request(0, 0.0, 10, 3)]), [16]) == {16: 0.0}
