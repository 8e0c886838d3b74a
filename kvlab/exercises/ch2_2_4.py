"""Exercises of §2.2.4 (fragmentation and compaction): unusable free memory of a buddy pool, compaction moves,
the text's reallocation (errata hunting), the cost curve of compaction and a pool with one block size; the
chapter's predictions. The measures are named as in :mod:`kvlab.memory.fragmentation`."""
from __future__ import annotations

import random
from typing import Any

import numpy as np

from kvlab.core.block import ALLOCATED, FREE
from kvlab.core.errors import KVLabError
from kvlab.memory.fragmentation import DefragmentationStrategy, unusable_free_percent
from kvlab.exercises.framework import (Unreadable, Verdict, agrees, canon, metadata_pool, register,
                                       register_prediction, returned, same)


# Hand-made layouts first (num_blocks, top order, FREE base blocks): free runs long enough for a largest block but
# not aligned to it (a function that ignores alignment calls them usable), an aligned pair beside a lone block,
# nothing free, everything free.
LAYOUTS = [(4, 1, (1, 2)), (8, 2, (1, 2, 3, 4)), (8, 1, (2, 3, 5)), (16, 2, (2, 3, 4, 5, 8, 9, 10, 11)),
           (8, 3, ()), (8, 2, tuple(range(8))), (16, 1, (1, 2, 5, 6, 9, 10, 12, 13))]


def layout_case(num_blocks: int, top: int, free: tuple[int, ...]) -> tuple[np.ndarray, int, int]:
    """A buddy pool whose FREE base blocks are ``free``; returns (free mask, top order, kvlab's %)."""
    pool = metadata_pool(num_blocks, 16, block_sizes=[16 << k for k in range(top + 1)])
    pool.allocate(num_blocks)
    if free:
        pool.free(list(free))
    pool.merge_free_buddies()
    return pool.snapshot()["status"] == FREE, top, unusable_free_percent(pool)


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
    return pool.snapshot()["status"] == FREE, top, unusable_free_percent(pool)


@register("2.2.4-fragmentation",
          "写一个函数 fragmentation(free, top_order)：free 是按地址排列的基本块是否空闲的布尔数组，"
          "最大的块跨 2**top_order 个基本块（且必须对齐到 2**top_order）。返回“不可用空闲内存”百分比"
          "（fragmentation_percent，整数）：空闲空间里无法拼成一个最大块的那一部分所占的比例。没有空闲空间时返回 0。",
          ("不是所有连续的空闲基本块都能拼成一个最大块。",
           "把数组按 2**top_order 切成对齐的窗口（末尾不足一个窗口的部分不算），只有全空闲的窗口才可用。",
           "结果 round(100 × (1 − 可用的空闲基本块 / 全部空闲基本块))，可用 = 全空闲窗口数 × 2**top_order。"))
def _judge_fragmentation(fn: Any) -> Verdict:
    if not callable(fn):
        return False, f"请传入一个函数 (pass a function), 而不是 {type(fn).__name__}"
    cases = [layout_case(*c) for c in LAYOUTS] + [fragmentation_case(seed) for seed in range(40)]
    for free, top, truth in cases:
        want = canon(truth)
        case = f"free={free.astype(int).tolist()}, top_order={top}"
        got = returned(fn, (free, top), f"fragmentation({case})")
        if not agrees(want, got, close=False):
            return False, f"{case}: 你的函数返回 {got!r}, TextbookPool(pool).calculate_fragmentation() = {want!r}"
    return True, (f"与 TextbookPool.calculate_fragmentation 在 {len(cases)} 个池上一致 "
                  f"(agrees on {len(LAYOUTS)} hand-made and 40 random pools)")


def compaction_moves(layout: str) -> int:
    """Fewest migrations that leave every ALLOCATED block below every FREE one (``layout``: 'A' / '.')."""
    pool = metadata_pool(len(layout), 16)
    ids = pool.allocate(len(layout))
    pool.free([b for b, c in zip(ids, layout) if c == "."])
    used = pool.num_blocks - pool.num_free_blocks
    src = [b for b in range(used, pool.num_blocks) if pool.fields.status[b] == ALLOCATED]
    dst = [b for b in range(used) if pool.fields.status[b] == FREE]
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


# ---------------------------------------------------------------------------- the text's reallocation, errata
class TextBlock:
    """A block as the text's ``KVBlock`` has it, in the respects its reallocation touches: its capacity is the size
    of the data it holds now (``memory_usage``), ``None`` data (how the text builds a FREE block) is 0 bytes, and
    its reference count is a plain field."""

    def __init__(self, block_id: int, nbytes: int | None, refs: int = 0, status: str = "FREE") -> None:
        self.block_id, self.refs, self.status = block_id, refs, status
        self.data = None if nbytes is None else bytes(nbytes)

    @property
    def memory_usage(self) -> int:
        return 0 if self.data is None else len(self.data)


def text_style_reallocate(active: list[TextBlock], free: list[TextBlock]) -> list[tuple[int, int]]:
    """The steps of the text's ``_reallocate_active_blocks`` and ``_migrate_block_data`` (our own lines): smallest
    active block first, look for a FREE block twice its size, refuse a target smaller than the source, copy, then
    try to release the source; return after the first move. Returns the (source, target) moves made."""
    for src in sorted(active, key=lambda b: b.memory_usage):
        if src.memory_usage >= 2**20:                  # only blocks under 1 MB count as "small"
            continue
        tgt = next((b for b in free if b.status == "FREE" and b.memory_usage >= 2 * src.memory_usage), None)
        if tgt is None or tgt.memory_usage < src.memory_usage:
            continue                                   # no target, or "the target is too small": refused
        tgt.data, tgt.status = src.data, "ALLOCATED"   # copied: the target now has the source's size
        if src.refs == 0:                              # release_block succeeds only at refcount 0
            src.status, src.data = "FREE", None
        return [(src.block_id, tgt.block_id)]          # one move per call
    return []


def reallocation_scenario() -> tuple[int, int, int, int]:
    """Two referenced active blocks (16 and 8 KiB) and three FREE 32 KiB buffers; after one call:
    (moves, blocks holding the moved data, the target's refcount, the target's capacity in KiB)."""
    active = [TextBlock(0, 16 << 10, refs=1, status="ALLOCATED"), TextBlock(1, 8 << 10, refs=1, status="ALLOCATED")]
    free = [TextBlock(i, 32 << 10) for i in (2, 3, 4)]
    moves = text_style_reallocate(active, free)
    src, tgt = moves[0]
    data = active[src].data
    holders = sum(b.data is not None and b.data == data and b.status == "ALLOCATED" for b in active + free)
    target = free[tgt - 2]
    return len(moves), holders, target.refs, target.memory_usage >> 10


@register("2.2.4-errata",
          "找错 (find the bugs)：用本章的 text_style_reallocate（照文本 _reallocate_active_blocks 的步骤写的）处理两个"
          "被引用的活跃块（16 KiB、8 KiB）和三个各有 32 KiB 缓冲区的 FREE 块。调用一次之后："
          "搬了几个块？搬走的数据现在在几个 ALLOCATED 块里？目标块的引用计数是多少？目标块的容量是多少 KiB？"
          "答案写成 (moves, holders, target_refs, target_kib)。",
          ("逐行读：循环在什么时候返回？拷贝之后目标块的大小由什么决定？",
           "文本的块容量就是它当前数据的字节数；release 只在引用计数为 0 时成功；拷贝不改引用计数。",
           "第一次成功就 return → 1 次；源块引用计数 1，释放失败 → 数据在 2 个块里；目标的引用计数没人设 → 0；"
           "target.kv_data = source 的拷贝 → 容量 = 源块大小（8 KiB，最小的先搬）。"), kind="errata")
def _judge_errata(answer: Any) -> Verdict:
    return same(answer, reallocation_scenario(), "(moves, holders, target_refs, target_kib)",
                ("moves", "holders", "target_refs", "target_kib"))


# ---------------------------------------------------------------------------- the cost of compaction, one size
def compaction_experiment(frac: float, n: int = 128, block_sizes: tuple[int, ...] = (16, 32, 64),
                          seed: int = 1) -> tuple[int, int, int, int]:
    """``n`` one-block sequences, a seeded ``frac`` of them freed, then one full defragmentation. Returns
    (blocks moved, fragmentation_percent before, 64-token windows free before, after)."""

    pool = metadata_pool(n, 16, block_sizes=list(block_sizes))
    held = [pool.allocate(1) for _ in range(n)]
    for i in np.random.default_rng(seed).permutation(n)[: int(frac * n)].tolist():
        pool.free(held[i])

    def windows() -> int:
        status = pool.snapshot()["status"]
        return sum(bool((status[s:s + 4] == FREE).all()) for s in range(0, n, 4))

    before, percent = windows(), unusable_free_percent(pool)
    report = DefragmentationStrategy(pool).defragment(force=True)
    return len(report.moves), percent, before, windows()


FRACTIONS = (0.1, 0.25, 0.5, 0.75)
CURVES = ("rises", "falls", "rises, then falls")


@register("2.2.4-curve",
          f"本章的实验：随机释放 {', '.join(f'{int(100 * f)}%' for f in FRACTIONS)} 的块，再完整整理一次。"
          f"释放的比例从小到大，搬动的块数怎样变化？从 {list(CURVES)} 中选一个，并想一想为什么。",
          ("释放得很少时，有多少空洞可填？释放得很多时，还剩多少块要搬？",
           "压缩只搬“边界之上”的已分配块：边界 = 已分配块数。数一数两头的情况。",
           "搬动数 = 位置 ≥ 已分配块数 的已分配块数；它在释放约一半时最大，两头都小。"), kind="interpret")
def _judge_curve(answer: Any) -> Verdict:
    c = canon(answer)
    if c not in CURVES:
        raise Unreadable(f"请从 {list(CURVES)} 中选一个 (choose one of them), 而不是 {c!r}")
    moves = [compaction_experiment(f)[0] for f in FRACTIONS]
    peak = moves.index(max(moves))
    truth = CURVES[0] if peak == len(moves) - 1 else CURVES[1] if peak == 0 else CURVES[2]
    return c == truth, f"搬动数 (moves) {moves} → {truth}" if c == truth else f"不是 {c!r}；把实验跑一遍看看"


@register("2.2.4-one-size",
          "改一个参数 (move a parameter)：把实验的池改成只有一种块大小 block_sizes=(16,)，随机释放 50% 的块 "
          "(n=128, seed=1)。fragmentation_percent 读多少？完整整理一次搬几个块？答案写成 (percent, moves)。",
          ("只有一种块大小时，一个空闲块能不能满足任何请求？",
           "不可用空闲内存只在“拼不成最大尺寸块”时出现；压缩仍按地址把高处的块搬到低处的空洞。",
           "percent = 0（每个空闲块都是最大尺寸）；moves = 位置 ≥ 已分配块数 的已分配块数，和三种尺寸时一样。"),
          kind="parameter")
def _judge_one_size(answer: Any) -> Verdict:
    moves, percent, _, _ = compaction_experiment(0.5, block_sizes=(16,))
    return same(answer, (percent, moves), "(percent, moves)", ("percent", "moves"))


register_prediction("2.2.4-big-block", "随机结束一半序列之后，还能分配一个 64-token 的块吗？"
                    "(after half the sequences end at random, can a 64-token block still be allocated?)",
                    choices=("yes", "no"))
register_prediction("2.2.4-survive", "压缩搬动数据之后，每个序列按更新后的块表读出的 KV 和原来逐位相同吗？"
                    "(after compaction, does every sequence read back bitwise the same KV?)", choices=("yes", "no"))
