"""``kvlab bench``: run every benchmark shipped with kvlab, print one table of figures with their baselines,
ratios and goals, or the same rows as JSON with the machine, versions, device, date and the commit measured.

Each ``benchmarks/bench_*.py`` exposes ``run(quick: bool) -> list[dict]`` whose rows carry ``name``, ``value``,
``unit`` and optionally ``baseline``, ``ratio``, ``goal`` and ``ratios`` (``{label: ratio}`` to further baselines,
shown after the main ratio). Quick mode shrinks every benchmark so the whole
command is a smoke test (CI runs it: it checks that each benchmark ran, never how fast).
"""
from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kvlab.core.device import default_device
from kvlab.core.checks import show
from kvlab.core.errors import ConfigError
from kvlab.app.resources import shipped


def benchmarks_dir() -> Path:
    """The benchmark files: ``$KVLAB_BENCHMARKS`` if set, else those shipped with kvlab (inside the installed
    package, or ``benchmarks/`` of a checkout)."""
    env = os.environ.get("KVLAB_BENCHMARKS")
    if env:
        if not Path(env).is_dir():
            raise ConfigError(f"KVLAB_BENCHMARKS={env!r} is not a folder")
        return Path(env)
    return shipped("benchmarks")


def available() -> list[str]:
    """The benchmarks' names (``bench_*.py`` files, without the suffix), sorted."""
    return sorted(p.stem for p in benchmarks_dir().glob("bench_*.py"))


def load(name: str) -> ModuleType:
    """Import the benchmark file ``name`` (e.g. ``"bench_pool"``) as a module."""
    if not isinstance(name, str) or name not in available():  # a name, never a path: nothing else is imported
        raise ConfigError(f"unknown benchmark {show(name)}; have {', '.join(available())}")
    path = benchmarks_dir() / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"kvlab_benchmarks.{name}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"benchmark {name!r} cannot be imported from {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # a dataclass in the file looks its module up there while it is being built
    spec.loader.exec_module(mod)
    return mod


def commit() -> str | None:
    """The git commit of the kvlab source measured, ``+changes`` appended when its files differ from it; None
    for an installed wheel (no git checkout around it) or where git is missing."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "kvlab", "benchmarks"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def machine() -> dict[str, Any]:
    """What the figures were measured on, and when: the date and the commit (:func:`commit`)."""
    dev = default_device()
    info = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "device": str(dev)}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
    return info


def run_all(names: list[str] | None = None, quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run the named benchmarks (default: all) and return ``{"machine": ..., "quick": ..., "rows": [...]}``."""
    from tqdm.auto import tqdm

    rows: list[dict[str, Any]] = []
    names = names or available()
    modules = [load(name) for name in names]  # an unknown name fails before any benchmark runs
    measured = machine()  # before the run: the commit and date of the code loaded, whatever changes meanwhile
    for name, mod in zip(names, tqdm(modules, desc="benchmarks", disable=None if progress else True)):
        for row in mod.run(quick=quick):
            rows.append({"benchmark": name, **row})
    return {"machine": measured, "quick": quick, "rows": rows}


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def format_table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table (what ``kvlab bench`` prints and ``docs/benchmarks.md`` shows)."""
    head = "| benchmark | figure | value | unit | baseline | ratio | goal |\n|---|---|---:|---|---:|---:|---:|"
    lines = [head]
    for r in result["rows"]:
        ratio = "; ".join([_fmt(r.get("ratio"))] + [f"{k} {_fmt(v)}" for k, v in r.get("ratios", {}).items()])
        lines.append(f"| {r.get('benchmark', '')} | {r['name']} | {_fmt(r['value'])} | {r.get('unit', '')} | "
                     f"{_fmt(r.get('baseline'))} | {ratio} | {_fmt(r.get('goal'))} |")
    return "\n".join(lines)


def ns_per_item(fn: Any, items: int, reps: int, rounds: int = 5) -> float:
    """Best of ``rounds`` timings of ``reps`` calls of ``fn``, in ns per item (``items`` per call), with the
    garbage collector off while timing: this machine is noisy, and the best round is the least disturbed."""
    return ns_per_item_together({"fn": fn}, items, reps, rounds)["fn"]


def ns_per_item_together(fns: dict[str, Any], items: int, reps: int, rounds: int = 7) -> dict[str, float]:
    """:func:`ns_per_item` for several functions timed in turn within each round, so that a noisy spell slows
    all of them rather than one: ratios between them are then fair. Returns ns per item by name."""
    import gc
    import time

    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            gc.disable()
            try:
                t = time.perf_counter_ns()
                for _ in range(reps):
                    fn()
                best[name] = min(best[name], (time.perf_counter_ns() - t) / (reps * items))
            finally:
                gc.enable()
    return best


def run_script(run: Any, argv: list[str] | None = None) -> list[dict[str, Any]]:
    """The ``__main__`` of a benchmark file: ``--quick`` for small sizes, ``--threads N`` to pin torch's CPU
    threads (on a machine shared with other jobs oversubscribed thread pools stall); prints the rows as a table."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if "--threads" in argv:
        torch.set_num_threads(int(argv[argv.index("--threads") + 1]))
    rows = run(quick="--quick" in argv)
    print(format_table({"rows": rows}))
    return rows


def report(result: dict[str, Any]) -> str:
    """What ``kvlab bench`` prints: a line naming the machine, then :func:`format_table`."""
    m = result["machine"]
    at = f" — commit {m['commit']}" if m.get("commit") else ""
    return (f"kvlab bench — {m['date']}{at} — {m['processor']}, {m['cpu_count']} cores, device {m['device']}, "
            f"torch {m['torch']}{' (quick)' if result['quick'] else ''}\n{format_table(result)}")


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    """Write :func:`run_all`'s result to ``path`` (its folder must exist) as indented JSON."""
    path = Path(path)
    path.write_text(json.dumps(result, indent=2, default=str))
    return path
