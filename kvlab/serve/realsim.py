"""One run of the real model replayed in metadata mode: the block accounting must match, only the clocks differ.

§2.2.6's chapter serves a few chat requests with a real model (the engine computes and samples), then replays the
same requests with the lengths the model actually sampled through the engine without a model (metadata mode, the
:class:`~kvlab.serve.config.CostModel`'s seconds). Paging decides the same thing in both: which step admits,
preempts and finishes each request. :func:`compare_real_and_metadata` runs the replay, checks that and prints the
tables the chapter shows (block accounting side by side, wall against simulated seconds, one row per request);
:func:`answer_blocks` shows what the real run wrote into the blocks.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.serve.engine import Engine
from kvlab.serve.metrics import RequestRecord
from kvlab.workloads.mixes import Request

# The summary keys paging alone decides: equal in both modes or the replay scheduled differently.
ACCOUNTING = ("finished", "steps", "max_running", "peak_reserved_slots", "usage_by_block", "prefix_hit_tokens",
              "preemptions", "evictions")
_LATENCIES = (("TTFT p50 (s)", "ttft_p50_s"), ("TTFT p99 (s)", "ttft_p99_s"), ("TPOT p50 (s)", "tpot_p50_s"),
              ("TPOT p99 (s)", "tpot_p99_s"), ("全部请求 (all requests, s)", "time_s"))


@dataclass
class RealVsMetadata:
    """The real run, its metadata-mode replay, and what comparing them found; ``str()`` is the chapter's report.

    ``same``: the block accounting (:data:`ACCOUNTING`, the first and last step of every request) is identical, and
    the replay's output tokens exceed the real run's by exactly the end-of-turn tokens of the answers the model
    ended itself (``ended``). ``ranks``: ordering the requests by TTFT gives the same order in steps, in wall
    seconds and in simulated seconds. ``per_step``: seconds per step, (wall, simulated).
    """

    real: Engine
    sim: Engine
    real_summary: dict[str, Any]
    sim_summary: dict[str, Any]
    ended: int
    same: bool
    ranks: bool
    per_step: tuple[float, float]
    lines: list[str] = field(default_factory=list, repr=False)

    def __str__(self) -> str:
        return "\n".join(self.lines)

    def _repr_markdown_(self) -> str:
        return "```\n" + str(self) + "\n```"


def _row(key: str, summaries: Sequence[dict[str, Any]]) -> str:
    return f"{key:22s} " + " ".join(f"{s[key]:12.3f}" if isinstance(s[key], float) else f"{s[key]:12d}"
                                    for s in summaries)


def _by_ttft(ids: Sequence[int], records: dict[int, RequestRecord], key: Callable[[RequestRecord], float]) -> list[int]:
    """Request ids by TTFT, ties by id."""
    return sorted(ids, key=lambda i: (key(records[i]), i))


def compare_real_and_metadata(real: Engine, real_summary: dict[str, Any],
                              requests: Sequence[Request]) -> RealVsMetadata:
    """Replay ``requests`` in metadata mode with the lengths ``real`` sampled, and compare the two runs.

    ``real`` has run ``requests`` with a model (``real_summary`` is what its ``run()`` returned). An answer the model
    ended before ``output_len`` is replayed one token longer: the end-of-turn token the model sampled counts as
    output in metadata mode. Raises :class:`AssertionError` when the two modes schedule differently, when every
    request fitted in the pool at once (nothing to compare) or when TTFTs rank differently in the two clocks.
    """
    out = real.outputs
    sampled = {r.id: len(out[r.id]) + (len(out[r.id]) < r.output_len) for r in requests}  # + end of turn
    replay = [Request(r.id, r.arrival, r.prompt_len, sampled[r.id], prompt_tokens=r.prompt_tokens) for r in requests]
    sim = Engine(replay, real.config)                  # metadata mode: no model, CostModel seconds
    sim_s = sim.run()
    a_log, b_log = real.log.requests, sim.log.requests
    both = (real_summary, sim_s)
    lines = ["块的账目 (block accounting)：左列真实模型 (real model)，右列元数据模式 (metadata)"]
    lines += [_row(k, both) for k in ACCOUNTING]
    ended = sum(len(out[r.id]) < r.output_len for r in requests)
    lines.append(f"{'output_tokens':22s} {real_summary['output_tokens']:12d} {sim_s['output_tokens']:12d}   "
                 f"（元数据模式还数了模型自己结束的 {ended} 个回答的结束符）"
                 "(metadata also counts their end-of-turn token)")
    same = (all(real_summary[k] == sim_s[k] for k in ACCOUNTING)
            and sim_s["output_tokens"] == real_summary["output_tokens"] + ended
            and all(a_log[i].first_step == b_log[i].first_step and a_log[i].finish_step == b_log[i].finish_step
                    for i in sampled))
    if not same:
        raise AssertionError("the two modes must schedule alike")

    lines.append("\n秒 (seconds)，列：墙钟（本机 CPU 上测得）(wall)、"
                 "模拟（CostModel：GPU 上的 7B 模型）(simulated)、墙钟 / 模拟")
    lines += [f"{real_summary[k]:12.4f} {sim_s[k]:12.4f} {real_summary[k] / sim_s[k]:10.1f}   {label}"
              for label, k in _LATENCIES]
    wall, simulated = (s["time_s"] / s["steps"] for s in both)
    lines.append(f"{wall:12.4f} {simulated:12.4f} {wall / simulated:10.1f}   每步秒数 (seconds per step)")
    tps = [real_summary["output_tokens"] / s["time_s"] for s in both]
    lines.append(f"{tps[0]:12.1f} {tps[1]:12.1f} {tps[0] / tps[1]:10.3f}   每秒回答 token (answer tokens / s)")

    lines.append("\n每个请求 (per request)：提示、前缀命中、回答、被抢占次数、首 token 的步数、墙钟秒、模拟秒")
    lines.append(f"{'request':>7s} {'prompt':>6s} {'hits':>4s} {'answer':>6s} {'preempted':>9s} {'TTFT steps':>10s} "
                 f"{'TTFT wall s':>11s} {'TTFT sim. s':>11s}")
    prompt_len = {r.id: r.prompt_len for r in requests}
    for i in sampled:
        a, b = a_log[i], b_log[i]
        lines.append(f"{i:7d} {prompt_len[i]:6d} {a.prefix_hit_tokens:4d} {len(out[i]):6d} {a.preemptions:9d} "
                     f"{a.ttft_steps:10d} {a.ttft_s:11.3f} {b.ttft_s:11.4f}")
    ids = list(sampled)
    ranks = (_by_ttft(ids, a_log, lambda r: r.ttft_steps) == _by_ttft(ids, a_log, lambda r: r.ttft_s)
             == _by_ttft(ids, b_log, lambda r: r.ttft_s))
    if not real_summary["max_running"] < len(requests):
        raise AssertionError("the pool is meant to be too small for every request at once")
    if not ranks:
        raise AssertionError("a step is later than the one before it in both clocks")
    longest = max(r.ttft_steps for r in real.log.finished())
    waited = [i for i in sampled if a_log[i].ttft_steps == longest]
    lines.append(f"\n结论：两种模式的块账目完全相同（步数、块、前缀命中、抢占）：{same} "
                 "(block accounting identical in both modes)")
    lines.append(f"结论：两种模式下都是 {real_summary['max_running']} / {len(requests)} 个请求同时运行；"
                 f"每个请求在同一步拿到第一个 token，所以 TTFT 在两个钟上排序相同：{ranks} "
                 "(TTFTs rank alike in both clocks)")
    lines.append(f"结论：请求 {waited} 等第一个 token 最久（{longest} 步）：墙钟和模拟秒里都是最长的 "
                 "(waited longest in both clocks)")
    lines.append(f"结论：这里一步是 CostModel 秒数的 {wall / simulated:.0f} 倍：这是这台机器的测量，不是分页的性质 "
                 f"(a measurement of this machine, not a property of paging)")
    return RealVsMetadata(real, sim, real_summary, sim_s, ended, same, ranks, (wall, simulated), lines)


def answer_blocks(real: Engine, requests: Sequence[Request], tokenizer: Any, limit: int = 3) -> str:
    """The first ``limit`` requests of a real run, each as the blocks its answer lies in: how long prompt and
    answer are, the prefix-cache hits (and preemptions), the decoded answer, and the text of each block from the
    one where the answer starts (the prompt's last block, then the answer's), cut at block boundaries.
    ``tokenizer`` decodes token ids (``decode(ids) -> str``), e.g. the model's."""
    B = real.config.block_size
    lines = []
    for r in list(requests)[:limit]:
        out = real.outputs[r.id]
        seq, rec = [*(r.prompt_tokens or ()), *out], real.log.requests[r.id]
        first, blocks = r.prompt_len // B, -(-len(seq) // B)   # the block where the answer starts; blocks in all
        again = (f"；被抢占 {rec.preemptions} 次，重新接纳时从缓存拿回自己的 {rec.preempted_hit_tokens} 个 token "
                 f"(preempted, re-admitted: its own blocks found again)" if rec.preemptions else "")
        lines.append(f"\n请求 (request) {r.id}：提示 {r.prompt_len} 个 token + 回答 {len(out)} 个 token = "
                     f"{blocks} 块 | 前缀缓存命中 (prefix-cache hits) {rec.prefix_hit_tokens} 个 token{again}")
        lines.append(f"  回答 (answer): {tokenizer.decode(out)!r}")
        pieces = [repr(tokenizer.decode(seq[k:k + B])) for k in range(first * B, len(seq), B)]
        lines.append(f"  第 {first}..{blocks - 1} 块（提示的结尾，然后是回答）(blocks): " + " | ".join(pieces))
    return "\n".join(lines)
