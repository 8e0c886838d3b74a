"""``kvlab bench --quick`` as a smoke test: every benchmark runs and reports well-formed rows. It never checks
speed (a shared CI machine is too noisy for that); the figures live in docs/benchmarks.md."""
from __future__ import annotations

import json
import math

from kvlab import bench
from kvlab.cli import main


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
