"""Bad input an audit found outside the pool grid (workloads, traces, metrics, claims, sizing, KVSpec, the contiguous
baseline, eviction, events): each call is refused with a typed kvlab error whose message names the value at fault,
and changes nothing; numpy integers count as ints wherever Python ints do."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from kvlab import (Claim, ConfigError, ContiguousAllocator, Engine, EngineConfig, KVLabError, KVSpec, LengthRange,
                   Request, Workload, claims_report, load_trace, make_policy, make_workload, measure_block_size,
                   measure_claims, plot_sweep, prefix_hit_bound, prefix_hit_share, prefix_hits, read_trace, sweep,
                   write_trace)
from kvlab.serve.claims import check_baselines
from kvlab.core.events import EventBus
from kvlab.core.eviction import FutureUses, RandomPolicy
from kvlab.core.prefix import PrefixCache
from kvlab.serve.metrics import GAUGES, MetricsLog, distribution
from kvlab.memory.sizing import ChunkSizeOptimizer, SweepResult, SweepRow, measure_attention_ms

NAN, INF, BIG = math.nan, math.inf, 2**63
W = make_workload("chat", 6, 0)
REQ = Request(0, 0.0, 10, 2)
RNG = np.random.default_rng


def refuses(call: Callable[[], Any], value: Any, error: type[KVLabError] = ConfigError) -> str:
    """``call()`` raises ``error`` naming ``value`` (its repr); returns the message."""
    with pytest.raises(error) as e:
        call()
    assert repr(value)[:40] in str(e.value), str(e.value)
    return str(e.value)


# ---------------------------------------------------------------------------------------------------- workloads
@pytest.mark.parametrize("requests, value", [(None, None), (5, 5), ("abc", "abc"), ([None], None), ([REQ, 5], 5)])
def test_workload_refuses_what_is_no_list_of_requests(requests, value):
    refuses(lambda: Workload("w", requests), value)


@pytest.mark.parametrize("args, kwargs, value", [
    ((1.5, 10, 5), {}, 1.5), ((True, 10, 5), {}, True), ((1, INF, 5), {}, INF), ((1, 10, 5), dict(sigma=NAN), NAN),
    ((1, 10, 5), dict(sigma=INF), INF), ((1, 10, NAN), {}, NAN), ((1, 10, "5"), {}, "5"), ((1, 2**31, 5), {}, 2**31),
    ((1, 10, 5), dict(sigma=True), True), ((np.float64(1), 10, 5), {}, np.float64(1)),
])
def test_length_range_refuses_bad_bounds(args, kwargs, value):
    refuses(lambda: LengthRange(*args, **kwargs), value)


@pytest.mark.parametrize("n", [-1, 1.0, True, None, BIG, np.float64(3)])
def test_length_range_sample_refuses_a_bad_count(n):
    refuses(lambda: LengthRange(1, 10, 5).sample(RNG(0), n), n)


def test_length_range_sample_refuses_a_bad_generator_and_takes_numpy_values():
    refuses(lambda: LengthRange(1, 10, 5).sample(None, 3), None)  # type: ignore[arg-type]
    lr = LengthRange(np.int64(1), np.int32(10), np.float32(5), np.float64(0.7))
    assert lr.sample(RNG(0), np.int64(50)).tolist() == LengthRange(1, 10, 5).sample(RNG(0), 50).tolist()


@pytest.mark.parametrize("kwargs, value", [
    (dict(n=BIG), BIG), (dict(n=np.float64(2)), np.float64(2)), (dict(seed=1.5), 1.5), (dict(seed=-1), -1),
    (dict(seed="1"), "1"), (dict(seed=True), True), (dict(seed=None), None), (dict(prefix_share="0.5"), "0.5"),
    (dict(prefix_share=NAN), NAN), (dict(prefix_share=True), True), (dict(burst_size=BIG, arrival="burst"), BIG),
    (dict(tenants=BIG), BIG), (dict(rate="8"), "8"), (dict(rate=NAN), NAN), (dict(rate=np.float64(INF)), INF),
    (dict(arrival=["poisson"]), ["poisson"]), (dict(arrival=np.array(["burst"])), np.array(["burst"])),
])
def test_make_workload_refuses_bad_arguments(kwargs, value):
    args = {"n": 4, **kwargs}
    message = refuses(lambda: make_workload("chat", **args), value)
    assert f"invalid {next(iter(kwargs))}=" in message


@pytest.mark.parametrize("name", [["chat"], None, 5, b"chat"])
def test_make_workload_refuses_a_name_that_is_no_str(name):
    refuses(lambda: make_workload(name, 4), name)


def test_make_workload_takes_numpy_counts_and_bursts_larger_than_the_workload():
    ints = make_workload("chat", 20, 3, rate=8.0, arrival="burst", burst_size=4, tenants=2)
    numpy = make_workload("chat", np.int64(20), np.int64(3), rate=np.float32(8.0), arrival="burst",
                          burst_size=np.int32(4), tenants=np.int64(2))
    assert numpy.requests == ints.requests
    one_burst = make_workload("chat", 5, arrival="burst", burst_size=2**31 - 1)  # once: 16 GiB of np.repeat
    assert {r.arrival for r in one_burst} == {0.0}


@pytest.mark.parametrize("vocab", [True, 1.5, np.float64(100), "100", 0, np.bool_(True)])
def test_prompt_token_ids_refuse_a_vocabulary_that_is_no_positive_int(vocab):
    refuses(lambda: W[0].prompt_token_ids(vocab_size=vocab), vocab)


def test_prompt_token_ids_take_a_numpy_vocabulary():
    assert W[0].prompt_token_ids(np.int64(100)) == W[0].prompt_token_ids(100)


# ---------------------------------------------------------------------------------------------------- trace files
@pytest.mark.parametrize("path", [None, 5, ["a.jsonl"]])
def test_trace_paths_that_are_no_path(path):
    refuses(lambda: write_trace(W, path), path)
    refuses(lambda: read_trace(path), path)
    refuses(lambda: load_trace(path), path)


def test_a_path_the_os_refuses_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    for path in (tmp_path / "nodir" / "a.jsonl", tmp_path / "dir.jsonl", tmp_path / "a\x00b.csv"):
        assert "cannot write trace" in refuses(lambda: write_trace(W, path), str(path))
    assert not (tmp_path / "nodir").exists() and list(tmp_path.iterdir()) == [tmp_path / "dir.jsonl"]
    assert "NUL character" in refuses(lambda: read_trace("a\x00b.jsonl"), "a\x00b.jsonl")
    assert "NUL character" in refuses(lambda: load_trace("a\x00b"), "a\x00b")


@pytest.mark.parametrize("workload", [None, [REQ], W.requests, "chat"])
def test_prefix_hits_refuse_what_is_no_workload(workload):
    refuses(lambda: prefix_hits(workload, 4), workload)
    refuses(lambda: prefix_hit_bound(workload, 4), workload)


# ---------------------------------------------------------------------------------------------------- eviction
@pytest.mark.parametrize("key", [[1], {"a": 1}, (1, [2])])
def test_next_use_refuses_an_unhashable_key(key):
    future = FutureUses([[1], [(1, 2)]])
    refuses(lambda: future.next_use(key), key)
    assert (future.request, future.now, future.next_use(1)) == (0, 0, 0.0)


@pytest.mark.parametrize("prompts, tenants, value, error", [
    (None, None, None, ConfigError), ("abcd", None, "abcd", ConfigError), (5, None, 5, ConfigError),
    ([list(range(9))], 5, 5, ConfigError), ([list(range(9))], "t", "t", ConfigError),
    ([list(range(9))], [5], 5, ConfigError), ([None], None, None, KVLabError), ([[1.5, 2]], None, 1.5, KVLabError),
    ([list(range(9)), "abc"], None, "abc", KVLabError),
])
def test_future_uses_refuses_what_is_no_prompt_list(prompts, tenants, value, error):
    refuses(lambda: PrefixCache.future_uses(prompts, 4, tenants=tenants), value, error)


@pytest.mark.parametrize("policy", ["random", "lru", "clock"])
@pytest.mark.parametrize("seed", [NAN, [1], 1.5, "1", True, None, np.float64(2)])
def test_make_policy_refuses_a_seed_that_is_no_int(policy, seed):
    refuses(lambda: make_policy(policy, seed=seed), seed)
    refuses(lambda: RandomPolicy(seed), seed)


def test_make_policy_takes_a_numpy_seed():
    p = make_policy("random", seed=np.int64(3))
    assert p.seed == 3 and type(p.seed) is int


# ---------------------------------------------------------------------------------------------------- events
@pytest.mark.parametrize("fn", [None, 5, "print", [print]])
def test_subscribe_refuses_what_cannot_be_called(fn):
    bus = EventBus()
    refuses(lambda: bus.subscribe(fn), fn)
    assert list(bus) == [] and bus.failures == []


# ---------------------------------------------------------------------------------------------------- metrics
@pytest.fixture(scope="module")
def ran() -> Engine:
    e = Engine(W, EngineConfig(num_blocks=256))
    e.run()
    return e


@pytest.mark.parametrize("name", ["nope", None, "tenant_blocks", "kind", ["waiting"]])
def test_series_refuses_what_is_no_gauge(name, ran):
    refuses(lambda: ran.log.series(name), name)
    refuses(lambda: MetricsLog().series(name), name)


def test_series_reads_every_gauge(ran):
    assert all(ran.log.series(g).shape == (len(ran.log.steps),) for g in GAUGES)


@pytest.mark.parametrize("values", [["a"], "abc", [[1], [1, 2]], [{}]])
def test_distribution_refuses_what_is_no_numbers(values):
    refuses(lambda: distribution(values, "x", "s"), values)


# ---------------------------------------------------------------------------------------------------- claims
@pytest.mark.parametrize("field, value", [("value", "x"), ("value", None), ("value", True), ("threshold", "0.3"),
                                          ("threshold", [1])])
def test_claim_refuses_a_figure_that_is_no_number(field, value):
    kwargs = {"value": 0.5, "threshold": 0.3, field: value}
    refuses(lambda: Claim("t", "max-length", "s", "m", **kwargs), value)


def test_claim_takes_numpy_figures():
    assert Claim("t", "max-length", "s", "m", np.float64(0.5), np.int64(0)).supported


@pytest.mark.parametrize("baselines", [5, None, [5], [["max-length"]], 1.5])
def test_baselines_that_are_no_names_are_refused_before_any_measuring(baselines):
    claim = Claim("t", "max-length", "s", "m", 1.0, 0.5)
    refuses(lambda: check_baselines(baselines), baselines)
    refuses(lambda: measure_claims(baselines=baselines), baselines)  # at once: the runs take half a minute
    if baselines is not None:
        refuses(lambda: claims_report([claim], baseline=baselines), baselines)


def test_claims_report_keeps_the_baselines_named():
    claims = [Claim("t", b, "s", "m", 1.0, 0.5) for b in ("max-length", "exact-length")]
    assert "vs exact-length" not in claims_report(claims, "max-length")
    assert "vs exact-length" in claims_report(claims, ["max-length", "exact-length"])


def test_prefix_hit_share_refuses_an_engine_that_has_not_run_this_workload(ran):
    with pytest.raises(ConfigError, match="request 0 of workload 'chat' has not finished"):
        prefix_hit_share(Engine(W, EngineConfig(num_blocks=256)), W, 16)
    with pytest.raises(ConfigError, match="request 6 of workload 'chat' has not finished"):
        prefix_hit_share(ran, make_workload("chat", 8, 0), 16)
    refuses(lambda: prefix_hit_share(None, W, 16), None)
    refuses(lambda: prefix_hit_share(ran, None, 16), None)
    assert prefix_hit_share(ran, W, 16)[2] == 0


# ---------------------------------------------------------------------------------------------------- sizing
ROW = SweepRow(16, 4, 60, 4, 4, 0, 0, 64)


@pytest.mark.parametrize("rows", [[], None, [5], (ROW,)])
def test_sweep_result_refuses_rows_that_are_no_sweep(rows):
    refuses(lambda: SweepResult("w", 0, rows), rows)


@pytest.mark.filterwarnings("ignore:Data has no positive values")  # matplotlib, on the all-zero log-scale panel
def test_an_all_zero_sweep_costs_nothing_rather_than_nan():
    res = SweepResult("w", 0, [SweepRow(16, 0, 0, 0, 0, 0, 0, 0), SweepRow(32, 0, 0, 0, 0, 0, 0, 0)])
    assert all(res.costs(g) == {16: 0.0, 32: 0.0} for g in ("balanced", "memory_efficient"))
    assert res.recommend() == 16 and "**<-**" in res.to_markdown()
    assert len(plot_sweep(res).axes) == 4


def test_plot_sweep_refuses_what_is_no_sweep_or_goal():
    refuses(lambda: plot_sweep(None), None)
    refuses(lambda: plot_sweep(SweepResult("w", 1, [ROW]), "fastest"), "fastest")


TIMING_BAD = [("batch", -1), ("batch", 1.5), ("batch", None), ("batch", 0), ("max_len", -5), ("max_len", 0),
              ("num_heads", 0), ("head_dim", 1.5), ("rounds", "x"), ("rounds", True), ("device", "nope"),
              ("device", "meta"), ("device", f"cuda:{torch.cuda.device_count()}"), ("seed", -1), ("seed", 1.5),
              ("seed", 2**64)]  # a seed is an int in 0..2**64-1 (kvlab.core.checks.check_seed)


@pytest.mark.parametrize("name, value", TIMING_BAD)
def test_attention_timing_refuses_bad_settings_by_name(name, value):
    message = refuses(lambda: measure_attention_ms(W, [16], **{name: value}), value)
    assert name in message and "num_blocks" not in message
    refuses(lambda: sweep(W, [16], progress=False, **{name: value}), value)
    refuses(lambda: ChunkSizeOptimizer().sweep(W, [16], progress=False, **{name: value}), value)


@pytest.mark.parametrize("kwargs, value", [(dict(bogus=1), "bogus"), (dict(on_step=print), "on_step")])
def test_sweep_refuses_settings_it_does_not_know(kwargs, value):
    refuses(lambda: sweep(W, [16], progress=False, **kwargs), value)


@pytest.mark.parametrize("sizes, value", [([0], 0), ("16", "16"), ([[16]], [16]), (16, 16), ([2**31], 2**31)])
def test_attention_timing_refuses_bad_block_sizes(sizes, value):
    refuses(lambda: measure_attention_ms(W, sizes, rounds=1), value)


def test_attention_timing_refuses_an_on_step_it_cannot_call():
    refuses(lambda: measure_attention_ms(W, [16], rounds=1, on_step=5), 5)


def test_block_sizes_and_timings_take_numpy_ints():
    res = sweep(W, [np.int64(32), np.int32(16)], attention=False, progress=False)
    assert [r.block_size for r in res.rows] == [16, 32]
    got, want = measure_block_size(W, np.int64(16)), measure_block_size(W, 16)
    # no attention timed: both rows hold NaN there, which no == matches (Python 3.13's dataclass __eq__ compares
    # field by field, where 3.11 compared tuples, which take a NaN object as equal to itself)
    assert replace(got, attention_ms=0.0, attention_spread=(0.0, 0.0)) == \
        replace(want, attention_ms=0.0, attention_spread=(0.0, 0.0)) and math.isnan(got.attention_ms)
    ms = measure_attention_ms(W, [np.int64(16)], batch=np.int64(2), num_heads=np.int32(1), head_dim=np.int64(8),
                              rounds=np.int64(1), device="cpu", seed=np.int64(0))
    assert list(ms) == [16]


@pytest.mark.parametrize("check", ["yes", 1, None])
def test_measure_block_size_refuses_a_check_that_is_no_bool(check):
    refuses(lambda: measure_block_size(W, 16, check=check), check)


@pytest.mark.parametrize("workload", [None, [REQ]])
def test_sizing_refuses_what_is_no_workload(workload):
    refuses(lambda: measure_block_size(workload, 16), workload)
    refuses(lambda: measure_attention_ms(workload, [16]), workload)
    refuses(lambda: sweep(workload, [16], attention=False, progress=False), workload)


@pytest.mark.parametrize("sequences", [None, 5, "abc", b"ab"])
def test_analyze_refuses_what_is_no_sequences_and_keeps_its_analysis(sequences):
    opt = ChunkSizeOptimizer()
    before = dict(opt.analyze_sequence_distribution([10, 20]))
    refuses(lambda: opt.analyze_sequence_distribution(sequences), sequences)
    assert opt.sequence_length_stats == before


# ---------------------------------------------------------------------------------------------------- KVSpec
@pytest.mark.parametrize("device", [f"cuda:{torch.cuda.device_count()}", "nope", "meta", None])
def test_kvspec_refuses_a_device_this_machine_cannot_use(device):
    refuses(lambda: KVSpec(device=device), device)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.int64, torch.complex64, "float32", np.float32])
def test_kvspec_refuses_a_dtype_that_holds_no_real_kv(dtype):
    refuses(lambda: KVSpec(dtype=dtype), dtype)


def test_kvspec_takes_numpy_ints_as_plain_ints():
    spec = KVSpec(np.int64(2), np.int32(2), np.int64(16), np.uint8(16), device="cpu")
    assert spec == KVSpec(2, 2, 16, 16, device="cpu") and all(
        type(v) is int for v in (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size))
    assert spec.blocks_for_budget(np.int64(10 * spec.bytes_per_block)) == 10
    refuses(lambda: spec.blocks_for_budget(True), True)
    assert KVSpec(dtype=torch.bfloat16, device="cpu").bytes_per_token == spec.bytes_per_token // 2


# ---------------------------------------------------------------------------------------------------- baseline
@pytest.mark.parametrize("capacity", [True, 1.5, "8", 0, None])
def test_contiguous_allocator_refuses_a_capacity_that_is_no_positive_int(capacity):
    refuses(lambda: ContiguousAllocator(capacity), capacity)


@pytest.mark.parametrize("owner, n, value", [(None, 1, None), (1.5, 1, 1.5), ("x", 1, "x"), (True, 1, True),
                                             (-1, 1, -1), ([1], 1, [1]), (2, True, True), (2, 1.5, 1.5), (2, 0, 0)])
def test_contiguous_reserve_refuses_bad_owners_and_sizes_and_changes_nothing(owner, n, value):
    a = ContiguousAllocator(np.int64(10))
    a.reserve(np.int64(1), np.int64(3))
    refuses(lambda: a.reserve(owner, n), value)
    assert a.regions == {1: (0, 3)} and (a.free, a.largest_free) == (7, 7)
    a.check_invariants()


@pytest.mark.parametrize("owner", [None, [1], 1.5, "1"])
def test_contiguous_release_refuses_bad_owners_and_takes_numpy_ones(owner):
    a = ContiguousAllocator(10)
    a.reserve(1, 3)
    refuses(lambda: a.release(owner), owner)
    a.release(np.int64(1))
    assert a.free == 10 and type(a.capacity) is int
