"""Exercises of §2.2.6 (applications): the KV footprint of a long sequence, what limits long-sequence throughput,
and how the gain of paging over the exact-length baseline moves with memory; the chapter's predictions."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvlab.memory.fragmentation import memory_usage
from kvlab.core.pool import BlockPool
from kvlab.serve.config import EngineConfig
from kvlab.serve.engine import Engine
from kvlab.core.spec import KVSpec
from kvlab.workloads.traces import load_trace
from kvlab.workloads.mixes import Workload, make_workload
from kvlab.exercises.framework import Unreadable, Verdict, canon, register, register_prediction, same

LONG_SPEC = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)  # a Llama-3-8B-like KV shape

register_prediction("2.2.6-concurrency", "在 Azure 对话 trace 上、同样的内存里，分页引擎平均同时运行的请求数是"
                    "“最大长度预留”基线的几倍？(how many times as many requests run at once, paged vs max-length?)",
                    rel_tol=0.5)
register_prediction("2.2.6-exact-latency", "和“精确长度预留”（知道输出长度的理想基线）相比，"
                    "分页能把平均时延减少 50% 以上吗？"
                    "(against the exact-length oracle, does paging cut mean latency by 50% or more?)",
                    choices=("yes", "no"))
register_prediction("2.2.6-prefetch", "在一个换出很多的文档负载上，预取（把下一步要换入的块提前换入）"
                    "能把总时间缩短 5% 以上吗？"
                    "(on a swap-heavy document workload, does prefetching cut the total time by 5% or more?)",
                    choices=("yes", "no"))
register_prediction("2.2.6-speed", "在 Mooncake 长序列 trace 上，分页的输出吞吐能达到最大长度基线的 3 倍吗？"
                    "(on the Mooncake trace, is paged throughput 3x the max-length baseline's?)", choices=("yes", "no"))


def long_sequence_cost(tokens: int = 100_000, dtype_bytes: int = 2) -> tuple[int, int]:
    """(blocks, bytes) a ``tokens``-long sequence takes in a pool of the :data:`LONG_SPEC` shape."""
    spec = KVSpec(**LONG_SPEC, dtype={2: torch.float16, 4: torch.float32}[dtype_bytes], device=torch.device("cpu"))
    pool = BlockPool(total_memory=spec.bytes_per_block * (-(-tokens // spec.block_size)), spec=spec,
                     with_storage=False)
    blocks = pool.allocate(-(-tokens // spec.block_size))
    return len(blocks), memory_usage(pool)["used"]


@register("2.2.6-long",
          "一个类 Llama-3-8B 的 KV 形状：32 层，8 个 KV 头，head_dim 128，fp16，block_size 16。"
          "一条 100,000 token 的序列需要多少个块、多少字节？答案写成 (blocks, bytes)。",
          ("每个 token 要存 K 和 V，每一层都要存。",
           "先算每个 token 的 KV 字节数，再算块数（向上取整），字节数按整块算。",
           "每 token 字节 = 2 × 层数 × KV 头数 × head_dim × 2 (fp16)；blocks = ceil(100000 / 16)；"
           "bytes = blocks × 16 × 每 token 字节。"))
def _judge_long(answer: Any) -> Verdict:
    return same(answer, long_sequence_cost(), "(blocks, bytes)", ("blocks", "bytes"))


BOTTLENECKS = ("memory", "compute", "arrivals")


def _head(name: str, n: int) -> Workload:
    return Workload(f"{name}[:{n}]", load_trace(name).requests[:n])


def long_sequence_bottleneck(requests: int = 100) -> str:
    """What limits paged throughput on the first ``requests`` Mooncake requests: ``"memory"`` if twice the memory
    raises it by more than 5%, else ``"arrivals"`` if requests hardly ever wait, else ``"compute"``."""
    w = _head("mooncake-conversation", requests)
    cfg: dict[str, Any] = dict(max_model_len=131_072, max_batched_tokens=8192)
    base = Engine(w, EngineConfig(num_blocks=65_536, **cfg)).run()
    more = Engine(w, EngineConfig(num_blocks=131_072, **cfg)).run()
    if more["throughput_tok_s"] > 1.05 * base["throughput_tok_s"]:
        return "memory"
    return "arrivals" if base["mean_waiting"] < 1.0 else "compute"


def _choice(answer: Any, choices: tuple[str, ...]) -> str:
    c = canon(answer)
    if c not in choices:
        raise Unreadable(f"请从 {list(choices)} 中选一个 (choose one of them), 而不是 {c!r}")
    return str(c)


@register("2.2.6-bottleneck",
          "Mooncake trace 上分页同时运行的请求数是最大长度基线的约 5 倍，输出吞吐却只高约 5%。"
          f"吞吐受什么限制？从 {list(BOTTLENECKS)} 中选一个。",
          ("如果内存是瓶颈，多给内存会怎样？",
           "看两件事：内存加倍后吞吐变不变（run_workload 的 throughput_tok_s）；请求是否在排队（mean_waiting）。",
           "内存加倍吞吐涨 > 5% → memory；否则几乎不排队（mean_waiting < 1）→ arrivals；否则 → compute"
           "（长提示的预填充占满每一步的计算）。"), kind="interpret")
def _judge_bottleneck(answer: Any) -> Verdict:
    got = _choice(answer, BOTTLENECKS)  # read first: a malformed answer needs no measurement
    truth = long_sequence_bottleneck()
    why = {"memory": "内存加倍后吞吐上升 (twice the memory raised throughput)",
           "compute": "内存加倍吞吐不变，请求仍在排队：每一步被长提示的预填充占满 (prefill compute is the limit)",
           "arrivals": "请求几乎不排队：吞吐就是到达速率 (throughput follows the arrivals)"}[truth]
    return got == truth, f"测得 (measured): {truth} — {why}" if got == truth else f"不是 {got}; 再看看内存加倍时的吞吐"


TRENDS = ("shrinks", "grows, stays below 50%", "grows past 50%")


def latency_cut_vs_exact(num_blocks: int, requests: int = 600) -> float:
    """``1 - paged / exact-length`` mean latency on the first ``requests`` Azure conversation requests."""
    w = _head("azure-conv-2023", requests)
    cfg: dict[str, Any] = dict(num_blocks=num_blocks, max_model_len=16_384, max_batched_tokens=2048)
    paged = Engine(w, EngineConfig(memory="paged", **cfg)).run()
    exact = Engine(w, EngineConfig(memory="contiguous-exact", **cfg)).run()
    return 1 - paged["latency_mean_s"] / exact["latency_mean_s"]


def memory_trend(big: int = 8192, small: int = 1024) -> tuple[str, float, float]:
    """How the latency cut against the exact-length baseline moves from ``big`` to ``small`` blocks."""
    a, b = latency_cut_vs_exact(big), latency_cut_vs_exact(small)
    return (TRENDS[0] if b <= a else TRENDS[2] if b >= 0.5 else TRENDS[1]), a, b


@register("2.2.6-memory",
          "把“多用户”实验的内存从 8192 块减到 1024 块（Azure 前 600 个请求）。和精确长度基线相比，分页的时延减少"
          f"会怎样变化？从 {list(TRENDS)} 中选一个。",
          ("内存越紧，谁更先卡住：按请求预留整段的基线，还是按块增长的分页？",
           "精确长度基线一开始就预留整段（含尚未生成的输出），还要求一段连续空闲；分页只按需要拿块。"
           "用 memory='contiguous-exact' 和 'paged' 在两种内存下各跑一次，比 latency_mean_s。",
           "减少 = 1 − 分页时延 / 精确基线时延；分别在 8192 和 1024 块下计算，再和 50% 比较。"), kind="parameter")
def _judge_memory(answer: Any) -> Verdict:
    got = _choice(answer, TRENDS)
    truth, a, b = memory_trend()
    return got == truth, (f"8192 块: 减少 {a:.0%}; 1024 块: 减少 {b:.0%} → {truth}"
                          if got == truth else f"不是 {got!r}；两种内存各测一次再比较")


# ---------------------------------------------------------------------------------------------- the chapter's runs
def rag_as_text_and_as_served(n: int = 12, seed: int = 0, num_blocks: int = 4096) -> dict[str, tuple[Workload, dict]]:
    """The text's retrieval scenario (§2.2.1: a query of 10-100 tokens, then 1,000-10,000 tokens of retrieved
    content counted as what the request *returns*) beside the same requests as retrieval-augmented generation serves
    them: the retrieved text is put into the prompt (prefilled, many tokens per step) and the model writes an answer.
    The text gives no answer length: it is drawn as the text's dialogue turn (10-200 tokens, mean 50), our
    assumption. Both run paged on ``num_blocks`` 16-token blocks (chunked prefill 2,048 tokens per step). Returns
    ``{"text": (workload, summary), "served": (workload, summary)}``."""
    text = make_workload("retrieval", n, seed)
    answers = make_workload("chat", n, seed)             # only their output lengths: a dialogue turn each
    served = Workload(f"retrieval-as-served[{n}]",
                      [dataclasses.replace(r, prompt_len=r.prompt_len + r.output_len, output_len=a.output_len)
                       for r, a in zip(text, answers)])
    cfg = EngineConfig(num_blocks=num_blocks, max_model_len=16_384, max_batched_tokens=2048)
    return {name: (w, Engine(w, cfg).run()) for name, w in (("text", text), ("served", served))}
