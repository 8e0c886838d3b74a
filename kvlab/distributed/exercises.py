"""Exercises of the extension chapter 2.2.7 (beyond one machine), registered through :mod:`kvlab.exercises`.

Every truth is computed by running kvlab: the bytes a transfer moves come from a real two-rank transfer (two
threads of this process, each with its own gloo group), the size of a tensor-parallel block from the rank's
own pool spec.
"""
from __future__ import annotations

from typing import Any

from kvlab.exercises import Verdict, register, register_prediction, same
from kvlab.serve.model import TinyConfig, TinyLlama
from kvlab.distributed.disagg import demo_batches, run_disagg
from kvlab.distributed.tp import TPShard

register_prediction("2.2.7-skipped", "演示的第二批里，decode 进程会跳过（不接收）多少个块？"
                    "(in the demo's second batch, how many blocks does the decode rank skip?)")
register_prediction("2.2.7-long-prompt", "本章测得最长的提示（完整模式 32k token，快速模式 4k）上，把 KV 传过来和在 "
                    "decode 端重新计算，哪个更快？(for the longest prompt measured, is moving its KV or recomputing it "
                    "faster?)", choices=("transfer", "recompute"))
register_prediction("2.2.7-router-blocks", "kvlab 的引擎边跑边发布 KV 事件，跑到一半停下。路由器从事件里知道的块数，"
                    "和池里占用的块数相比如何？(the blocks a router knows from the events, against the blocks the pool "
                    "holds)",
                    choices=("equal", "fewer", "more"))


def transfer_bytes(prompt_len: int, shared: int, prompts: int = 1) -> int:
    """Bytes the connector moves for the second of two batches of ``prompts`` prompts of ``prompt_len`` tokens
    sharing their first ``shared`` tokens (TinyConfig, block size 16 on both ranks): measured by running it."""
    first = run_disagg(demo_batches(prompts, prompt_len, shared)[:1], 1, threads=True).received.bytes
    both = run_disagg(demo_batches(prompts, prompt_len, shared), 1, threads=True).received.bytes
    return both - first


@register("2.2.7-bytes",
          "TinyConfig（2 层，2 个 KV 头，head_dim 16，fp32），两边的块大小都是 16。decode 端已经缓存了一个 200 token "
          "prompt 的前 128 个 token（8 个完整块）。传输这个 prompt 需要传多少字节？"
          "(how many bytes move for a 200-token prompt whose first 128 tokens the decode rank caches?)",
          ("只有没缓存的块才传；最后一个不满的块也要整块传。",
           "先算一个块的字节数：2 (K 和 V) × 层数 × KV 头数 × head_dim × 4 字节 × 16 token；再数要传的块。",
           "先算要传几块：总块数 ceil(200 / 16) 减去对方已有的 128 / 16 块；每块字节 = 2 (K 和 V) × 层数 × KV 头数 × "
           "head_dim × dtype 字节数 × block_size。"))
def _bytes(answer: Any) -> Verdict:
    return same(answer, transfer_bytes(200, 128), "传输的字节数 (bytes moved)")


@register("2.2.7-tp-block",
          "同一个 TinyConfig，tp=2：每个 rank 的一个 16-token 块有多少字节？tp=4（KV 头只有 2 个）时呢？"
          "答案写成 (tp2_bytes, tp4_bytes)。(bytes of one 16-token block on each rank for tp=2 and tp=4)",
          ("每个 rank 只存自己那几个 KV 头。",
           "tp ≤ KV 头数时每个 rank 有 num_kv_heads / tp 个头；tp 更大时一个头不能再切，只能复制。",
           "tp 把 KV 头平分给各 rank；头数不够分时，每个 rank 拿一个头的复制。每 rank 每块字节 = 2 × 层数 × 每 rank "
           "的头数 × head_dim × dtype 字节数 × block_size。"),
          kind="interpret")
def _tp_block(answer: Any) -> Verdict:
    model = TinyLlama(TinyConfig())
    truth = tuple(TPShard(model, tp, 0).kv_spec(16).bytes_per_block for tp in (2, 4))
    return same(answer, truth, "每个 rank 的块字节数 (bytes per block per rank)", ("tp=2", "tp=4"))
