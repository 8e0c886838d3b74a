"""Exercises of §2.2.3 (allocation and release): shared prefixes and the allocator's strategies."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import Verdict, metadata_pool, register, same


def sharing_scenario(users: int = 5, prefix_blocks: int = 3, own_blocks: int = 2) -> tuple[int, int]:
    """``users`` sequences share ``prefix_blocks`` blocks and each owns ``own_blocks`` more:
    (refcount of a shared block, blocks used)."""
    pool = metadata_pool(64, 16)
    prefix = pool.allocate(prefix_blocks)
    pool.incref(np.repeat(prefix, users - 1))
    for _ in range(users):
        pool.allocate(own_blocks)
    return pool.block(prefix[0]).reference_count, pool.num_blocks - pool.num_free_blocks


@register("2.2.3-sharing",
          "5 个用户共享同一段系统提示词，占 3 个块（第一个用户 allocate，其余 4 个各 incref 一次）；"
          "每个用户再各自 allocate 2 个块。共享块的引用计数是多少？池里一共用掉多少块？答案写成 (refcount, used)。",
          ("共享的块存几份？",
           "引用计数数的是“有几个用户在用”；用掉的块数 = 共享块 + 各自的块。",
           "refcount = 用户数；used = prefix_blocks + users × own_blocks。"))
def _judge_sharing(answer: Any) -> Verdict:
    return same(answer, sharing_scenario(), "(refcount, used blocks)", ("refcount", "used"))


def strategy_scenario() -> list[str]:
    """What the allocator did for size classes 0, 0, 0, 2 on an 8-block buddy pool ('wait' if it queued)."""
    from ..allocator import DynamicAllocator  # lazily: the allocator is optional for the other exercises
    pool = metadata_pool(8, 16, block_sizes=[16, 32, 64, 128])
    alloc = DynamicAllocator(pool)
    out = []
    for size_class in (0, 0, 0, 2):
        ticket = alloc.allocate_optimal_block(size_class=size_class)
        out.append(ticket.strategy or "wait")  # a ticket left waiting has no strategy yet
    return out


@register("2.2.3-strategies",
          "一个 8 个基本块的伙伴池（block_sizes=[16, 32, 64, 128]，开始时是一整块 128 token 的空闲块）。"
          "DynamicAllocator 依次为 size_class 0, 0, 0, 2 各分配一块。每次由哪种策略满足"
          "（'exact' / 'split' / 'merge' / 'evict' / 'wait'）？答案写成列表。",
          ("开始时只有一块最大的空闲块；小请求从哪里来？",
           "画出每次分配后各级空闲链表里有什么：切分留下的另一半还在链表里。",
           "第一次只能把 128 一半一半切到 16（split），留下 16、32、64 各一块；下一次直接取 16（exact），以此类推。"))
def _judge_strategies(answer: Any) -> Verdict:
    return same(answer, strategy_scenario(), "策略 (strategies)", [f"第 {i + 1} 次 (request {i + 1})" for i in range(4)])
