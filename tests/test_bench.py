"""``kvlab bench --quick`` as a smoke test: every benchmark runs and reports well-formed rows. It never checks
speed (a shared CI machine is too noisy for that); the figures live in docs/benchmarks.md."""
from __future__ import annotations

import json
import math

from hypothesis import given, settings, strategies as st

from kvlab import BlockPool, bench
from kvlab.cli import main

bench_pool = bench.load("bench_pool")  # once: loading executes the benchmark file


def test_every_benchmark_runs_in_quick_mode_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    names = {r["benchmark"] for r in result["rows"]}
    assert names == set(bench.available()) and len(names) >= 6
    for r in result["rows"]:
        assert r["name"] and r["unit"] is not None and math.isfinite(r["value"]), r
        assert r.get("ratio") is None or math.isfinite(r["ratio"]), r
    assert {"date", "torch", "device", "cpu_count"} <= set(result["machine"])
    printed = capsys.readouterr().out
    assert "| benchmark | figure |" in printed and str(out) in printed


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


def _walk(q) -> list[int]:
    """Block ids from head to tail of a linked free queue, checking the back links on the way."""
    out, prev, cur = [], q.head, q.head.next
    while cur is not q.tail:
        assert cur.prev is prev
        out.append(cur.block_id)
        prev, cur = cur, cur.next
    assert q.tail.prev is prev
    return out


def test_linked_queue_baseline_is_a_fifo_of_every_block():
    q = bench_pool.LinkedFreeQueue(8)
    got = q.popleft_n(3)
    assert [b.block_id for b in got] == [0, 1, 2] and all(b.ref_cnt == 1 for b in got)
    assert _walk(q) == [3, 4, 5, 6, 7]
    q.append_n(got[::-1])
    assert _walk(q) == [3, 4, 5, 6, 7, 2, 1, 0] and all(b.ref_cnt == 0 for b in q.blocks)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 10), max_size=60), st.booleans())
def test_lean_bound_does_the_pools_per_block_work(ops, lists):
    """The n=1 bound rows claim the pool's per-block work and nothing else: driven with the same single-block
    allocations and frees, it returns the same ids and leaves the same metadata and step as BlockPool."""
    lean, pool, held = bench_pool.LeanPool(8, lists), BlockPool(8, with_storage=False), []
    for op in ops:
        if op < 5 and len(held) < 8:
            b = lean.allocate_one()
            assert pool.allocate(1) == [b]
            held.append(b)
        elif held:
            b = held.pop(op % len(held))
            lean.free_one(b)
            pool.free([b])
        for field in ("status", "refs", "tokens", "owner", "last", "created", "hits", "reusable"):
            assert list(getattr(lean, field)) == getattr(pool, field + "_np").tolist(), field
        assert list(lean.stack) == list(pool._free[0]) and lean.step == pool.clock.now()
