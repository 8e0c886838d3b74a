"""Exercises of §2.2.4 (fragmentation and compaction): unusable free memory of a buddy pool, compaction moves,
the text's reallocation (errata hunting), the cost curve of compaction and a pool with one block size; the
chapter's predictions. The measures are named as in :mod:`kvlab.memory.fragmentation`."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlab.core.block import ALLOCATED, FREE
from kvlab.core.errors import KVLabError
from kvlab.core.pool import BlockPool
from kvlab.core.spec import KVSpec
from kvlab.memory.fragmentation import DefragmentationStrategy, unusable_free_percent
from kvlab.textbook import as_written as text
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


# ---------------------------------------------------------------------------- the chapter's fragmented pool
def fragmented_pool(spec: KVSpec, n: int, seed: int = 0) -> tuple[BlockPool, dict[int, list[int]]]:
    """A pool of ``n`` base blocks with block sizes 16/32/64 tokens (times ``spec.block_size // 16``): sequences
    take 1-3 base blocks each (random KV data, 1-16 tokens per block) until fewer than 4 are free, then a seeded
    half of the sequences end. Returns the pool and the live sequences' block tables (owner -> block ids).
    The same ``seed`` gives the same layout and data."""
    bs = spec.block_size
    pool = BlockPool(n, spec=spec, block_sizes=[bs, 2 * bs, 4 * bs])
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    tables: dict[int, list[int]] = {}
    while pool.num_free_blocks >= 4:
        owner = len(tables)
        tables[owner] = pool.allocate(int(rng.integers(1, 4)), owner=owner)
        for b in tables[owner]:
            view = pool.storage_of().block_view(b, 1)
            view.copy_(torch.randn(view.shape, generator=gen, dtype=view.dtype))
            pool.set_token_count(b, int(rng.integers(1, bs + 1)))
    for o in rng.permutation(list(tables))[: len(tables) // 2].tolist():
        pool.free(tables.pop(o))
    return pool, tables


def aligned_free_windows(pool: BlockPool, span: int = 4) -> int:
    """Aligned windows of ``span`` base blocks that are wholly FREE: each could be one block ``span`` times the
    base size once its free buddies are merged."""
    status = pool.snapshot()["status"]
    return sum(bool((status[s:s + span] == FREE).all()) for s in range(0, pool.num_blocks - span + 1, span))


# ---------------------------------------------------------------------------- how large a real model's block is
MODEL_SHAPES = {"Llama-3-8B": (32, 8, 128), "Llama-3.2-1B": (16, 8, 64), "SmolLM2-135M": (30, 3, 64)}
"""(layers, KV heads, head_dim) of models whose published configs we checked; fp16 KV cache."""


def block_bytes(model: str, block_size: int, layers: bool = True) -> int:
    """Bytes of one block of ``block_size`` tokens (K and V, fp16) of ``model``: over all its layers, or one
    layer's (``layers=False``; vLLM keeps one KV tensor per layer, so one layer's page is what a block id picks)."""
    n_layers, heads, dim = MODEL_SHAPES[model]
    return 2 * 2 * block_size * heads * dim * (n_layers if layers else 1)


# ---------------------------------------------------------------------------- the text's reallocation, errata
KIB = 1024


def text_defrag_pool(free: int = 3, buffers: bool = True, seed: int = 0) -> text.BlockPool:
    """The text's pool (:mod:`kvlab.textbook.as_written`) filled by hand, as no text code fills it, its lists keyed by
    bytes: block 0 (16 KiB of data) and block 1 (8 KiB) ALLOCATED, referenced once each (a sequence holds them)
    and active, and ``free`` FREE blocks 2, 3, ... in the 32 KiB list, each with a 32 KiB buffer (``buffers``) or,
    as the text builds a FREE block, no data. ``total_memory`` is every buffer together."""
    rng = np.random.default_rng(seed)

    def data(kib: int) -> np.ndarray:
        return rng.integers(0, 256, kib * KIB, dtype=np.uint8)
    pool = text.BlockPool(total_memory=(16 + 8 + 32 * free) * KIB, block_sizes=[8 * KIB, 16 * KIB, 32 * KIB])
    for b, kib in ((0, 16), (1, 8)):
        block = text.make_block(b, data(kib), text.BlockStatus.ALLOCATED, reference_count=1)
        pool.blocks[kib * KIB].append(block)
        pool.active_blocks[b] = block
    pool.blocks[32 * KIB] += [text.make_block(2 + i, data(32) if buffers else None) for i in range(free)]
    return pool


def text_free_pool(free_kib: list[int | None]) -> text.BlockPool:
    """The text's pool whose one size list (64 KiB) holds FREE blocks with a buffer of ``free_kib[i]`` KiB each
    (None: no data, as the text builds a FREE block); ``total_memory`` is their sum."""
    pool = text.BlockPool(total_memory=sum(k or 0 for k in free_kib) * KIB, block_sizes=[64 * KIB])
    pool.blocks[64 * KIB] = [text.make_block(i, None if k is None else np.zeros(k * KIB, np.uint8))
                             for i, k in enumerate(free_kib)]
    return pool


def text_free_blocks(pool: text.BlockPool) -> list[text.KVBlock]:
    """The FREE blocks of the text's pool, list by list."""
    return [b for size in pool.block_sizes for b in pool.blocks[size] if b.status == text.BlockStatus.FREE]


def holders(pool: text.BlockPool, block_id: int) -> int:
    """How many ALLOCATED blocks of the text's ``pool`` hold the data that active block ``block_id`` holds."""
    want = pool.active_blocks[block_id].kv_data
    return sum(b.status == text.BlockStatus.ALLOCATED and b.kv_data is not None and want is not None
               and np.array_equal(b.kv_data, want) for size in pool.block_sizes for b in pool.blocks[size])


def text_defrag_calls(calls: int = 5, free: int = 4) -> list[dict[str, int | bool | None]]:
    """Call the text's ``defragment()`` ``calls`` times on :func:`text_defrag_pool` (``free`` FREE 32 KiB
    buffers). One row before the first call (``returned`` None) and one after each: what it returned, FREE blocks
    and their KiB, the text's ``free`` KiB (``get_memory_usage``), its fragmentation percent, how many blocks hold
    block 1's data and block 0's."""
    pool = text_defrag_pool(free)
    strategy = text.DefragmentationStrategy(pool)
    rows: list[dict[str, int | bool | None]] = []
    for call in range(calls + 1):
        done = strategy.defragment() if call else None
        free_now = text_free_blocks(pool)
        rows.append({"call": call, "returned": done, "free_blocks": len(free_now),
                     "free_kib": sum(b.memory_usage for b in free_now) // KIB,
                     "text_free_kib": pool.get_memory_usage()["free"] // KIB,
                     "fragmentation": pool.calculate_fragmentation(), "holders_of_block_1": holders(pool, 1),
                     "holders_of_block_0": holders(pool, 0)})
    return rows


def reallocation_scenario() -> tuple[int, int, int, int]:
    """Blocks 0 and 1 (16 and 8 KiB) active and referenced, three FREE 32 KiB buffers; after one call of the
    text's ``_reallocate_active_blocks``: (moves, blocks holding the moved data, the target's refcount, the
    target's capacity in KiB)."""
    pool = text_defrag_pool(3)
    before = {b.block_id for b in text_free_blocks(pool)}
    text.DefragmentationStrategy(pool).reallocate_active_blocks()
    moved = sorted(before - {b.block_id for b in text_free_blocks(pool)})
    target = pool.active_blocks[moved[0]]
    return len(moved), holders(pool, 1), target.reference_count, target.memory_usage // KIB


@register("2.2.4-errata",
          "找错 (find the bugs)：kvlab.text_as_written 是按文本的代码重写、行为与文本相同的代码。文本的池里有两个"
          "被引用的活跃块（块 0 有 16 KiB 数据，块 1 有 8 KiB）和三个各有 32 KiB 缓冲区的 FREE 块"
          "（ch2_2_4.text_defrag_pool(3)；文本自己的池从不创建块，这些是我们放进去的）。"
          "用 text_as_written.DefragmentationStrategy(pool) 调用一次 _reallocate_active_blocks() 之后："
          "搬了几个块？搬走的数据现在在几个 ALLOCATED 块里？目标块的引用计数是多少？目标块的容量是多少 KiB？"
          "答案写成 (moves, holders, target_refs, target_kib)。",
          ("逐行读：循环在什么时候返回？拷贝之后目标块的大小由什么决定？",
           "文本的块容量就是它当前数据的字节数；release 只在引用计数为 0 时成功；拷贝不改引用计数。",
           "逐行跟踪 _reallocate_active_blocks：循环在第几次成功后 return？搬完后源块的引用计数是多少，release "
           "能成功吗？目标块的引用计数由哪一行设置？目标的容量取自谁的数据？"), kind="errata")
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


@dataclass(frozen=True)
class CompactionCurve:
    """:func:`compaction_experiment` at each of ``fractions``: ``rows`` on the buddy pool (sizes 16, 32, 64),
    ``one_size`` on a pool of one block size, each row (moves, fragmentation_percent before, 64-token windows
    free before, after). ``str()`` is the chapter's table and conclusion, :meth:`plot` its figure."""
    fractions: tuple[float, ...]
    rows: list[tuple[int, int, int, int]]
    one_size: list[tuple[int, int, int, int]]
    bytes_per_block: int

    @property
    def moves(self) -> list[int]:
        return [r[0] for r in self.rows]

    @property
    def peak(self) -> int:
        """The index of the fraction with the most moves (the first, on a tie)."""
        return self.moves.index(max(self.moves))

    @property
    def shape(self) -> str:
        """Which of :data:`CURVES` the moves draw."""
        last = len(self.rows) - 1
        return CURVES[0] if self.peak == last else CURVES[1] if self.peak == 0 else CURVES[2]

    def __str__(self) -> str:
        lines = [f"{'释放 freed':>10s} {'搬动 moves':>10s} {'搬动 KiB':>9s} {'不可用 %':>8s} "
                 f"{'64-token 块数 前 -> 后':>22s} {'一种大小: 不可用 %':>18s}"]
        for f, (m, pct, b0, b1), u in zip(self.fractions, self.rows, self.one_size):
            lines.append(f"{int(100 * f):9d}% {m:10d} {m * self.bytes_per_block / 1024:9.1f} {pct:8d} "
                         f"{b0:13d} -> {b1:<6d} {u[1]:18d}")
        curve = "先升后降 (rise, then fall)" if self.shape == CURVES[2] else "不是先升后降 (do not rise, then fall)"
        at = int(100 * self.fractions[self.peak])
        lines.append(f"结论 (conclusion): 搬动数{curve}（释放 {at}% 时最多 (most at {at}% freed)）；"
                     f"一种块大小时不可用空闲内存始终 (one block size: unusable free memory always) "
                     f"{ {u[1] for u in self.one_size} }")
        return "\n".join(lines)

    def plot(self) -> Any:
        """Blocks moved, and 64-token blocks that fit before and after, against the share freed."""
        from kvlab.viz.static import Picture

        fig = Picture(figsize=(6.5, 3.2), layout="constrained")
        ax = fig.subplots()
        x = [100 * f for f in self.fractions]
        ax.plot(x, self.moves, "o-", label="搬动的块 (blocks moved)")
        ax.plot(x, [r[3] for r in self.rows], "s-", label="整理后能放的 64-token 块 (64-token blocks after)")
        ax.plot(x, [r[2] for r in self.rows], "^--", label="……整理前 (before)")
        ax.set_xlabel("随机释放的块 % (% of blocks freed at random)")
        ax.legend(fontsize=9)
        return fig


def compaction_curve(n: int = 128, bytes_per_block: int = 0,
                     fractions: tuple[float, ...] = FRACTIONS) -> CompactionCurve:
    """The compaction experiment of ``n`` blocks at each of ``fractions``, on the buddy pool and on one block
    size; ``bytes_per_block`` (the chapter's spec) sizes the moves in KiB."""
    return CompactionCurve(tuple(fractions), [compaction_experiment(f, n=n) for f in fractions],
                           [compaction_experiment(f, n=n, block_sizes=(16,)) for f in fractions], bytes_per_block)


@register("2.2.4-curve",
          f"本章的实验：随机释放 {', '.join(f'{int(100 * f)}%' for f in FRACTIONS)} 的块，再完整整理一次。"
          f"释放的比例从小到大，搬动的块数怎样变化？从 {list(CURVES)} 中选一个，并想一想为什么。",
          ("释放得很少时，有多少空洞可填？释放得很多时，还剩多少块要搬？",
           "压缩只搬“边界之上”的已分配块：边界 = 已分配块数。数一数两头的情况。",
           "搬动数 = 位置不小于已分配块数的已分配块个数。在“释放得很少”“几乎全部释放”两端各估一次，再在中间估一次，"
           "比较三个数。"), kind="interpret")
def _judge_curve(answer: Any) -> Verdict:
    c = canon(answer)
    if c not in CURVES:
        raise Unreadable(f"请从 {list(CURVES)} 中选一个 (choose one of them), 而不是 {c!r}")
    curve = compaction_curve()
    truth = curve.shape
    return c == truth, f"搬动数 (moves) {curve.moves} → {truth}" if c == truth else f"不是 {c!r}；把实验跑一遍看看"


@register("2.2.4-one-size",
          "改一个参数 (move a parameter)：把实验的池改成只有一种块大小 block_sizes=(16,)，随机释放 50% 的块 "
          "(n=128, seed=1)。fragmentation_percent 读多少？完整整理一次搬几个块？答案写成 (percent, moves)。",
          ("只有一种块大小时，一个空闲块能不能满足任何请求？",
           "不可用空闲内存只在“拼不成最大尺寸块”时出现；压缩仍按地址把高处的块搬到低处的空洞。",
           "只有一种块大小时，一个空闲块可能“小到用不上”吗？搬动数的规则和块的尺寸有没有关系？"
           "和三种尺寸时的规则对照一下。"),
          kind="parameter")
def _judge_one_size(answer: Any) -> Verdict:
    moves, percent, _, _ = compaction_experiment(0.5, block_sizes=(16,))
    return same(answer, (percent, moves), "(percent, moves)", ("percent", "moves"))


register_prediction("2.2.4-big-block", "随机结束一半序列之后，池的 pool.allocate(1, size_class=2) 还能分配一个 "
                    "64-token 的块吗？(after half the sequences end at random, can the pool's allocate still give a "
                    "64-token block?)", choices=("yes", "no"))
register_prediction("2.2.4-survive", "压缩搬动数据之后，每个序列按更新后的块表读出的 KV 和原来逐位相同吗？"
                    "(after compaction, does every sequence read back bitwise the same KV?)", choices=("yes", "no"))
