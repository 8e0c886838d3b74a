"""Exercises of §2.2.1 (block size): internal fragmentation of one sequence and utilisation of a pool."""
from __future__ import annotations

import random
from typing import Any

from . import Verdict, compare_fn, metadata_pool, register


def pool_utilisation(lengths: list[int], block_size: int) -> float:
    """Tokens stored / token slots reserved, measured on a pool holding one sequence per length."""
    need = sum(-(-n // block_size) for n in lengths)
    pool = metadata_pool(max(need, 1), block_size)
    for n in lengths:
        blocks = pool.allocate(-(-n // block_size))
        for i, b in enumerate(blocks):
            pool.set_token_count(b, min(block_size, n - i * block_size))
    mem = pool.get_memory_usage()
    return mem["token_bytes"] / mem["used"] if mem["used"] else 1.0


def pool_waste(tokens: int, block_size: int) -> int:
    """Empty token slots in the last block of one ``tokens``-long sequence, read from a pool's counters."""
    pool = metadata_pool(-(-tokens // block_size), block_size)
    blocks = pool.allocate(-(-tokens // block_size))
    for i, b in enumerate(blocks):
        pool.set_token_count(b, min(block_size, tokens - i * block_size))
    mem = pool.get_memory_usage()
    return (mem["used"] - mem["token_bytes"]) // pool.spec.bytes_per_token


def _waste_cases() -> list[tuple[int, int]]:
    rng = random.Random(221)
    return [(t, bs) for bs in (1, 8, 16, 64, 256) for t in (1, bs, bs + 1, 2 * bs - 1)] + \
           [(rng.randint(1, 5000), rng.choice((16, 32, 128, 512))) for _ in range(40)]


@register("2.2.1-waste",
          "写一个函数 waste(tokens, block_size)：一条长 tokens 的序列按 block_size 分块后，最后一块里空着的槽位数"
          "（内部碎片, internal fragmentation）。",
          ("想一想：序列长度正好是 block_size 的整数倍时，最后一块空几个槽？",
           "先算要几个块（向上取整），再用块数能装的槽位减去 tokens。",
           "空槽 = ceil(tokens / block_size) × block_size − tokens，也就是 (−tokens) mod block_size。"))
def _judge_waste(fn: Any) -> Verdict:
    return compare_fn(fn, _waste_cases(), pool_waste, "waste")


@register("2.2.1-utilisation",
          "写一个函数 utilisation(lengths, block_size)：把一组序列（长度列表 lengths）放进块大小为 block_size 的池，"
          "返回真正存了 token 的槽位占已分配槽位的比例（0..1）。",
          ("每条序列各自占整数个块；不同序列不共用一个块。",
           "分子是所有序列的 token 数之和；分母是每条序列分到的块数乘以 block_size，再求和。",
           "utilisation = sum(lengths) / sum(ceil(n / block_size) × block_size for n in lengths)。"))
def _judge_utilisation(fn: Any) -> Verdict:
    rng = random.Random(2211)
    cases = [([rng.randint(1, 2000) for _ in range(rng.randint(1, 30))], rng.choice((8, 16, 64, 256, 1024)))
             for _ in range(25)]
    return compare_fn(fn, cases, pool_utilisation, "utilisation", close=True)
