"""What each part of ``kvlab/fast`` earns end to end: every benchmark below runs with all parts fast, then with one
part on its reference (``KVLAB_REFERENCE=<part>``, read by :func:`kvlab.fast.choose`), interleaved, best of the
rounds. A part's gain is ``seconds with it on the reference / seconds all fast``; a part earns its lines with a
gain >= 1.10x on at least one benchmark (the goal of the issue that split ``kvlab/fast`` out).

The parts (:data:`kvlab.fast.PARTS`) and the benchmarks that run them:

* ``replay``: the 10,000-request replay of ``bench_engine.py`` (what kvlab's block manager did in one engine run,
  replayed: ``pool``, ``append``, ``prefix``);
* ``engine``: 10,000 chat requests through :class:`kvlab.Engine` in metadata mode (``pool``, ``append``,
  ``prefix``);
* ``decode``: the real model (SmolLM2-135M, ``kvlab.load_model``) decoding 64 tokens after a 43-token prompt,
  and 32 tokens after a 2,000-token one, batch 1, the prefill not timed (``pool``, ``append``, ``decode``);
* ``batch decode``: the same model decoding 16 tokens for each of 8 sequences together, each after its own
  2,000-token prompt (a serving step's batch; ``decode`` only: the prefill of 16,000 tokens takes ~40 s a run);
* ``sampling``: parallel sampling, 8 samples forked from one 4,000-token prompt (its blocks shared, §2.2.4),
  decoding 16 tokens each (``decode`` only; the prompt is prefilled once, before the rounds); TinyLlama where the
  model is not installed (and in ``--quick``), and the row says so;
* ``mooncake`` (``--mooncake`` only, minutes): the whole Mooncake conversation trace through the engine, as
  ``kvlab run --trace mooncake-conversation`` runs it.

The pool part is also measured on its Python twin: :class:`~kvlab.fast.pool.PyFastBlockPool` against the reference
(``KVLAB_PURE_PYTHON=1``, in a child process, since the switch is read when kvlab is imported). The widget frame
(``bench_widgets.py``) runs no part of ``kvlab/fast``. ``python benchmarks/bench_parts.py [--quick] [--mooncake]``.
"""
from __future__ import annotations

import ast
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvlab.fast
from kvlab import Engine, EngineConfig, ModelFileError, TinyConfig, TinyLlama, load_model, load_trace
from kvlab.app.bench import load
from kvlab.fast import choose
from kvlab.workloads.mixes import make_workload

FAST = Path(kvlab.fast.__file__).parent
USES = {"replay": ("pool", "append", "prefix"), "engine": ("pool", "append", "prefix"),
        "decode": ("pool", "append", "decode"), "batch": ("decode",), "sampling": ("decode",),
        "mooncake": ("pool", "append", "prefix")}


def c_lines() -> dict[str, int]:
    """Lines of ``_fastpath.c`` by part: its append-loop and chain-walk sections, and the token check both of them
    use (counted in each); the rest is the pool's."""
    c = (FAST / "_fastpath.c").read_text()
    append_at, check_at = c.index("static PyObject *s_seq_id"), c.index("/* token_bytes(ids)")
    walk_at, tables_at = c.index("/* walk_chain("), c.index("static PyMethodDef module_functions")
    append, check, walk = (c[a:b].count("\n") for a, b in ((append_at, check_at), (check_at, walk_at),
                                                            (walk_at, tables_at)))
    return {"pool": c.count("\n") - append - check - walk, "append": append + check, "prefix": walk + check}


def part_lines(compiled: bool = True) -> dict[str, int]:
    """Lines (comments and docstrings included: what a reader reads) of each part: its Python classes or module,
    plus, when ``compiled``, its C (for the Python twins, without it)."""
    spans = {node.name: (node.end_lineno or node.lineno) - node.lineno + 1
             for node in ast.walk(ast.parse((FAST / "pool.py").read_text()))
             if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    c = c_lines() if compiled else {"pool": 0, "append": 0, "prefix": 0}
    checked = spans["_checked"]  # the compiled token check's wrapper, used by both of the parts below
    return {"pool": spans["PyFastBlockPool"] + (spans["FastBlockPool"] + c["pool"] if compiled else 0),
            "append": spans["PyFastSequenceManager"] + (spans["FastSequenceManager"] + checked + c["append"]
                                                        if compiled else 0),
            "prefix": spans["FastPrefixCache"] + checked + c["prefix"],
            "decode": sum(len((FAST / f).read_text().splitlines()) for f in ("attention.py", "_paged_attention.c"))}


# ---------------------------------------------------------------- the benchmarks, each returning a timed callable
def replay_bench(n: int) -> Callable[[], None]:
    engine_bench = load("bench_engine")
    ops, cfg = engine_bench.record(n)

    def run() -> None:
        engine_bench.replay_kvlab(ops, cfg.num_blocks, cfg.block_size)
    return run


def engine_bench(n: int) -> Callable[[], None]:
    w = make_workload("chat", n, 0, rate=200.0)

    def run() -> None:
        Engine(w, EngineConfig()).run()
    return run


def load_decoder(real: bool) -> tuple[Any, str]:
    """SmolLM2-135M where it is installed (and ``real``), else TinyLlama; with its label."""
    if real:
        try:
            return load_model("smollm2-135m", progress=False), "SmolLM2-135M"
        except ModelFileError:
            return TinyLlama(TinyConfig()), "TinyLlama (SmolLM2-135M is not installed)"
    return TinyLlama(TinyConfig()), "TinyLlama"


def decode_bench(model: Any, prompt_len: int, tokens: int, batch: int = 1) -> Callable[[], float]:
    """Greedy decode of ``tokens`` tokens by ``batch`` sequences together, each after its own ``prompt_len``-token
    prompt whose prefill is not timed: the seconds of the decode steps alone."""
    ids = min(1000, model.cfg.vocab_size - 1)
    prompts = [[1 + (i + 7 * s) % ids for i in range(prompt_len)] for s in range(batch)]

    def run() -> float:
        fast = choose()
        per_seq = -(-(prompt_len + tokens) // 16)
        pool = fast.pool(batch * per_seq, spec=model.cfg.kv_spec(16, model.dtype, model.device))
        model.attention = fast.attention  # the model took its attention when built: choose again for this run
        mgr = fast.manager(pool)
        seqs = [mgr.create(p) for p in prompts]
        logits = model.step(mgr, seqs, prompts)
        t = time.perf_counter()
        for _ in range(tokens):
            logits = model.step(mgr, seqs, [[int(row.argmax())] for row in logits])
        return time.perf_counter() - t
    return run


def sampling_bench(model: Any, prompt_len: int, tokens: int, samples: int) -> Callable[[], float]:
    """Parallel sampling: ``samples`` sequences forked from one ``prompt_len``-token prompt (prefilled once, here),
    each decoding ``tokens`` tokens from its own first token: the seconds of the decode steps alone. Every step reads
    the shared prompt's blocks once per sample."""
    prompt = [1 + 7 * i % min(1000, model.cfg.vocab_size - 1) for i in range(prompt_len)]
    fast = choose()
    per_seq = -(-(prompt_len + tokens) // 16)
    mgr = fast.manager(fast.pool(samples * per_seq, spec=model.cfg.kv_spec(16, model.dtype, model.device)))
    model.attention = fast.attention
    root = mgr.create(prompt)
    first = int(model.step(mgr, [root], [prompt])[-1].argmax())

    def run() -> float:
        model.attention = choose().attention
        seqs = [mgr.fork(root) for _ in range(samples)]
        t = time.perf_counter()
        logits = model.step(mgr, seqs, [[(first + s) % model.cfg.vocab_size] for s in range(samples)])
        for _ in range(tokens - 1):
            logits = model.step(mgr, seqs, [[int(row.argmax())] for row in logits])
        took = time.perf_counter() - t
        for seq in seqs:
            mgr.free(seq)
        return took
    return run


def mooncake_bench() -> Callable[[], None]:
    w, B = load_trace("mooncake-conversation"), 16
    keep = sum(-(-r.total_len // B) for r in w.requests)
    cfg = EngineConfig(num_blocks=keep, block_size=B, max_model_len=max(r.total_len for r in w.requests),
                       max_batched_tokens=8192)

    def run() -> None:
        Engine(w, cfg).run()
    return run


def best_seconds(fn: Callable[[], float | None], configs: list[str], rounds: int) -> dict[str, float]:
    """Best wall seconds of ``fn`` under each ``KVLAB_REFERENCE`` value, the configurations in turn within each
    round (rotated each round) so a noisy spell slows all of them; the garbage collector is off while one runs. A
    ``fn`` that returns seconds is timed by what it returns (the part it times itself)."""
    best = {c: float("inf") for c in configs}
    before = os.environ.get("KVLAB_REFERENCE")
    try:
        for r in range(rounds):
            for c in configs[r % len(configs):] + configs[:r % len(configs)]:
                os.environ["KVLAB_REFERENCE"] = c
                gc.collect()
                gc.disable()
                try:
                    t = time.perf_counter()
                    took = fn()
                    best[c] = min(best[c], time.perf_counter() - t if took is None else took)
                finally:
                    gc.enable()
    finally:
        if before is None:
            os.environ.pop("KVLAB_REFERENCE", None)
        else:
            os.environ["KVLAB_REFERENCE"] = before
    return best


def measure(quick: bool, mooncake: bool) -> tuple[dict[str, dict[str, float]], str]:
    """Seconds per benchmark and configuration ("" = all fast, else the part on the reference), and which model
    decoded."""
    n, rounds = (300, 1) if quick else (10_000, 3)
    benches: dict[str, Callable[[], float | None]] = {"replay": replay_bench(n), "engine": engine_bench(n)}
    model, label = load_decoder(real=not quick)
    long = 64 if quick else 2000
    benches["decode"] = decode_bench(model, 43, 4 if quick else 64)
    benches[f"decode after {long:,} tokens"] = decode_bench(model, long, 4 if quick else 32)
    benches[f"batch decode, 8 sequences after {long:,} tokens"] = decode_bench(model, long, 4 if quick else 16, 8)
    shared = 64 if quick else 4000
    benches[f"sampling: 8 samples forked from one {shared:,}-token prompt"] = sampling_bench(
        model, shared, 4 if quick else 16, 8)
    if mooncake:
        benches["mooncake"] = mooncake_bench()
    return {name: best_seconds(fn, ["", *USES[name.split()[0].rstrip(":")]], 1 if name == "mooncake" else rounds)
            for name, fn in benches.items()}, label

def python_twin(quick: bool) -> dict[str, dict[str, float]]:
    """The replay and the engine with the Python twins (``KVLAB_PURE_PYTHON=1``), all fast and with the pool on
    the reference: what :class:`~kvlab.fast.pool.PyFastBlockPool` gains. Runs in a child process."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import bench_parts as b; "
            "n, rounds = (300, 1) if sys.argv[2] == 'quick' else (10_000, 3); "
            "print(json.dumps({k: b.best_seconds(f(n), ['', 'pool'], rounds) for k, f in "
            "(('replay', b.replay_bench), ('engine', b.engine_bench))}))")
    env = {**os.environ, "KVLAB_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), "quick" if quick else "full"],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def rows_of(times: dict[str, dict[str, float]], lines: dict[str, int], twin: str, label: str) -> list[dict]:
    rows = []
    for bench, by in times.items():
        for part in by:
            if not part:
                continue
            gain = by[part] / by[""]
            what = f"{bench}, {label}" if bench.startswith(("decode", "batch", "sampling")) else bench
            rows.append({"name": f"{twin}{part} ({lines[part]} lines): {what}, "
                                 f"part on the reference / all fast",
                         "value": by[part], "unit": "s", "baseline": by[""], "ratio": gain,
                         "goal": ">= 1.10x to earn its lines"})
    return rows


def run(quick: bool, mooncake: bool = False) -> list[dict]:
    times, label = measure(quick, mooncake)
    return (rows_of(times, part_lines(), "", label)
            + rows_of(python_twin(quick), part_lines(compiled=False), "Python twin: ", ""))


if __name__ == "__main__":
    for row in run("--quick" in sys.argv, "--mooncake" in sys.argv):
        print(f"{row['name']:<100} {row['value']:8.3f} s  all fast {row['baseline']:8.3f} s  {row['ratio']:.2f}x")
