"""Exercises of §2.2.4 (fragmentation and compaction): external fragmentation of a buddy pool, compaction moves."""
from __future__ import annotations

import random
from typing import Any

import numpy as np

from ..block import BlockStatus
from ..errors import KVLabError
from . import Verdict, agrees, canon, metadata_pool, register, returned, same


def fragmentation_case(seed: int) -> tuple[np.ndarray, int, int]:
    """A buddy pool after a seeded random allocate/free history; returns (free mask, top order, kvlab's %)."""
    rng = random.Random(seed)
    top = rng.choice((1, 2, 3))
    pool = metadata_pool(rng.choice((8, 16, 24, 32)), 16, block_sizes=[16 << k for k in range(top + 1)])
    held: list[int] = []
    for _ in range(rng.randint(5, 40)):
        if held and rng.random() < 0.4:
            pool.free([held.pop(rng.randrange(len(held)))])
        elif pool.num_free_blocks:
            try:
                held += pool.allocate(1, size_class=rng.randint(0, top))
            except KVLabError:
                pass
    pool.merge_free_buddies()
    return pool.snapshot()["status"] == int(BlockStatus.FREE), top, pool.calculate_fragmentation()


@register("2.2.4-fragmentation",
          "写一个函数 fragmentation(free, top_order)：free 是按地址排列的基本块是否空闲的布尔数组，"
          "最大的块跨 2**top_order 个基本块（且必须对齐到 2**top_order）。返回外部碎片百分比（整数）："
          "空闲空间里无法拼成一个最大块的那一部分所占的比例。没有空闲空间时返回 0。",
          ("不是所有连续的空闲基本块都能拼成一个最大块。",
           "把数组按 2**top_order 切成对齐的窗口（末尾不足一个窗口的部分不算），只有全空闲的窗口才可用。",
           "结果 round(100 × (1 − 可用的空闲基本块 / 全部空闲基本块))，可用 = 全空闲窗口数 × 2**top_order。"))
def _judge_fragmentation(fn: Any) -> Verdict:
    if not callable(fn):
        return False, f"请传入一个函数 (pass a function), 而不是 {type(fn).__name__}"
    for seed in range(40):
        free, top, truth = fragmentation_case(seed)
        want = canon(truth)
        case = f"free={free.astype(int).tolist()}, top_order={top}"
        got = returned(fn, (free, top), f"fragmentation({case})")
        if not agrees(want, got, close=False):
            return False, f"{case}: 你的函数返回 {got!r}, pool.calculate_fragmentation() = {want!r}"
    return True, "与 BlockPool.calculate_fragmentation 在 40 个随机池上一致 (agrees on 40 random pools)"


def compaction_moves(layout: str) -> int:
    """Fewest migrations that leave every ALLOCATED block below every FREE one (``layout``: 'A' / '.')."""
    pool = metadata_pool(len(layout), 16)
    ids = pool.allocate(len(layout))
    pool.free([b for b, c in zip(ids, layout) if c == "."])
    used = pool.num_blocks - pool.num_free_blocks
    src = [b for b in range(used, pool.num_blocks) if pool.block(b).status is BlockStatus.ALLOCATED]
    dst = [b for b in range(used) if pool.block(b).status is BlockStatus.FREE]
    pool.migrate(src, dst)
    assert pool.free_runs().tolist() == ([pool.num_free_blocks] if pool.num_free_blocks else [])
    return len(src)


@register("2.2.4-moves",
          "布局 'A..AA.A..A.A'（A = ALLOCATED，. = FREE，按地址排列）。要把所有已分配块压到最低地址、"
          "让空闲空间连成一段，最少要用 pool.migrate 搬动几个块？",
          ("压缩之后，已分配的块占据哪几个位置？",
           "数出 A 的个数 k；已经在前 k 个位置里的块不必动。",
           "搬动次数 = 位置 ≥ k 的 A 的个数（等于前 k 个位置里 '.' 的个数）。"))
def _judge_moves(answer: Any) -> Verdict:
    return same(answer, compaction_moves("A..AA.A..A.A"), "搬动次数 (moves)")
