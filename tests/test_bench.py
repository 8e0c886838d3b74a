"""``kvlab bench --quick`` as a smoke test: every benchmark runs and reports well-formed rows. It never checks
speed (a shared CI machine is too noisy for that); the figures live in docs/benchmarks.md. The pool benchmark's
two peer-style baselines are checked to behave like pools, since every ratio it reports rests on them."""
from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from kvlab import BlockPool, FastBlockPool, bench
from kvlab.cli import main

bench_pool = bench.load("bench_pool")  # once: loading executes the benchmark file


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``kvlab bench --quick`` once for the module: (the JSON it wrote, what it printed)."""
    out, buf = tmp_path_factory.mktemp("bench") / "bench.json", io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["bench", "--quick", "--json", str(out)]) == 0
    return json.loads(out.read_text()), buf.getvalue(), out


def test_every_benchmark_runs_in_quick_mode_and_writes_json(quick_run):
    result, printed, out = quick_run
    names = {r["benchmark"] for r in result["rows"]}
    assert names == set(bench.available()) and len(names) >= 6
    for r in result["rows"]:
        assert r["name"] and r["unit"] is not None and math.isfinite(r["value"]), r
        assert r.get("ratio") is None or math.isfinite(r["ratio"]), r
    assert {"date", "torch", "device", "cpu_count"} <= set(result["machine"])
    assert "| benchmark | figure |" in printed and str(out) in printed


def test_pool_benchmark_reports_every_row_with_a_positive_ratio(quick_run):
    result, printed, _ = quick_run
    rows = {r["name"]: r for r in result["rows"] if r["benchmark"] == "bench_pool"}
    want = ["BlockPool (reference, pure Python), n=1, fresh"]
    for n in (1, 16, 256):
        for state in ("fresh", "shuffled"):
            want += [f"vLLM-style pool (baseline), n={n}, {state}", f"nano-vllm-style BlockManager, n={n}, {state}"]
            want += [f"FastBlockPool, n={n}, {state}, {s}" for s in ("no subscriber", "1 subscriber")]
    assert set(want) <= set(rows), sorted(set(want) - set(rows))
    for name in want:
        r = rows[name]
        assert r["unit"] == "ns/block" and r["value"] > 0, r
        if not name.startswith("vLLM-style"):
            assert math.isfinite(r["ratio"]) and r["ratio"] > 0 and r["baseline"] > 0, r
        if name.startswith(("BlockPool", "FastBlockPool")):
            assert "quick: not judged" in r["goal"] and 0 < r["ratios"]["nano-style"] < math.inf, r
    created = [r for r in rows.values() if r["name"].startswith("create ")]
    assert len(created) == 3 and all(r["unit"] == "s" and r["value"] >= 0 for r in created)
    assert [r["ratio"] is None for r in created] == [True, False, False]
    assert "nano-style" in printed  # the second ratio is printed beside the first


def test_ns_per_item_measures_per_item():
    calls = []
    ns = bench.ns_per_item(lambda: calls.append(1), items=4, reps=10, rounds=2)
    assert len(calls) == 20 and ns > 0


def test_ns_per_item_together_interleaves_rounds():
    calls = []
    ns = bench.ns_per_item_together({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                    items=2, reps=3, rounds=2)
    assert calls == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    assert set(ns) == {"a", "b"} and all(v > 0 for v in ns.values())


def test_format_table_shows_extra_ratios_after_the_main_one():
    table = bench.format_table({"rows": [{"name": "x", "value": 2.0, "unit": "ns", "baseline": 4.0, "ratio": 0.5,
                                          "ratios": {"other": 0.25}}]})
    assert "| 0.5; other 0.25 |" in table


# ---------------------------------------------------------------- the baselines behave like pools
N = 8
ops = st.lists(st.tuples(st.booleans(), st.integers(0, N), st.randoms(use_true_random=False)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_vllm_style_pool_hands_out_and_takes_back_blocks(steps):
    """Against a model free queue (a list): allocation takes the n at the head with refcount 1 and clears any
    cached hash; free appends those reaching refcount 0 to the tail, in the order given; refusals change nothing."""
    pool, model, held = bench_pool.VllmStylePool(N), list(range(N)), []
    for alloc, n, rnd in steps:
        if alloc:
            if n > len(model):
                with pytest.raises(ValueError):
                    pool.get_new_blocks(n)
            else:
                got = pool.get_new_blocks(n)
                assert [b.block_id for b in got] == model[:n] and all(b.ref_cnt == 1 for b in got)
                del model[:n]
                held += got
        elif held:
            k = min(n, len(held))
            rnd.shuffle(held)
            back, held = held[:k], held[k:]
            pool.free_blocks(back)
            model += [b.block_id for b in back]
        assert pool.free_block_queue.ids() == model and pool.get_num_free_blocks() == len(model)
        assert sorted(model + [b.block_id for b in held]) == list(range(N))
        assert all(pool.blocks[i].ref_cnt == 0 for i in model) and all(b.ref_cnt == 1 for b in held)


def test_vllm_style_pool_drops_a_reused_blocks_cached_hash_and_keeps_shared_blocks():
    pool = bench_pool.VllmStylePool(4)
    a, b = pool.get_new_blocks(2)
    a.block_hash = b.block_hash = "h"
    pool.cached_block_hash_to_block["h"] = {a.block_id: a, b.block_id: b}
    pool.free_blocks([a, b])
    pool.get_new_blocks(3)  # blocks 2, 3, then a: a's hash goes, b's stays
    assert a.block_hash is None and pool.cached_block_hash_to_block == {"h": {b.block_id: b}}
    c = pool.get_new_blocks(1)[0]
    assert c is b and pool.cached_block_hash_to_block == {}
    c.ref_cnt += 1  # a second holder: the first free keeps the block out of the queue
    pool.free_blocks([c])
    assert pool.free_block_queue.ids() == [] and c.ref_cnt == 1
    pool.free_blocks([c])
    assert pool.free_block_queue.ids() == [b.block_id]


@settings(max_examples=60, deadline=None)
@given(ops)
def test_nano_style_block_manager_hands_out_and_takes_back_blocks(steps):
    """Against a model deque: allocation takes the n at the left with refcount 1 (hash and tokens reset) and
    marks them used; free returns them to the right, last id first (a block table released from its end)."""
    mgr, model, held = bench_pool.NanoStyleBlockManager(N), list(range(N)), []
    for alloc, n, rnd in steps:
        if alloc:
            if n > len(model):
                with pytest.raises(ValueError):
                    mgr.allocate(n)
            else:
                got = mgr.allocate(n)
                assert got == model[:n]
                assert all(mgr.blocks[b].ref_count == 1 and mgr.blocks[b].hash == -1 for b in got)
                del model[:n]
                held += got
        elif held:
            k = min(n, len(held))
            rnd.shuffle(held)
            back, held = held[:k], held[k:]
            mgr.free(back)
            model += back[::-1]
        assert list(mgr.free_block_ids) == model and mgr.used_block_ids == set(held)
        assert all(mgr.blocks[i].ref_count == 0 for i in model)


def test_shuffled_pools_hold_the_same_permutation_and_every_block():
    order = bench_pool.shuffled_order(64)
    assert sorted(order) == list(range(64)) and order != list(range(64))
    assert bench_pool.vllm_pool(64, shuffled=True).free_block_queue.ids() == order
    assert bench_pool.vllm_pool(64, shuffled=False).free_block_queue.ids() == list(range(64))
    assert list(bench_pool.nano_pool(64, shuffled=True).free_block_ids) == order[::-1]
    for cls in (BlockPool, FastBlockPool):
        pool = bench_pool.kvlab_pool(cls, 64, shuffled=True, subscriber=True)
        assert pool.free_ids() == order and pool.events  # someone listens
        pool.check_invariants()
