"""Block-size sweep (text §2.2.1): how fast the measurement runs, and how far the text's rule is from it.

Rows per workload:
* ``sweep counts``: seconds to run the workload through metadata-only pools of all 8 block sizes, against a
  baseline of the same number of blocks taken and released in one batched call per size (the least any
  per-request run could cost): the ratio is the price of growing sequences block by block, as an engine does.
* ``balanced cost``: the cost-model value of the measured pick against that of the text's rule of thumb
  (``recommend_chunk_size('balanced')``) on the same measurements; below 1 means the rule picked worse.

``python benchmarks/bench_sizing.py [--quick]`` prints the table.
"""
from __future__ import annotations

import time

from kvlab import BlockPool, ChunkSizeOptimizer, KVSpec, make_workload, sweep
from kvlab.memory.sizing import DEFAULT_SIZES


def _best_of(fn, k: int = 3) -> float:
    """Least seconds of ``k`` calls: noise from elsewhere on the machine only ever adds time."""
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _batched(blocks_per_size: dict[int, int]) -> None:
    for bs, n in blocks_per_size.items():
        pool = BlockPool(n, spec=KVSpec(block_size=bs, device="cpu"), with_storage=False)
        pool.free(pool.allocate(n))


def run(quick: bool = False) -> list[dict]:
    rows = []
    names, n = (["chat"], 200) if quick else (["chat", "document", "code", "retrieval"], 1000)
    for name in names:
        w = make_workload(name, n, seed=0)
        res = sweep(w, DEFAULT_SIZES, attention=not quick, progress=False, rounds=3)
        counted = _best_of(lambda: sweep(w, DEFAULT_SIZES, attention=False, progress=False))
        base = _best_of(lambda: _batched({r.block_size: r.table_entries for r in res.rows}))
        rows.append({"name": f"sweep counts, {name} x{n}, 8 sizes", "value": counted, "unit": "s",
                     "baseline": base, "ratio": counted / base, "goal": "< 1 s per 1000 requests"})
        opt = ChunkSizeOptimizer()
        opt.analyze_sequence_distribution(w)
        text_pick, pick = opt.recommend_chunk_size("balanced"), res.recommend("balanced")
        cost = res.costs("balanced")
        rows.append({"name": f"balanced cost, {name}: measured {pick} vs text rule {text_pick}",
                     "value": cost[pick], "unit": "cost", "baseline": cost[text_pick],
                     "ratio": cost[pick] / cost[text_pick], "goal": "<= 1"})
    return rows


if __name__ == "__main__":
    from kvlab.app.bench import run_script

    run_script(run)
