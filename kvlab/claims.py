"""The results §2.2.6 states, each measured on kvlab beside the claim (guide erratum 11).

The text reports six outcomes of fixed-size blocks (tens of concurrent users; utilisation up by 30% or more;
response time down by 50% or more; sequences of 100,000 tokens and more; 40% less memory; 3x speed) without
saying against what, on which workload or hardware. :func:`measure_claims` runs the same seeded workloads
through the paged engine and through the pre-paging baseline (one max-length contiguous region per request,
:mod:`kvlab.baseline`) on the same memory, in metadata mode with the engine's stated :class:`CostModel`, and
:func:`claims_report` prints each claim, the setup, the figure and a verdict. A verdict says plainly when the
measurement does not support the claim; seconds are simulated, so ratios matter more than absolute values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .engine import Engine, EngineConfig
from .workloads import Request, make_workload


@dataclass(frozen=True)
class Claim:
    """One claim of the text, what kvlab measured for it, and whether the measurement supports it."""
    text: str
    setup: str
    measured: str
    supported: bool


def _run(workload: Any, **cfg: Any) -> dict[str, Any]:
    return Engine(workload, EngineConfig(**cfg)).run()


def measure_claims(requests: int = 2000, seed: int = 0, num_blocks: int = 4096, block_size: int = 16,
                   long_tokens: int = 100_000) -> list[Claim]:
    """Run the measurements (a few seconds at the defaults) and return one :class:`Claim` per claim."""
    chat = make_workload("chat", requests, seed, rate=200.0)
    mem = dict(num_blocks=num_blocks, block_size=block_size)
    paged, base = _run(chat, **mem), _run(chat, memory="contiguous", **mem)
    setup = (f"{requests} chat requests (seed {seed}, Poisson 200/s), {num_blocks} blocks x {block_size} tokens, "
             f"paged vs one {EngineConfig.max_model_len}-token contiguous region per request, same memory")
    out = [Claim("数十个并发用户 (tens of concurrent users)", setup,
                 f"mean running requests: paged {paged['mean_running']:.0f} (max {paged['max_running']}), "
                 f"contiguous {base['mean_running']:.0f} (max {base['max_running']})",
                 paged["mean_running"] >= 20)]
    gain = paged["utilisation"] / base["utilisation"] - 1
    out.append(Claim("资源利用率提升30%以上 (utilisation +30% or more)", setup,
                     f"KV memory holding tokens: paged {paged['utilisation']:.1%}, contiguous "
                     f"{base['utilisation']:.1%} ({gain:+.0%}); internal waste {paged['internal_waste']:.1%} vs "
                     f"{base['internal_waste']:.1%}", gain >= 0.30))
    cut = 1 - paged["latency_mean_s"] / base["latency_mean_s"]
    out.append(Claim("响应时间减少50%以上 (response time -50% or more)", setup + "; simulated seconds (CostModel)",
                     f"mean request latency: paged {paged['latency_mean_s']:.2f} s, contiguous "
                     f"{base['latency_mean_s']:.2f} s ({cut:.0%} less); TTFT {paged['ttft_mean_s']:.2f} vs "
                     f"{base['ttft_mean_s']:.2f} s", cut >= 0.50))
    speed = paged["throughput_tok_s"] / base["throughput_tok_s"]
    out.append(Claim("处理速度提升3倍 (3x processing speed)", setup,
                     f"output tokens per simulated second: paged {paged['throughput_tok_s']:.0f}, contiguous "
                     f"{base['throughput_tok_s']:.0f} ({speed:.2f}x)", speed >= 3.0))
    nocache = _run(chat, prefix_caching=False, **mem)
    per_tok_p, per_tok_b = 1 / (1 - paged["internal_waste"]), 1 / (1 - base["internal_waste"])
    less = 1 - per_tok_p / per_tok_b
    out.append(Claim("内存使用量减少40% (40% less memory)", setup + "; prefix caching on vs off",
                     f"KV slots reserved per token held: paged {per_tok_p:.2f}, contiguous {per_tok_b:.2f} "
                     f"({less:.0%} less memory for the same tokens); prefix caching serves "
                     f"{paged['prefix_hit_tokens'] / max(1, sum(r.prompt_len for r in chat)):.0%} of prompt tokens "
                     f"from cache (hit rate {paged['prefix_hit_rate']:.0%}), mean latency "
                     f"{paged['latency_mean_s']:.2f} s vs {nocache['latency_mean_s']:.2f} s without it",
                     less >= 0.40))
    longreq = [Request(0, 0.0, long_tokens, 64)]
    blocks = -(-(long_tokens + 64) // block_size) + 8
    e = Engine(longreq, EngineConfig(num_blocks=blocks, block_size=block_size, max_model_len=long_tokens + 64,
                                     max_batched_tokens=2048))
    s = e.run()
    peak = s["peak_reserved_slots"]
    out.append(Claim("支持长达10万token以上的序列处理 (sequences of 100k+ tokens)",
                     f"one request of {long_tokens:,} prompt + 64 output tokens, chunked prefill of 2,048 tokens per "
                     f"step, a pool of {blocks:,} blocks",
                     f"finished in {s['steps']} steps; peak KV slots {peak:,} for {long_tokens + 64:,} tokens "
                     f"(waste {peak / (long_tokens + 64) - 1:.2%}); metadata mode, no attention computed",
                     s["finished"] == 1 and peak <= blocks * block_size))
    return out


def prefetch_effect(requests: int = 40, seed: int = 1, num_blocks: int = 400) -> dict[str, dict[str, Any]]:
    """The text's prefetching (§2.2.6, long sequences) measured: the same swap-heavy document workload with and
    without prefetch (swap preemption, no prefix caching so that every preemption is a swap). A prefetched
    swap-in overlaps the next step's compute; an on-demand one stalls its step. Returns both summaries."""
    w = make_workload("document", requests, seed, rate=50.0)
    cfg = dict(num_blocks=num_blocks, max_model_len=8192, preemption="swap", prefix_caching=False)
    return {name: _run(w, prefetch=on, **cfg) for name, on in (("prefetch", True), ("no prefetch", False))}


def claims_report(claims: list[Claim] | None = None) -> str:
    """The claims of §2.2.6 beside kvlab's measurements, as plain text."""
    claims = claims if claims is not None else measure_claims()
    lines = ["Claims of text §2.2.6, measured on kvlab (metadata mode, simulated seconds)", ""]
    for c in claims:
        verdict = "supported" if c.supported else "NOT supported by this measurement"
        lines += [f"* {c.text}: {verdict}", f"    setup:    {c.setup}", f"    measured: {c.measured}", ""]
    return "\n".join(lines)
