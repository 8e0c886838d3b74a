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
from kvlab import (ChunkSizeOptimizer, ConfigError, KVSpec, Request, TinyConfig, TinyLlama, Workload, make_workload,
                   measure_block_size, plot_sweep, sweep)
from kvlab.memory import sizing
from kvlab.memory.sizing import GOALS, SweepResult, SweepRow, measure_attention_ms, measure_decode_ms


def optimizer_with_p95(p95: float) -> ChunkSizeOptimizer:
    opt = ChunkSizeOptimizer()
    opt.sequence_length_stats = {"mean": p95, "median": p95, "p95": p95, "p99": p95, "max": int(p95)}
    return opt


def text_rule(p95: float, goal: str):
    """The text's formulas, written fresh with numpy as the text evaluates them (p95 is a numpy float)."""
    p95 = np.float64(p95)
    if goal == "memory_efficient":
        return min(max(p95 // 4, 512), 2048)
    if goal == "performance_optimal":
        return min(max(p95 // 6, 256), 1024)
    sizes = [64, 128, 256, 512, 1024]
    return sizes[min(len(sizes) - 1, int(np.log2(p95 // 100)))]


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
    assert "recommended: 2" in [t.get_text() for t in fig.axes[3].get_legend().get_texts()]
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
