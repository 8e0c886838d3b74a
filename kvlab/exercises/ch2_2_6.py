"""Exercises of §2.2.6 (applications): the KV footprint of a long sequence."""
from __future__ import annotations

from typing import Any

import torch

from ..pool import BlockPool
from ..spec import KVSpec
from . import Verdict, register, same

LONG_SPEC = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)  # a Llama-3-8B-like KV shape


def long_sequence_cost(tokens: int = 100_000, dtype_bytes: int = 2) -> tuple[int, int]:
    """(blocks, bytes) a ``tokens``-long sequence takes in a pool of the :data:`LONG_SPEC` shape."""
    spec = KVSpec(**LONG_SPEC, dtype={2: torch.float16, 4: torch.float32}[dtype_bytes], device=torch.device("cpu"))
    pool = BlockPool(total_memory=spec.bytes_per_block * (-(-tokens // spec.block_size)), spec=spec,
                     with_storage=False)
    blocks = pool.allocate(-(-tokens // spec.block_size))
    return len(blocks), pool.get_memory_usage()["used"]


@register("2.2.6-long",
          "一个类 Llama-3-8B 的 KV 形状：32 层，8 个 KV 头，head_dim 128，fp16，block_size 16。"
          "一条 100,000 token 的序列需要多少个块、多少字节？答案写成 (blocks, bytes)。",
          ("每个 token 要存 K 和 V，每一层都要存。",
           "先算每个 token 的 KV 字节数，再算块数（向上取整），字节数按整块算。",
           "每 token 字节 = 2 × 层数 × KV 头数 × head_dim × 2 (fp16)；blocks = ceil(100000 / 16)；"
           "bytes = blocks × 16 × 每 token 字节。"))
def _judge_long(answer: Any) -> Verdict:
    return same(answer, long_sequence_cost(), "(blocks, bytes)", ("blocks", "bytes"))
