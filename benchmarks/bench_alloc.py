"""Allocation strategies (§2.2.3–§2.2.5), each against a baseline measured in the same run:

* a bursty trace with and without pre-allocation: per-request latency inside the bursts. Between bursts the idle
  time fills all free memory with cached class-0 blocks (a prefix cache); each burst asks for class-2 blocks, so
  without a reserve every request must plan and run evictions on the critical path. The price of the reserve
  (blocks the cache could not use) is printed too;
* batch vs one-by-one pool operations: ns per block and lock acquisitions for allocate+free of 256 blocks;
* defragmentation of a 16,384-block pool with half its blocks freed at random (external fragmentation near 1):
  one batched compaction vs the same moves made one migration at a time.

Run: ``python benchmarks/bench_alloc.py`` (``quick`` shrinks the sizes).
"""
from __future__ import annotations

import gc
import time

import numpy as np

from kvlab import BlockPool, DefragmentationStrategy, DynamicAllocator, FragmentationDetector, Preallocator
from kvlab.app.bench import ns_per_item_together


def _bursty(quick: bool, prealloc: bool) -> tuple[np.ndarray, float]:
    """Per-request latencies (ns) of the bursts after the first, and the mean reserve held while idle."""
    pool = BlockPool(1024 if quick else 4096, block_sizes=[16, 32, 64, 128], with_storage=False)
    alloc = DynamicAllocator(pool)
    burst = 16 if quick else 64
    pre = Preallocator(pool, allocator=alloc, window=40 * burst, horizon=400 * burst) if prealloc else None
    lat, held = [], []
    for r in range(6 if quick else 12):
        if pre is not None:
            pre.replenish()
            held.append(pre.reserved)
        fill = pool.allocate(pool.num_free_blocks, size_class=0, owner=0)  # idle time: the cache takes the rest
        pool.mark_reusable(fill)
        pool.free(fill)
        got = []
        for _ in range(burst):
            t = time.perf_counter_ns()
            if pre is not None:
                got += pre.allocate(1, owner=1, size_class=2)
            else:
                got.append(alloc.allocate_optimal_block(size_class=2, owner=1, wait=False).block.block_id)
            if r:  # the first burst teaches the predictor; both variants pay it the same
                lat.append(time.perf_counter_ns() - t)
        pool.free(got)
        pool.check_invariants()
    return np.array(lat), float(np.mean(held)) if held else 0.0


def bursty_rows(quick: bool) -> list[dict]:
    gc.disable()
    try:
        base, _ = _bursty(quick, prealloc=False)
        ours, reserve = _bursty(quick, prealloc=True)
    finally:
        gc.enable()
    rows = []
    for name, f in (("mean", np.mean), ("p99", lambda a: np.percentile(a, 99))):
        v, b = float(f(ours)) / 1e3, float(f(base)) / 1e3
        rows.append({"name": f"burst alloc latency {name}, pre-allocated", "value": round(v, 1), "unit": "us",
                     "baseline": round(b, 1), "ratio": round(v / b, 3), "goal": 0.5 if name == "mean" else None})
    rows.append({"name": "  price: blocks held in reserve while idle", "value": round(reserve, 1), "unit": "blocks",
                 "baseline": None, "ratio": None, "goal": None})
    return rows


def batch_rows(quick: bool) -> list[dict]:
    n, reps = 256, 20 if quick else 200
    pool = BlockPool(4096, with_storage=False)

    def batched() -> None:
        ids = pool.allocate(n)
        pool.incref(ids)
        pool.decref(ids)
        pool.free(ids)

    def one_by_one() -> None:
        ids = [pool.allocate(1)[0] for _ in range(n)]
        for b in ids:
            pool.incref([b])
        for b in ids:
            pool.decref([b])
        for b in ids:
            pool.free([b])

    locks = []
    for fn in (batched, one_by_one):
        before = pool.lock_acquisitions
        fn()
        locks.append(pool.lock_acquisitions - before)
    ns = ns_per_item_together({"ours": batched, "base": one_by_one}, n, reps)
    ours, base = ns["ours"], ns["base"]
    return [{"name": f"batch alloc+incref+decref+free, n={n}", "value": round(ours, 1), "unit": "ns/block",
             "baseline": round(base, 1), "ratio": round(ours / base, 3), "goal": 0.5},
            {"name": f"  lock acquisitions per {n} blocks", "value": locks[0], "unit": "locks",
             "baseline": locks[1], "ratio": round(locks[0] / locks[1], 4), "goal": None}]


def _fragmented_pool(n: int) -> BlockPool:
    pool = BlockPool(n)
    ids = np.array(pool.allocate(n))
    pool.storage.kv.normal_()
    pool.free(np.random.default_rng(0).permutation(ids)[: n // 2])
    return pool


def defrag_rows(quick: bool) -> list[dict]:
    n = 4096 if quick else 16_384
    pool = _fragmented_pool(n)
    before = FragmentationDetector(pool).detect_fragmentation()
    report = DefragmentationStrategy(pool).defragment()
    # Baseline: the same moves, one migration (one tensor copy, one hook call) per block.
    base_pool = _fragmented_pool(n)
    t = time.perf_counter()
    for s, d in report.moves:
        base_pool.migrate([s], [d])
    base = time.perf_counter() - t
    after = FragmentationDetector(pool).detect_fragmentation()
    return [{"name": f"defragment {n} blocks, batched", "value": round(report.seconds * 1e3, 1), "unit": "ms",
             "baseline": round(base * 1e3, 1), "ratio": round(report.seconds / base, 3), "goal": 0.5},
            {"name": "  external fragmentation before", "value": round(before["external_fragmentation"], 3),
             "unit": "fraction", "baseline": None, "ratio": None, "goal": 0.5},
            {"name": "  external fragmentation after", "value": round(after["external_fragmentation"], 3),
             "unit": "fraction", "baseline": None, "ratio": None, "goal": 0.0},
            {"name": "  blocks moved", "value": len(report.moves), "unit": "blocks", "baseline": None,
             "ratio": None, "goal": None},
            {"name": "  bytes moved", "value": round(report.bytes_moved / 2**20, 1), "unit": "MiB",
             "baseline": None, "ratio": None, "goal": None},
            {"name": "  scatter after (1 = packed)", "value": round(after["scatter"], 3), "unit": "",
             "baseline": round(before["scatter"], 3), "ratio": None, "goal": 1.0}]


def run(quick: bool = False) -> list[dict]:
    return bursty_rows(quick) + batch_rows(quick) + defrag_rows(quick)


if __name__ == "__main__":
    from kvlab.app.bench import run_script

    run_script(run)
