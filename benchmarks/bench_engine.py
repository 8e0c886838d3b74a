"""Engine benchmark: metadata-only simulation of dialogue requests (goal: 10,000 in <= 10 s on 2 cores), steps/s,
requests/s, growth from 1k to 10k (and 100k with ``--full``: one run, a few minutes), the contiguous baseline's
throughput on the same workload, and prefetch's effect on swap-in stalls.

Wall times depend on what else runs on the machine; the growth ratios (time per request at n vs at the first n)
are the figures to read. ``python benchmarks/bench_engine.py [--quick | --full]``.
"""
from __future__ import annotations

import time

from kvlab.claims import prefetch_effect
from kvlab.engine import Engine, EngineConfig
from kvlab.workloads import make_workload


def _time(n: int, memory: str = "paged") -> tuple[float, dict]:
    w = make_workload("chat", n, 0, rate=200.0)
    t = time.perf_counter()
    s = Engine(w, EngineConfig(memory=memory)).run()
    return time.perf_counter() - t, s


def run(quick: bool, full: bool = False) -> list[dict]:
    sizes = [500, 2000] if quick else [1000, 10_000, 100_000] if full else [1000, 10_000]
    rows, first, runs = [], None, {}
    for n in sizes:
        dt, s = _time(n)
        runs[n] = s
        first = first or (n, dt)
        rows.append({"name": f"paged {n} chat requests", "value": dt, "unit": "s", "baseline": None, "ratio": None,
                     "goal": "<= 10 s" if n == 10_000 else None})
        rows.append({"name": f"  steps/s ({n})", "value": s["steps"] / dt, "unit": "steps/s", "baseline": None,
                     "ratio": None, "goal": None})
        rows.append({"name": f"  requests/s ({n})", "value": n / dt, "unit": "req/s", "baseline": None,
                     "ratio": None, "goal": None})
        if n != first[0]:
            rows.append({"name": f"  time growth {first[0]} -> {n}", "value": dt / first[1], "unit": "x",
                         "baseline": n / first[0], "ratio": (dt / first[1]) / (n / first[0]),
                         "goal": "ratio ~1 (linear)"})
    n = sizes[0]
    _, base = _time(n, "contiguous")
    paged = runs[n]
    rows.append({"name": f"throughput paged vs contiguous ({n})", "value": paged["throughput_tok_s"],
                 "unit": "tok/sim-s", "baseline": base["throughput_tok_s"],
                 "ratio": paged["throughput_tok_s"] / base["throughput_tok_s"], "goal": "text claims 3x"})
    pf = prefetch_effect(requests=20 if quick else 40)
    on, off = pf["prefetch"], pf["no prefetch"]
    rows.append({"name": "swap-in stall with vs without prefetch", "value": on["swap_in_stall_s"],
                 "unit": "sim-s", "baseline": off["swap_in_stall_s"],
                 "ratio": on["swap_in_stall_s"] / off["swap_in_stall_s"], "goal": "< 1"})
    return rows


if __name__ == "__main__":
    import sys

    from kvlab.bench import run_script

    run_script(lambda quick: run(quick, full="--full" in sys.argv))
