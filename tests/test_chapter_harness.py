"""The harness chapters 2.2.1, 2.2.3 and 2.2.8 call instead of long cells: each reads or counts what the cell did,
and prints exactly the cell's lines.

* ``kvlab.memory.sizing.trace_lengths``: a trace's length statistics, against numpy on hand-made requests;
* ``kvlab.memory.sizing.decode_table`` / ``judge_decode``: the decode-step timings as a table, and the order they
  show only where (fastest, slowest) ranges do not overlap;
* ``kvlab.memory.sizing.weight_explorer``: its sliders start at the goal's weights and redo the pick on a change;
* ``kvlab.memory.allocator.layout`` / ``prefix_sharing_curve``: a buddy pool drawn one character per base block,
  and the blocks a shared prefix saves, against counts by formula;
* ``BlockWalk.plot``: one bar per position coloured by block, one share bar per block;
* ``kvlab.serve.reuse.decode_forks``: forked samples on a tiny model copy their shared tail block ``n - 1`` times,
  and the logits are the model's own.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kvlab
from kvlab import (BlockPool, ConfigError, DynamicAllocator, KVSpec, Request, SequenceManager, TinyConfig, TinyLlama,
                   Workload, make_workload, sweep)
from kvlab.memory.allocator import layout, prefix_sharing_curve
from kvlab.memory.sizing import WEIGHTS, DecodeTiming, decode_table, judge_decode, trace_lengths, weight_explorer
from kvlab.serve.reuse import decode_forks


# ---------------------------------------------------------------------------------------------- 2.2.1 sizing
def test_trace_lengths_are_numpys_statistics_of_every_request():
    prompts, outputs = [10, 20, 30, 40, 1000], [5, 7, 9, 11, 200]
    w = Workload("t", [Request(i, float(i), p, o) for i, (p, o) in enumerate(zip(prompts, outputs))])
    got = trace_lengths({"t": w, "u": Workload("u", w.requests[:2])})
    assert got["t"] == {"requests": 5, "prompt_mean": 220.0, "prompt_median": 30.0,
                        "prompt_p95": pytest.approx(np.percentile(prompts, 95)), "output_mean": 46.4,
                        "output_median": 9.0}
    assert got["u"]["prompt_mean"] == 15.0
    lines = str(got).splitlines()
    assert len(lines) == 3 and lines[1].split()[:3] == ["t", "5", "|"] and "220.0" in lines[1]
    with pytest.raises(ConfigError):
        trace_lengths({"empty": Workload("empty", [])})


def _printed(capsys) -> list[str]:
    """Lines printed since the last call, without the terminal codes ``clear_output`` writes outside a kernel."""
    return [line for line in capsys.readouterr().out.splitlines() if line and "\x1b" not in line]


def test_weight_explorer_starts_at_the_goals_weights_and_redoes_the_pick(capsys):
    result = sweep(make_workload("chat", 60, 0), [16, 64, 256], attention=False)
    box = weight_explorer(result, "balanced")  # outside a kernel the Output widget's prints reach stdout
    *sliders, out = box.children
    assert tuple(s.value for s in sliders) == WEIGHTS["balanced"]
    first = _printed(capsys)
    want = result.recommend("balanced")
    assert first == [f"权重 (weights) {list(WEIGHTS['balanced'])} -> chat 上 balanced 推荐的块 (recommended): {want}"]
    for s in sliders:
        s.value = 0.0
    assert _printed(capsys)[-1] == "至少一个权重要大于 0 (at least one weight must be > 0)"
    sliders[0].value = 4.0  # only waste counts: the smallest size wastes least
    assert _printed(capsys)[-1].endswith("[4.0, 0.0, 0.0, 0.0] -> chat 上 balanced 推荐的块 "
                                                             "(recommended): 16")
    with pytest.raises(ConfigError):
        weight_explorer(result, "no such goal")


def _timing(step: tuple[float, float, float], attention: tuple[float, float, float]) -> DecodeTiming:
    return DecodeTiming(step, attention, attention[0] / step[0])


def test_decode_table_has_one_row_per_size_with_median_and_range():
    timings = {16: _timing((400, 370, 440), (180, 170, 200)), 1024: _timing((270, 220, 320), (110, 100, 120))}
    table = decode_table(timings, 30).splitlines()
    assert len(table) == 3 and "30 次调用" in table[0]
    assert table[1].split("|")[0].strip() == "16" and "400.0 [370.0-440.0]" in table[1] and table[1].endswith("45%")
    assert "110.0 [100.0-120.0]" in table[2]


def test_judge_decode_orders_only_ranges_that_do_not_overlap():
    slots = {16: 100, 64: 150, 1024: 400}
    apart = judge_decode({16: _timing((400, 370, 440), (180, 170, 200)), 64: _timing((390, 300, 420), (150, 140, 175)),
                          1024: _timing((270, 220, 320), (110, 100, 120))}, slots, 2000)
    assert apart.apart == [(16, 1024)]  # 16 vs 64 and 64 vs 1024 overlap
    assert apart.slowest_attention == 16 and not apart.slowest_clear  # 16's range meets 64's
    assert apart.first_vs_last == "下降"
    lines = str(apart).splitlines()
    assert len(lines) == 4 and "3 对块大小里 2 对的整步区间重叠，分得开的 (apart): [(16, 1024)]" in lines[1]
    assert "分不出先后" in lines[2] and "全部 2,000 个请求" in lines[3]
    assert "从 100（块 16）增加到 400（块 1024）" in lines[3]

    same = judge_decode({16: _timing((300, 200, 400), (100, 90, 130)),
                         1024: _timing((310, 250, 350), (120, 110, 140))}, slots, 10)
    assert same.apart == [] and same.first_vs_last == "分不出升降（区间重叠）"
    assert "整步的计时排不出先后" in str(same)
    rising = judge_decode({16: _timing((300, 290, 310), (100, 90, 105)),
                           1024: _timing((320, 310, 330), (130, 120, 140))}, slots, 10)
    assert rising.slowest_attention == 1024 and rising.slowest_clear and rising.first_vs_last == "没有下降"


@pytest.mark.parametrize("decode, slots", [({16: _timing((1, 1, 1), (1, 1, 1))}, {16: 1}),
                                           ({16: _timing((1, 1, 1), (1, 1, 1)), 32: _timing((1, 1, 1), (1, 1, 1))},
                                            {16: 1})])
def test_judge_decode_refuses_fewer_than_two_sizes_or_missing_slots(decode, slots):
    with pytest.raises(ConfigError):
        judge_decode(decode, slots, 1)


# ---------------------------------------------------------------------------------------------- 2.2.3 allocation
def test_layout_draws_free_classes_used_and_cached_blocks():
    pool = BlockPool(8, spec=KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=16, device="cpu"),
                     block_sizes=[16, 32, 64, 128])
    assert layout(pool) == "3......."  # one FREE class-3 block of 8 base blocks
    alloc = DynamicAllocator(pool)
    a = alloc.allocate_optimal_block(size_class=1)  # split down: 2 base blocks in use
    b = alloc.allocate_optimal_block(size_class=0)
    assert layout(pool) == "AAA02..."
    pool.mark_reusable([b.block.block_id])
    alloc.deallocate_block(b.block.block_id)
    assert layout(pool) == "AAc02..."
    alloc.deallocate_block(a.block.block_id)
    assert layout(pool)[:2] == "1."


@pytest.mark.parametrize("prefix, own, bs", [(300, 200, 16), (32, 0, 16), (5, 7, 4)])
def test_prefix_sharing_curve_counts_by_formula(prefix, own, bs):
    users = [1, 2, 5, 9]
    curve = prefix_sharing_curve(users, prefix=prefix, own=own, block_size=bs)
    each, full = -(-(prefix + own) // bs), prefix // bs
    assert curve.plain == [n * each for n in users]
    assert curve.shared == [full + n * (each - full) for n in users]


def test_prefix_sharing_curve_prints_the_last_point_and_plots_both_curves():
    curve = prefix_sharing_curve(list(range(1, 65, 4)))
    assert str(curve) == "61 个用户 (users)：不共享 1952 块，共享 872 块 (without / with sharing)，少 55% (fewer)"
    fig = curve.plot()
    (ax,) = fig.axes
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [curve.plain, curve.shared]


@pytest.mark.parametrize("users, kw", [([], {}), ([0], {}), ([2], {"prefix": 0}), ([2], {"own": -1}),
                                       ([2], {"block_size": 0}), ([1.5], {})])
def test_prefix_sharing_curve_refuses_bad_counts(users, kw):
    with pytest.raises(ConfigError):
        prefix_sharing_curve(users, **kw)


# ---------------------------------------------------------------------------------------------- 2.2.8 walk, forks
def test_block_walk_plot_has_a_bar_per_position_and_a_share_per_block():
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32, device="cpu")
    pool = BlockPool(6, spec=spec)
    pool.storage.kv.normal_(generator=torch.Generator().manual_seed(0))
    walk = kvlab.walk_block_table(torch.randn(1, 4), pool, 0, [5, 1, 3], 10, 0)
    fig = walk.plot(layer=7)
    scores, shares = fig.axes
    assert len(scores.patches) == 10 and [p.get_height() for p in shares.patches] == pytest.approx(walk.block_weights())
    assert scores.get_title().startswith("第 7 层、query 头 0")
    assert [t.get_text() for t in scores.texts] == ["b5", "b1", "b3"]


def test_decode_forks_copies_the_shared_tail_n_minus_1_times_and_keeps_the_models_logits():
    model, n, B = TinyLlama(TinyConfig()), 4, 4
    manager = SequenceManager(BlockPool(64, spec=model.cfg.kv_spec(B)), prefix_cache=True)
    prompt = [3, 1, 4, 1, 5, 9]  # one full block and a 2-token tail
    a = manager.create()
    model.step(manager, [a], [prompt])
    samples = [a] + [a.fork() for _ in range(n - 1)]
    run = decode_forks(model, manager, samples, [7, 8, 9, 10], 5)
    assert [r[0] for r in run.rows] == [1, 2, 3, 4, 5]
    assert run.rows[0][2] == n - 1 and sum(r[2] for r in run.rows[1:]) == 0
    assert [out[0] for out in run.answers] == [7, 8, 9, 10] and all(len(out) == 5 for out in run.answers)
    assert run.rows[-1][4] == sum(s.num_blocks for s in samples) and run.rows[-1][3] < run.rows[-1][4]
    assert run.texts == []  # a tiny model has no tokenizer
    lines = str(run).splitlines()
    assert lines[0].startswith("步 step") and "4 copies would hold" in lines[0]  # bilingual header, Chinese first
    assert lines[1].split()[:3] == ["1", str(len(prompt) + 1), str(n - 1)] and "写时复制 (copied on write)" in lines[1]
    # the same tokens fed to unshared sequences give the same last logits
    alone = SequenceManager(BlockPool(64, spec=model.cfg.kv_spec(B)))
    fresh = model.step(alone, [alone.create() for _ in samples], [prompt + out[:-1] for out in run.answers])
    fed_last = model.step(alone, list(alone.seqs.values()), [[out[-1]] for out in run.answers])
    assert torch.allclose(fed_last, run.logits, atol=1e-5) and fresh.shape == run.logits.shape
    manager.check_invariants()


def test_decode_forks_refuses_bad_input_before_any_work():
    model = TinyLlama(TinyConfig())
    manager = SequenceManager(BlockPool(8, spec=model.cfg.kv_spec(4)))
    seq = manager.create()
    model.step(manager, [seq], [[1, 2]])
    for args in [("not a model", manager, [seq], [1], 1), (model, manager, [seq], [1, 2], 1),
                 (model, manager, [seq], [1], 0)]:
        with pytest.raises(ConfigError):
            decode_forks(*args)  # type: ignore[arg-type]
    assert seq.num_tokens == 2
    assert kvlab.memory.allocator.layout is layout


@pytest.mark.parametrize("samples, block_size, tokens", [(1, 16, 5), (2, 16, 5), (4, 16, 5), (4, 4, 6), (3, 8, 9)])
def test_writing_the_same_token_still_copies_n_minus_1_times(samples, block_size, tokens):
    assert kvlab.serve.reuse.same_token_copies(samples, block_size, tokens) == samples - 1


def test_same_token_copies_refuses_a_full_last_block():
    with pytest.raises(ConfigError):
        kvlab.serve.reuse.same_token_copies(4, 4, prompt_tokens=8)


def test_unshared_logits_are_each_sequence_prefilled_alone():
    model = TinyLlama(TinyConfig())
    spec = model.cfg.kv_spec(4)
    lists = [[3, 1, 4, 1, 5, 9, 2], [2, 7]]
    got = kvlab.serve.reuse.unshared_logits(model, spec, lists)
    for row, tokens in zip(got, lists):
        alone = SequenceManager(BlockPool(8, spec=spec))
        want = model.step(alone, [alone.create()], [tokens])[0]
        assert torch.allclose(row, want, atol=1e-5)


def test_the_texts_lookup_matches_data_up_to_its_largest_size_read_as_bytes():
    """The appendix's unit table: the text's get_best_block compares bytes with token counts, so data of t tokens
    finds a block exactly while t x bytes per token <= the largest size, and "small" means under 1 MiB."""
    from kvlab.exercises.ch2_2_2 import text_lookup_units

    specs = {"tiny": KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu"),
             "8b": KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16, device="cpu")}
    got = text_lookup_units(specs, [16, 64, 2048])
    for name, s in specs.items():
        layer = s.bytes_per_token // s.num_layers
        assert got.units[name]["most_tokens_found"] == [2048 // layer, 2048 // s.bytes_per_token]
        assert got.units[name]["under_1mib"][16] == [16 * layer < 2**20, 16 * s.bytes_per_token < 2**20]
    assert got.never_found == ["8b"] and got.small_at_16 == ["tiny"]
    table = str(got).splitlines()
    assert len(table) == 1 + len(specs) + 2 and table[2].startswith("8b") and "['8b']" in table[3]


def test_the_compaction_curve_moves_every_block_above_the_new_boundary():
    """2.2.4's curve: full compaction moves exactly the held blocks at or above the boundary (the number of
    held blocks), computed here from the freed set alone; the shape and the table follow from those moves."""
    from kvlab.exercises.ch2_2_4 import CURVES, compaction_curve

    n = 64
    curve = compaction_curve(n, bytes_per_block=1024, fractions=(0.1, 0.5, 0.9))
    for f, (moves, *_), (one_moves, one_pct, *_) in zip(curve.fractions, curve.rows, curve.one_size):
        freed = set(np.random.default_rng(1).permutation(n)[: int(f * n)].tolist())
        held = [b for b in range(n) if b not in freed]
        assert moves == one_moves == sum(b >= len(held) for b in held)
        assert one_pct == 0  # one block size: every free block serves every request
    assert curve.shape in CURVES and curve.moves[curve.peak] == max(curve.moves)
    table = str(curve).splitlines()
    assert len(table) == 1 + 3 + 1 and table[-1].startswith("结论") and "{0}" in table[-1]
    assert len(curve.plot().axes[0].get_lines()) == 3
