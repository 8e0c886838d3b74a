"""The results §2.2.6 states, each measured on kvlab beside the claim, against a baseline you choose.

The text reports six outcomes of fixed-size blocks without saying against what, on which workload or hardware:
for many users, tens of concurrent users, utilisation up by 30% or more and response time down by 50% or more;
for long sequences, 100,000 tokens and more, 40% less memory and 3x speed. :func:`measure_claims` measures each
on the workload the claim is about:

* the many-users claims on the first ``requests`` requests of the Azure 2023 conversation trace, at the
  trace's own arrival times;
* the long-sequence claims on the first ``long_requests`` requests of the Mooncake conversation trace (prompts of
  12,000 tokens on average, with real shared prefixes), plus one request of ``long_tokens`` tokens.

Each runs through the paged engine and through a contiguous baseline on the same memory (metadata mode, the
engine's :class:`~kvlab.serve.config.CostModel`, so seconds are simulated and ratios matter more than values). Two
baselines, as the PagedAttention paper compares against both:

* ``"max-length"``: each request reserves one region of the context limit up front (its output length is
  unknown), what serving systems did before paging;
* ``"exact-length"``: each request reserves exactly its prompt + output length, an oracle; only external
  fragmentation separates it from paging.

"Utilisation" is read as usage by token (the KV memory holding running requests' tokens, time-averaged), not as
kvlab's ``utilisation``, which also counts the prefix cache's blocks kept after their requests finished: on a trace
without shared prefixes those hold data nobody reads again, and would credit paging with memory doing no work.

A verdict compares one figure with the text's threshold and says plainly when the measurement does not support
the claim. The traces are fixed files and the engine is deterministic, so the same arguments give the same
figures on every run and machine.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlab.core.checks import is_int, is_number
from kvlab.core.errors import ConfigError
from kvlab.serve.config import EngineConfig
from kvlab.serve.engine import Engine
from kvlab.workloads.traces import load_trace, prefix_hits
from kvlab.workloads.mixes import Request, Workload, make_workload

#: baseline name -> the engine's ``memory`` setting that runs it
BASELINES = {"max-length": "contiguous", "exact-length": "contiguous-exact"}
CHAT_TRACE, LONG_TRACE = "azure-conv-2023", "mooncake-conversation"
CHAT_MAX_LEN, LONG_MAX_LEN = 16_384, 131_072  # context limits that fit every request of each trace
CHAT_BATCH, LONG_BATCH = 2048, 8192  # prefill tokens per step (chunked prefill)
#: the claims in the text's order (many users, then long sequences)
CLAIMS = ("数十个并发用户 (tens of concurrent users)", "资源利用率提升30%以上 (utilisation +30% or more)",
          "响应时间减少50%以上 (response time -50% or more)",
          "支持长达10万token以上的序列处理 (sequences of 100k+ tokens)", "内存使用量减少40% (40% less memory)",
          "处理速度提升3倍 (3x processing speed)")


@dataclass(frozen=True)
class Claim:
    """One claim of the text, what kvlab measured for it against ``baseline``, and whether that supports it.

    ``value`` is the figure the verdict reads and ``threshold`` the text's bar: ``supported`` is
    ``value >= threshold``."""
    text: str
    baseline: str
    setup: str
    measured: str
    value: float
    threshold: float
    supported: bool = field(init=False)

    def __post_init__(self) -> None:
        for name in ("value", "threshold"):
            x = getattr(self, name)
            if not is_number(x):  # inf counts: a ratio over nothing
                raise ConfigError(f"Claim.{name} must be a number, got {x!r:.80}")
        object.__setattr__(self, "supported", bool(self.value >= self.threshold))


def _head(name: str, n: int) -> Workload:
    """The first ``n`` requests of a bundled trace, as a workload."""
    w = load_trace(name)
    if not is_int(n) or not 1 <= n <= len(w):
        raise ConfigError(f"{name} has {len(w)} requests: ask for 1..{len(w)}, got {n!r}")
    return Workload(f"{name}[:{n}]", w.requests[:n])


def _runs(w: Workload, baselines: Sequence[str], progress: bool, **cfg: Any) -> dict[str, Engine]:
    """The paged engine and each baseline on ``w`` with the same memory (keyed ``"paged"`` and baseline name),
    each run to the end; the paged engine's per-request log is what the prefix-hit comparison reads."""
    engines = {"paged": Engine(w, EngineConfig(memory="paged", **cfg)),
               **{b: Engine(w, EngineConfig(memory=BASELINES[b], **cfg)) for b in baselines}}
    for e in engines.values():
        e.run(progress=progress)
    return engines


def _slots_per_token(s: dict[str, Any]) -> float:
    """KV slots reserved per token they hold, averaged over the busy steps (1.0: nothing reserved in vain)."""
    return s["usage_by_block"] / s["usage_by_token"] if s["usage_by_token"] else float("inf")


def prefix_hit_share(engine: Engine, workload: Workload, block_size: int) -> tuple[float, float, int]:
    """The prefix cache of a finished paged ``engine`` beside an unbounded one, on the requests it never
    preempted: ``(share of their prompt tokens served from cache, share the unbounded cache serves``
    (:func:`~kvlab.workloads.traces.prefix_hits`)``, number of requests preempted)``. A request preempted by recompute
    finds its own blocks again when readmitted; those hits avoid recomputation but are no prefix sharing, and the
    bound counts each request once, so such requests are left out of both shares."""
    if not isinstance(engine, Engine):
        raise ConfigError(f"engine must be an Engine, got {engine!r:.80}")
    log = engine.log.requests
    bound = prefix_hits(workload, block_size)  # first: it checks the workload and the block size
    late = next((r for r in workload if r.id not in log or log[r.id].finish_step < 0), None)
    if late is not None:
        raise ConfigError(f"request {late.id} of workload {workload.name!r} has not finished in this engine: run "
                          f"the engine on this workload first")
    kept = [(r, int(b)) for r, b in zip(workload, bound) if log[r.id].preemptions == 0]
    prompt = sum(r.prompt_len for r, _ in kept) or 1
    return (sum(log[r.id].prefix_hit_tokens for r, _ in kept) / prompt, sum(b for _, b in kept) / prompt,
            len(workload) - len(kept))


def _hits(engine: Engine, w: Workload, block_size: int) -> str:
    got, bound, preempted = prefix_hit_share(engine, w, block_size)
    return (f"prefix cache served {got:.1%} of the prompt tokens of the {len(w) - preempted} requests never "
            f"preempted; an unbounded cache serves them {bound:.1%} (prefix_hits)")


def check_baselines(baselines: str | Sequence[str]) -> tuple[str, ...]:
    """``baselines`` as a tuple of known names (one name is accepted alone); :class:`ConfigError` otherwise."""
    names = (baselines,) if isinstance(baselines, str) else tuple(baselines) if isinstance(baselines, Iterable) \
        else ()
    bad = [b for b in names if not isinstance(b, str) or b not in BASELINES]
    if bad or not names:
        raise ConfigError(f"baselines must be some of {', '.join(BASELINES)}, got {baselines!r}")
    return names


@dataclass(frozen=True)
class ClaimRuns:
    """The engine runs the six claims are read from (:func:`run_claims`): the Azure (``chat``) and Mooncake
    (``long``) workloads, each run paged and through every baseline on the same memory (``chat_engines``,
    ``long_engines``, keyed ``"paged"`` and by baseline name, each run to the end), the one long request's
    summary (``one``), and the settings."""
    chat: Workload
    long: Workload
    chat_engines: dict[str, Engine]
    long_engines: dict[str, Engine]
    one: dict[str, Any]
    baselines: tuple[str, ...]
    num_blocks: int
    long_num_blocks: int
    block_size: int
    long_tokens: int

    @property
    def many(self) -> dict[str, dict[str, Any]]:
        """The Azure runs' summaries, keyed ``"paged"`` and by baseline name."""
        return {name: e.summary() for name, e in self.chat_engines.items()}

    @property
    def longs(self) -> dict[str, dict[str, Any]]:
        """The Mooncake runs' summaries, keyed ``"paged"`` and by baseline name."""
        return {name: e.summary() for name, e in self.long_engines.items()}


def workloads_table(workloads: Sequence[Workload]) -> str:
    """One line per workload: requests, prompt tokens (mean, median, max), mean output tokens, requests arriving
    per second, and how many prompts hold 100,000 tokens or more; a legend line first."""
    lines = ["列 (columns)：负载、请求数、提示 token 的平均 / 中位数 / 最大、输出 token 的平均、每秒到达的请求、"
             "提示 ≥ 10 万 token 的请求数",
             f"{'workload':32s} {'requests':>8s} {'prompt mean':>11s} {'median':>7s} {'max':>7s} {'output mean':>11s} "
             f"{'req/s':>6s} {'>=100k':>6s}"]
    for w in workloads:
        p = np.array([r.prompt_len for r in w])
        o = np.array([r.output_len for r in w])
        span = w.requests[-1].arrival - w.requests[0].arrival
        lines.append(f"{w.name:32s} {len(w):8d} {p.mean():11,.0f} {np.median(p):7,.0f} {p.max():7,d} "
                     f"{o.mean():11,.0f} {len(w) / span:6.1f} {int((p >= 100_000).sum()):6d}")
    return "\n".join(lines)


#: the summary figures the claims read, one line each in :func:`summary_table`
SUMMARY_KEYS = ("finished", "mean_running", "max_running", "usage_by_token", "usage_by_block", "latency_mean_s",
                "ttft_mean_s", "throughput_tok_s", "preemptions")


def summary_table(results: dict[str, dict[str, Any]], keys: Sequence[str] = SUMMARY_KEYS) -> str:
    """One column per run of ``results`` (run name -> engine summary, e.g. :attr:`ClaimRuns.many`), one line per
    key of ``keys``: floats to three decimals, ints whole."""
    lines = [f"{'':18s}" + "".join(f"{m:>14s}" for m in results)]
    lines += [f"{k:18s}" + "".join(f"{s[k]:14.3f}" if isinstance(s[k], float) else f"{s[k]:14d}"
                                   for s in results.values()) for k in keys]
    return "\n".join(lines)


@dataclass(frozen=True)
class PrefixHitTable:
    """Prefix-cache hits against the unbounded bound, per workload and memory: ``rows`` maps ``(workload name,
    blocks)`` to ``(hit share, bound, evictions)`` and ``preempted`` to the requests left out of both shares (see
    :func:`prefix_hit_share`). ``str()`` is the table the chapter prints."""
    rows: dict[tuple[str, int], tuple[float, float, int]]
    preempted: dict[tuple[str, int], int]

    def __str__(self) -> str:
        lines = ["列 (columns)：负载、块数、前缀命中比例、无界上限 (bound)、被抢占的请求、淘汰次数",
                 f"{'workload':32s} {'blocks':>7s} {'hit share':>9s} {'bound':>7s} {'preempted':>9s} {'evictions':>9s}"]
        lines += [f"{name:32s} {blocks:7d} {got:9.1%} {bound:7.1%} {self.preempted[name, blocks]:9d} {ev:9d}"
                  for (name, blocks), (got, bound, ev) in self.rows.items()]
        return "\n".join(lines)


def prefix_hit_table(runs: ClaimRuns, memories: Sequence[tuple[str, int]]) -> PrefixHitTable:
    """The paged engine's prefix hits on ``runs``' workloads with other memory sizes: ``memories`` lists
    ``("chat" | "long", num_blocks)`` pairs. A pair with the claims' own memory reads the paged run already in
    ``runs``; any other runs the paged engine once, with the settings of that workload's claims runs."""
    rows: dict[tuple[str, int], tuple[float, float, int]] = {}
    preempted: dict[tuple[str, int], int] = {}
    for which, blocks in memories:
        if which not in ("chat", "long"):
            raise ConfigError(f"a memory names the workload 'chat' or 'long', got {which!r}")
        w, engines, own, mml, mbt = ((runs.chat, runs.chat_engines, runs.num_blocks, CHAT_MAX_LEN, CHAT_BATCH)
                                     if which == "chat" else
                                     (runs.long, runs.long_engines, runs.long_num_blocks, LONG_MAX_LEN, LONG_BATCH))
        if blocks == own:
            eng = engines["paged"]
        else:
            eng = Engine(w, EngineConfig(num_blocks=blocks, block_size=runs.block_size, max_model_len=mml,
                                         max_batched_tokens=mbt))
            eng.run()
        got, bound, pre = prefix_hit_share(eng, w, runs.block_size)
        rows[w.name, blocks] = (got, bound, eng.summary()["evictions"])
        preempted[w.name, blocks] = pre
    return PrefixHitTable(rows, preempted)


def run_claims(requests: int = 2000, long_requests: int = 400, *, num_blocks: int = 8192,
               long_num_blocks: int = 65536, block_size: int = 16, long_tokens: int = 100_000,
               baselines: str | Sequence[str] = tuple(BASELINES), progress: bool = False) -> ClaimRuns:
    """Run what :func:`measure_claims` reads, once: a chapter that shows the runs' tables and then the verdicts
    reads both from here (:func:`claims_of`). Arguments as :func:`measure_claims`'s."""
    names = check_baselines(baselines)
    chat, long = _head(CHAT_TRACE, requests), _head(LONG_TRACE, long_requests)
    chat_engines = _runs(chat, names, progress, num_blocks=num_blocks, block_size=block_size,
                         max_model_len=CHAT_MAX_LEN, max_batched_tokens=CHAT_BATCH)
    long_engines = _runs(long, names, progress, num_blocks=long_num_blocks, block_size=block_size,
                         max_model_len=LONG_MAX_LEN, max_batched_tokens=LONG_BATCH)
    return ClaimRuns(chat, long, chat_engines, long_engines, _run_long_request(long_tokens, block_size), names,
                     num_blocks, long_num_blocks, block_size, long_tokens)


def measure_claims(requests: int = 2000, long_requests: int = 400, *, num_blocks: int = 8192,
                   long_num_blocks: int = 65536, block_size: int = 16, long_tokens: int = 100_000,
                   baselines: str | Sequence[str] = tuple(BASELINES), progress: bool = False) -> list[Claim]:
    """Measure the six claims against each of ``baselines`` (names in :data:`BASELINES`); returns one
    :class:`Claim` per claim and baseline, in the text's order, baselines in the order given. Raises
    :class:`~kvlab.core.errors.ConfigError` for an unknown baseline or more requests than a trace holds.

    ``num_blocks`` of ``block_size`` tokens is the memory of the many-users runs, ``long_num_blocks`` that of the
    long-sequence runs. The defaults take about ten seconds on two CPU cores; ``progress`` shows a bar per run."""
    return claims_of(run_claims(requests, long_requests, num_blocks=num_blocks, long_num_blocks=long_num_blocks,
                                block_size=block_size, long_tokens=long_tokens, baselines=baselines,
                                progress=progress))


def claims_of(runs: ClaimRuns) -> list[Claim]:
    """The six claims read from ``runs`` (:func:`run_claims`), as :func:`measure_claims` returns them."""
    if not isinstance(runs, ClaimRuns):
        raise ConfigError(f"claims_of needs the ClaimRuns of run_claims, got {runs!r:.80}")
    names, chat, long, one = runs.baselines, runs.chat, runs.long, runs.one
    num_blocks, long_num_blocks, block_size, long_tokens = (runs.num_blocks, runs.long_num_blocks, runs.block_size,
                                                            runs.long_tokens)
    c, m, long_engine = runs.many, runs.longs, runs.long_engines["paged"]
    chat_setup = (f"{chat.name}: {len(chat)} requests at the trace's arrival times, {num_blocks} blocks x "
                  f"{block_size} tokens, chunked prefill {CHAT_BATCH} tokens/step, context limit {CHAT_MAX_LEN}")
    long_setup = (f"{long.name}: {len(long)} requests (mean prompt "
                  f"{sum(r.prompt_len for r in long) / len(long):,.0f} tokens) at the trace's arrival times, "
                  f"{long_num_blocks} blocks x {block_size} tokens, chunked prefill {LONG_BATCH} tokens/step, "
                  f"context limit {LONG_MAX_LEN}")
    p, q = c["paged"], m["paged"]
    out = []
    for b in names:
        cb, mb = c[b], m[b]
        vs = f"paged vs {b} contiguous reservation, same memory"
        out.append(Claim("数十个并发用户 (tens of concurrent users)", b, f"{chat_setup}; {vs}",
                         f"mean running requests: paged {p['mean_running']:.1f} (max {p['max_running']}), {b} "
                         f"{cb['mean_running']:.1f} (max {cb['max_running']})", p["mean_running"], 20.0))
        gain = p["usage_by_token"] / cb["usage_by_token"] - 1
        out.append(Claim("资源利用率提升30%以上 (utilisation +30% or more)", b, f"{chat_setup}; {vs}",
                         f"usage by token (KV memory holding running requests' tokens): paged "
                         f"{p['usage_by_token']:.1%}, {b} {cb['usage_by_token']:.1%} ({gain:+.0%}); "
                         f"reserved but empty: paged {1 - 1 / _slots_per_token(p):.1%}, {b} "
                         f"{1 - 1 / _slots_per_token(cb):.1%}", gain, 0.30))
        cut = 1 - p["latency_mean_s"] / cb["latency_mean_s"]
        out.append(Claim("响应时间减少50%以上 (response time -50% or more)", b,
                         f"{chat_setup}; {vs}; simulated seconds",
                         f"mean request latency: paged {p['latency_mean_s']:.1f} s, {b} {cb['latency_mean_s']:.1f} s "
                         f"({cut:.0%} less); time to first token {p['ttft_mean_s']:.2f} vs {cb['ttft_mean_s']:.2f} s",
                         cut, 0.50))
        peak, total = one["peak_reserved_slots"], long_tokens + 64
        out.append(Claim("支持长达10万token以上的序列处理 (sequences of 100k+ tokens)", b,
                         f"one request of {long_tokens:,} prompt + 64 output tokens, chunked prefill 2,048 tokens "
                         f"per step, a pool 8 blocks larger than it needs",
                         f"finished: {one['finished'] == 1}; peak KV slots {peak:,} for {total:,} tokens (waste "
                         f"{peak / total - 1:.2%}); the {b} baseline needs one free run of {total:,} slots; "
                         f"{sum(r.prompt_len >= 100_000 for r in long)} of the {long.name} requests reach 100k "
                         f"prompt tokens", float(one["finished"] == 1 and peak <= one["capacity"]), 1.0))
        less = 1 - _slots_per_token(q) / _slots_per_token(mb)
        out.append(Claim("内存使用量减少40% (40% less memory)", b, f"{long_setup}; {vs}",
                         f"KV slots reserved per token held: paged {_slots_per_token(q):.2f}, {b} "
                         f"{_slots_per_token(mb):.2f} ({less:.0%} less memory for the same tokens); "
                         + _hits(long_engine, long, block_size), less, 0.40))
        speed = q["throughput_tok_s"] / mb["throughput_tok_s"]
        out.append(Claim("处理速度提升3倍 (3x processing speed)", b, f"{long_setup}; {vs}; simulated seconds",
                         f"output tokens per simulated second: paged {q['throughput_tok_s']:.1f}, {b} "
                         f"{mb['throughput_tok_s']:.1f} ({speed:.2f}x); mean running requests "
                         f"{q['mean_running']:.1f} vs {mb['mean_running']:.1f}", speed, 3.0))
    order = {t: i for i, t in enumerate(CLAIMS)}
    return sorted(out, key=lambda x: (order[x.text], names.index(x.baseline)))


def _run_long_request(tokens: int, block_size: int) -> dict[str, Any]:
    """One request of ``tokens`` prompt tokens and 64 output tokens in a pool 8 blocks larger than it needs."""
    blocks = -(-(tokens + 64) // block_size) + 8
    s = Engine([Request(0, 0.0, tokens, 64)], EngineConfig(num_blocks=blocks, block_size=block_size,
                                                          max_model_len=tokens + 64, max_batched_tokens=2048)).run()
    return {**s, "capacity": blocks * block_size}


def prefetch_effect(requests: int = 40, seed: int = 1, num_blocks: int = 400) -> dict[str, dict[str, Any]]:
    """The text's prefetching (§2.2.6, long sequences) measured: the same swap-heavy document workload with and
    without prefetch (swap preemption, no prefix caching so that every preemption is a swap). A prefetched
    swap-in overlaps the next step's compute; an on-demand one stalls its step. Returns both summaries."""
    w = make_workload("document", requests, seed, rate=50.0)
    cfg: dict[str, Any] = dict(num_blocks=num_blocks, max_model_len=8192, preemption="swap", prefix_caching=False)
    return {name: Engine(w, EngineConfig(prefetch=on, **cfg)).run()
            for name, on in (("prefetch", True), ("no prefetch", False))}


def verdicts(claims: Sequence[Claim]) -> dict[tuple[str, str], bool]:
    """``(claim text, baseline) -> supported`` for a list from :func:`measure_claims`."""
    return {(c.text, c.baseline): c.supported for c in claims}


def claims_report(claims: Sequence[Claim] | None = None, baseline: str | None = None) -> str:
    """The claims of §2.2.6 beside kvlab's measurements, as plain text; ``baseline`` keeps one baseline's (or
    some, as :func:`check_baselines` reads them)."""
    keep = None if baseline is None else check_baselines(baseline)  # first: before measuring anything
    claims = list(claims) if claims is not None else measure_claims()
    if keep is not None:
        claims = [c for c in claims if c.baseline in keep]
    lines = ["文本 §2.2.6 的结论，用 kvlab 测量（元数据模式，模拟秒）"
             "(Claims of text §2.2.6, measured on kvlab: metadata mode, simulated seconds)", ""]
    for c in claims:
        verdict = "成立 (supported)" if c.supported else "本次测量不支持 (NOT supported by this measurement)"
        lines += [f"* {c.text} vs {c.baseline}: {verdict}", f"    设置 (setup):    {c.setup}",
                  f"    测得 (measured): {c.measured}", ""]
    return "\n".join(lines)


__all__ = ["BASELINES", "CLAIMS", "SUMMARY_KEYS", "Claim", "ClaimRuns", "PrefixHitTable", "check_baselines",
           "claims_of", "claims_report", "measure_claims", "prefetch_effect", "prefix_hit_share", "prefix_hit_table",
           "run_claims", "summary_table", "verdicts", "workloads_table"]
