"""Exercises of §2.2.2 (block management): the state machine, LRU order, reference counts; the chapter's
experiments (hit rates of the eviction policies, CLOCK beside LRU, the cost of one eviction)."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlab.core.block import BlockStatus
from kvlab.core.errors import ConfigError, KVLabError
from kvlab.core.eviction import ClockPolicy, FutureUses, OPTPolicy
from kvlab.core.pool import BlockPool
from kvlab.core.spec import KVSpec
from kvlab.textbook import as_written
from kvlab.textbook.pool import KVBlock, TextbookPool
from kvlab.exercises.framework import (Canon, Unreadable, Verdict, canon, metadata_pool, register, register_prediction,
                                       same)


MIB = 1 << 20


@dataclass(frozen=True)
class LookupUnits:
    """The text's ``get_best_block`` asked for real K/V sizes (the appendix's unit error): per model, the bytes of
    one token (one layer / all layers), the most tokens whose data it still matches with a block, and whether 16
    and 64 tokens of data are "small" (under 1 MiB), one layer / all layers. ``str()`` is the appendix's table."""
    units: dict[str, dict[str, Any]]

    @property
    def never_found(self) -> list[str]:
        """Models for which not even one token of one layer finds a block."""
        return [n for n, u in self.units.items() if u["most_tokens_found"][0] == 0]

    @property
    def small_at_16(self) -> list[str]:
        """Models whose 16 tokens of all layers are under 1 MiB."""
        return [n for n, u in self.units.items() if u["under_1mib"][16][1]]

    def __str__(self) -> str:
        yes = {True: "是", False: "否"}
        lines = ["模型 (model)                每 token 字节：一层 / 全部层   找得到块的最多 token：一层 / 全部层   "
                 "小于 1 MiB？16 token：一层/全部层；64 token：一层/全部层"]
        for name, u in self.units.items():
            (layer, whole), found, small = u["bytes_per_token"], u["most_tokens_found"], u["under_1mib"]
            lines.append(f"{name:26s} {layer:>8,} / {whole:>9,}               {found[0]:>4} / {found[1]:<4}"
                         f"                       {yes[small[16][0]]}/{yes[small[16][1]]}；"
                         f"{yes[small[64][0]]}/{yes[small[64][1]]}")
        lines.append("连一层一个 token 的数据都找不到块 (not even one token of one layer finds a block): "
                     f"{self.never_found}")
        lines.append("16 个 token、全部层的数据小于 1 MiB，算“小块” (16 tokens of all layers under 1 MiB): "
                     f"{self.small_at_16}")
        return "\n".join(lines)


def text_lookup_units(models: dict[str, KVSpec], sizes: list[int]) -> LookupUnits:
    """Ask the text's pool, built with ``block_sizes=sizes`` (tokens, as the text means them) and one FREE block
    put in each list by hand, for each model's data in bytes, as the text's allocator asks: see which sizes it
    matches. The text compares bytes with tokens, so the answer is ``max(sizes) // bytes`` tokens."""
    pool = as_written.BlockPool(total_memory=1 << 30, block_sizes=list(sizes))
    for i, size in enumerate(pool.block_sizes):
        pool.blocks[size].append(as_written.make_block(i, np.zeros((2, 16, 2, 8), np.float32)))

    def most_tokens_found(bytes_per_token: int) -> int:
        t = 0
        while pool.get_best_block((t + 1) * bytes_per_token) is not None:
            t += 1
        return t

    units: dict[str, dict[str, Any]] = {}
    for name, spec in models.items():
        layer, whole = spec.bytes_per_token // spec.num_layers, spec.bytes_per_token
        units[name] = {"bytes_per_token": [layer, whole],
                       "most_tokens_found": [most_tokens_found(layer), most_tokens_found(whole)],
                       "under_1mib": {t: [t * layer < MIB, t * whole < MIB] for t in (16, 64)}}
    return LookupUnits(units)


def legal_transitions() -> set[tuple[BlockStatus, BlockStatus]]:
    """Every (old, new) pair that :meth:`BlockStatus.check` accepts."""
    legal = set()
    for old in BlockStatus:
        for new in BlockStatus:
            try:
                BlockStatus.check(-1, old, new)
                legal.add((old, new))
            except KVLabError:
                pass
    return legal


def _status(c: Canon) -> BlockStatus:
    """A canonical status: a member's name (``BlockStatus.FREE`` is canonically ``"FREE"``) or its int value."""
    if isinstance(c, str) and c in BlockStatus.__members__:
        return BlockStatus[c]
    if isinstance(c, int) and c in {int(s) for s in BlockStatus}:
        return BlockStatus(c)
    raise Unreadable(f"{c!r} 不是 BlockStatus 的状态 (is not a BlockStatus; use BlockStatus.FREE or 'FREE')")


@register("2.2.2-transitions",
          "BlockStatus 有 FREE / PENDING / ALLOCATED / EVICTING 四个状态。给出所有合法的状态转移，"
          "写成集合 {(old, new), ...}，old/new 用 BlockStatus 成员。",
          ("一个块从哪里来、到哪里去？每个状态至少有一条出路。",
           "逐个状态问：FREE 怎样被占用？PENDING 是预留，可以提交也可以放弃；ALLOCATED 怎样离开？",
           "画一张 4×4 的表（旧状态 × 新状态），每一格用 BlockStatus.check(-1, old, new) 试一次："
           "不抛错的格子就是合法转移。"))
def _judge_transitions(answer: Any) -> Verdict:
    legal = legal_transitions()
    shape = "答案应是 (old, new) 二元组的集合 (a set of (old, new) pairs)"
    try:
        pairs = canon(answer)
    except Unreadable as e:
        return False, f"{shape}: {e}"
    if not isinstance(pairs, (tuple, frozenset)):
        return False, shape
    given = set()
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            return False, shape
        given.add((_status(pair[0]), _status(pair[1])))
    if legal == given:
        return True, f"{len(legal)} 条合法转移 (legal transitions)"
    extra, missing = given - legal, legal - given
    parts = []
    if extra:
        parts.append(f"多了 {len(extra)} 条不合法的 ({len(extra)} not legal)")  # named, each would be given away
    if missing:
        parts.append(f"少了 {len(missing)} 条 (missing {len(missing)})")
    return False, "; ".join(parts)


def lru_scenario(released: tuple[int, ...] = (2, 0, 3, 1), reused: tuple[int, ...] = (0,)) -> list[int]:
    """Reusable blocks 0..n-1, released in the order ``released``; each of ``reused`` is then reused and released
    again, in that order. The LRU pool's eviction order."""
    pool = metadata_pool(len(released), 16, eviction_policy="lru")
    blocks = pool.allocate(len(released))
    pool.mark_reusable(blocks)
    for b in released:
        pool.free([b])
    for b in reused:
        pool.incref([b])
        pool.free([b])
    order = []
    for _ in released:
        victim = pool.evict()
        if victim is None:
            raise ConfigError("2.2.2-lru scenario: the pool found nothing to evict")  # a scenario bug, not an answer
        order.append(victim)
    return order


@register("2.2.2-lru",
          "一个 4 块的池（eviction_policy='lru'）：allocate(4) 得到块 0,1,2,3，全部 mark_reusable；"
          "按 2, 0, 3, 1 的顺序 free（它们变成 cached）；然后 incref([0]) 再 free([0])。"
          "接下来连续调用 4 次 pool.evict()，依次淘汰哪些块？答案写成列表。",
          ("LRU 淘汰的是最久没有被用过的块，不是最先分配的块。",
           "按时间写下每个块最后一次被访问的时刻（free 和 incref 都算访问），从最早的开始淘汰。",
           "把每次 allocate / incref / free 按时间排成一行，只看每个块最后一次被碰到的时刻；LRU "
           "先淘汰最后一次最早的那个。想清楚哪些调用算“碰到”。"))
def _judge_lru(answer: Any) -> Verdict:
    return same(answer, lru_scenario(), "淘汰顺序 (order)", [f"第 {i + 1} 个淘汰 (victim {i + 1})" for i in range(4)])


def refcount_scenario() -> tuple[int, str]:
    """A block allocated, incref'd twice through one list, decref'd once and freed once: (refcount, status)."""
    pool = metadata_pool(4, 16)
    (b,) = pool.allocate(1)
    pool.incref([b, b])
    pool.decref([b])
    pool.free([b])
    block = KVBlock(pool, b)
    return block.reference_count, block.status.name


@register("2.2.2-refcount",
          "在一个新池上：(b,) = pool.allocate(1)；pool.incref([b, b])；pool.decref([b])；pool.free([b])。"
          "此时块 b 的 reference_count 和 status.name 是什么？答案写成 (refcount, 'STATUS')。",
          ("free 不是“立刻回收”，它只是放下一个引用。",
           "从 allocate 的计数开始，逐步加减：列表里重复的 id 各算一次。",
           "逐个调用记下计数：allocate 把它设成几？incref 收到一个列表时，列表里每一项各加一次；decref、free "
           "各减一次。计数为 0 和不为 0 时块各处于哪个状态？"))
def _judge_refcount(answer: Any) -> Verdict:
    return same(answer, refcount_scenario(), "(refcount, status)", ("reference_count", "status"))


# ---------------------------------------------------------------------------- the hit-rate experiment
HIT_POLICIES = ("lru", "fifo", "lfu", "clock", "opt")
HITS = ("reacquire", "touch")


@dataclass(frozen=True)
class ZipfRun:
    """One run of the chapter's cache experiment. ``victims`` holds, when asked for, one ``(victim, lru_victim)``
    pair per eviction: the block the policy evicted and the least recently used block of the same cache at that
    moment (LRU's choice); ``most_bits`` is the most CLOCK reference bits set at any eviction (0 for the others)."""

    hit_rate: float
    evictions: int
    victims: tuple[tuple[int, int], ...]
    most_bits: int

    @property
    def not_lru(self) -> int:
        """Evictions whose victim was not the block LRU would have chosen on the same cache."""
        return sum(v != lru for v, lru in self.victims)


def zipf_run(policy: str, n_blocks: int = 32, n_docs: int = 400, n_requests: int = 20_000, seed: int = 0,
             hit: str = "reacquire", compare: bool = False) -> ZipfRun:
    """A cache of ``n_blocks`` one-block documents under Zipf(1.3) requests, evicting by ``policy`` (``"opt"``:
    Belady's, told every future request through :class:`~kvlab.FutureUses`). A miss allocates a block (which
    evicts the policy's victim when the cache is full); a hit reads the cached block: ``hit="reacquire"`` takes a
    reference and drops it (``incref`` then ``free``, as a sequence that reuses the block does), ``"touch"`` reads
    it in place without a reference (``pool.touch``, as an attention read does). With ``compare``, every eviction
    is set beside LRU's choice on the same cache (see :class:`ZipfRun`)."""
    if hit not in HITS:
        raise ConfigError(f"hit must be one of {HITS}, got {hit!r}")
    docs = (np.random.default_rng(seed).zipf(1.3, n_requests) % n_docs).tolist()
    where: dict[int, int] = {}
    owner: dict[int, int] = {}  # doc -> its block, block -> its doc
    future = FutureUses([[d] for d in docs])
    chosen = OPTPolicy(lambda b: future.next_use(owner[b])) if policy == "opt" else policy
    cache = BlockPool(n_blocks, spec=KVSpec(block_size=16, device=torch.device("cpu")), eviction_policy=chosen,
                      with_storage=False, seed=seed)
    evicted: list[int] = []

    def forget(blk: int) -> None:  # an evicted document is no longer cached
        evicted.append(blk)
        del where[owner.pop(blk)]
    cache.evict_hooks.append(forget)
    last, victims, most_bits, hits = cache.fields.last_access, [], 0, 0
    for i, d in enumerate(docs):
        future.advance(i)
        if d in where:
            hits += 1
            if hit == "touch":
                cache.touch([where[d]])
            else:
                cache.incref([where[d]])
                cache.free([where[d]])
            continue
        lru_victim = -1
        if compare and not cache.num_free_blocks:  # this miss evicts: what would LRU take from the same cache?
            lru_victim = min((b for b, _ in cache.policy.order()), key=last.__getitem__)
            if isinstance(cache.policy, ClockPolicy):
                most_bits = max(most_bits, cache.policy.referenced())
        (blk,) = cache.allocate(1)
        if lru_victim >= 0:
            victims.append((evicted[-1], lru_victim))
        where[d], owner[blk] = blk, d
        cache.mark_reusable([blk])
        cache.free([blk])
    cache.check_invariants()
    return ZipfRun(hits / n_requests, len(evicted), tuple(victims), most_bits)


def zipf_hit_rate(policy: str, n_blocks: int = 32, n_docs: int = 400, n_requests: int = 20_000,
                  seed: int = 0, hit: str = "reacquire") -> float:
    """The hit rate of :func:`zipf_run` (the chapter's experiment; its exercises use it too)."""
    return zipf_run(policy, n_blocks, n_docs, n_requests, seed, hit).hit_rate


# ---------------------------------------------------------------------------- the cost of one eviction
EVICTION_SIZES = (1_000, 4_000, 16_000, 64_000)
SCAN_GROWS = 16.0   # the verdict: the scan grows at least a quarter as fast as the pool (64x more blocks) ...
EVICT_FLAT = 4.0    # ... and kvlab's eviction grows less than 4x. Measured, 2 busy cores, 12 runs: 62-176x, 1.1-1.3x.


@dataclass(eq=False)
class _ScannedBlock:
    """The part of the text's block its ``evict_block`` scan reads (a dataclass, as the text's ``KVBlock``)."""

    block_id: int
    last_access_time: float


@dataclass(frozen=True)
class EvictionCost:
    """Microseconds per eviction at each pool size: medians over the rounds and each one's (fastest, slowest)."""

    sizes: tuple[int, ...]
    scan_us: tuple[float, ...]
    evict_us: tuple[float, ...]
    scan_range: tuple[tuple[float, float], ...]
    evict_range: tuple[tuple[float, float], ...]

    @property
    def scan_growth(self) -> float:
        return self.scan_us[-1] / self.scan_us[0]

    @property
    def evict_growth(self) -> float:
        return self.evict_us[-1] / self.evict_us[0]

    @property
    def scan_grows_evict_does_not(self) -> bool:
        """The verdict, with a wide margin: the scan grows at least :data:`SCAN_GROWS` times, kvlab's eviction
        less than :data:`EVICT_FLAT` times."""
        return self.scan_growth >= SCAN_GROWS and self.evict_growth < EVICT_FLAT


def eviction_cost(sizes: tuple[int, ...] = EVICTION_SIZES, rounds: int = 7, batch: int = 64) -> EvictionCost:
    """Time one eviction the text's way (``min`` over a dict of block objects by last access, the scan of its
    ``evict_block``) and kvlab's way (``BlockPool.evict``, LRU) on a pool of ``n`` cached blocks, for each ``n``.

    Each measurement stands alone: a warm-up round first, then ``rounds`` rounds in which the two are timed apart
    and in alternating order (neither always runs right after the other's memory traffic). kvlab's eviction takes
    microseconds, too short to time once, so each round times ``batch`` evictions and divides; the evicted blocks
    are cached again outside the timed part, so the pool keeps its size. Garbage collection is off while timing.
    """
    scan_us, evict_us, scan_range, evict_range = [], [], [], []
    for n in sizes:
        pool = BlockPool(n, spec=KVSpec(block_size=16, device=torch.device("cpu")), with_storage=False)
        ids = pool.allocate(n)
        pool.mark_reusable(ids)
        pool.free(ids)
        active = {i: _ScannedBlock(i, float(i)) for i in range(n)}

        def scan() -> float:
            t0 = time.perf_counter()
            min(active.values(), key=lambda b: b.last_access_time)
            return (time.perf_counter() - t0) * 1e6

        def evict() -> float:
            t0 = time.perf_counter()
            for _ in range(batch):
                pool.evict()
            dt = (time.perf_counter() - t0) * 1e6 / batch
            back = pool.allocate(batch)
            pool.mark_reusable(back)
            pool.free(back)
            return dt
        scans, evicts = [], []
        gc.disable()
        try:
            scan(), evict()  # warm-up
            for r in range(rounds):
                first, second = (scan, evict) if r % 2 == 0 else (evict, scan)
                a, b = first(), second()
                scans.append(a if first is scan else b)
                evicts.append(b if first is scan else a)
        finally:
            gc.enable()
        scan_us.append(float(np.median(scans)))
        evict_us.append(float(np.median(evicts)))
        scan_range.append((min(scans), max(scans)))
        evict_range.append((min(evicts), max(evicts)))
    return EvictionCost(tuple(sizes), tuple(scan_us), tuple(evict_us), tuple(scan_range), tuple(evict_range))


register_prediction("2.2.2-best-online",
                    "Zipf 请求、32 块的缓存：除了知道未来的 OPT，哪种策略命中率最高？",
                    choices=("lru", "fifo", "lfu", "clock"))
register_prediction("2.2.2-clock-touch",
                    "本章的 Zipf 实验里命中是“拿引用再放下”（incref 再 free）。把命中改成就地读取缓存块（pool.touch，"
                    "不拿引用），CLOCK 的命中率还和 LRU 一样吗？",
                    choices=("same", "different"))
register_prediction("2.2.2-text-fragmentation",
                    "文本的碎片公式 (total_free − largest_free) / total_free，用在四个一样大的空闲块上，"
                    "得到百分之几？（一个整数）")
# The appendix's two questions about the text's code (kvlab.textbook.as_written), answered by running it.
register_prediction("2.2.2-text-same-block",
                    "手工往文本的池的三个大小列表里各放一个 FREE 块，三个调用者依次用同样的数据调用文本的 "
                    "DynamicAllocator.allocate_optimal_block，拿到什么？",
                    choices=("三个不同的块", "同一个块三次", "三次 None", "抛出异常"))
register_prediction("2.2.2-text-1d",
                    "文本的 KVBlock：一个持有 4,096 字节一维缓冲区的 FREE 块，allocate 一个 1,024 个 float32 的"
                    "一维数组（正好 4,096 字节），结果是什么？",
                    choices=("返回 True", "返回 False", "抛出异常，块仍是 FREE", "抛出异常，块已是 ALLOCATED"))


@register("2.2.2-move-cache",
          "动参数 (move a parameter)：zipf_hit_rate('lru', n_blocks=...)（kvlab.exercises.ch2_2_2 里本章实验的函数，"
          "n_requests=5000, seed=0）。缓存从 32 块加到 64 块，LRU 的命中率提高多少个百分点？答案写成整数（四舍五入）。",
          ("缓存翻倍，能留住的热门文档也翻倍；Zipf 分布里热门文档占了大多数请求。",
           "分别跑 n_blocks=32 和 64，相减再乘 100。",
           "round(100 × (zipf_hit_rate('lru', 64, n_requests=5000) − zipf_hit_rate('lru', 32, n_requests=5000)))。"),
          kind="parameter")
def _judge_move_cache(answer: Any) -> Verdict:
    gain = zipf_hit_rate("lru", 64, n_requests=5000) - zipf_hit_rate("lru", 32, n_requests=5000)
    return same(answer, round(100 * gain), "百分点 (points)")


CACHE_SIZES = (8, 16, 32, 64, 128)


def opt_gap(policy: str = "lru", n_requests: int = 5000) -> dict[int, float]:
    """OPT's hit rate minus ``policy``'s at each of :data:`CACHE_SIZES` blocks."""
    return {n: zipf_hit_rate("opt", n, n_requests=n_requests) - zipf_hit_rate(policy, n, n_requests=n_requests)
            for n in CACHE_SIZES}


@register("2.2.2-interpret-gap",
          f"读曲线 (interpret)：缓存大小取 {list(CACHE_SIZES)} 块（n_requests=5000, seed=0），"
          "OPT 与 LRU 的命中率差距在哪个大小最大？答案写成块数。",
          ("OPT 的优势在于每次淘汰都挑对；缓存越小，淘汰越频繁，每一次挑选的分量越重。",
           "差距 = OPT − LRU；用本章的 zipf_hit_rate 逐个大小算（或 opt_gap()）。",
           "对每个大小 n 算 zipf_hit_rate('opt', n) − zipf_hit_rate('lru', n)，取最大的 n。"),
          kind="interpret")
def _judge_interpret_gap(answer: Any) -> Verdict:
    gaps = opt_gap()
    return same(answer, max(gaps, key=lambda n: (gaps[n], -n)), "差距最大的缓存大小 (size of the largest gap)")


# ---------------------------------------------------------------------------- errata hunting
TEXT_BLOCK = '''\
class Block:                        # capacity is the size of the data held right now
    def __init__(self, data):
        self.data, self.free, self.refs = data, True, 0
    def capacity(self):
        return 0 if self.data is None else len(self.data)
    def allocate(self, data):
        if not self.free or len(data) > self.capacity():
            return False
        self.data, self.free, self.refs = data, False, 1
        return True
    def release(self):
        if self.free or self.refs > 0:
            return False
        self.data, self.free = None, True
        return True
'''


def text_block_story() -> tuple[int, int, str]:
    """Run :data:`TEXT_BLOCK`: a 4096-byte block takes 1024 bytes, is released, then is asked for 16 bytes."""
    ns: dict[str, Any] = {}
    exec(TEXT_BLOCK, ns)  # the snippet the prompt shows is the one that is run
    b = ns["Block"](bytes(4096))
    b.allocate(bytes(1024))
    after_allocate = b.capacity()
    b.refs -= 1
    b.release()
    return after_allocate, b.capacity(), "ok" if b.allocate(bytes(16)) else "refused"


@register("2.2.2-errata-capacity",
          "找错 (find the bug)：下面几行和文本的 KVBlock 一样，把容量算成“当前数据的大小”。\n" + TEXT_BLOCK +
          "b = Block(bytes(4096)); b.allocate(bytes(1024)); b.refs -= 1; b.release(); b.allocate(bytes(16))。"
          "答案写成 (第一次 allocate 后的 capacity(), release 后的 capacity(), 'ok' 或 'refused')。",
          ("容量跟着数据走：数据变了，容量也变了。",
           "逐行跟踪 self.data：allocate 换成了新数据，release 把它设成 None。",
           "在纸上写下每一行之后 self.data 是什么；capacity() 返回它的长度，data 为 None 时返回什么？第二次 allocate "
           "拿 16 和当时的 capacity() 比。"),
          kind="errata")
def _judge_errata_capacity(answer: Any) -> Verdict:
    return same(answer, text_block_story(), "(capacity, capacity, second allocate)",
                ("allocate 后 (after allocate)", "release 后 (after release)", "第二次 allocate (second allocate)"),
                two_way=("第二次 allocate (second allocate)",))


TEXT_FRAGMENTATION = '''\
def fragmentation(free_sizes):      # the text's formula over the sizes of the FREE blocks
    total, largest = sum(free_sizes), max(free_sizes)
    return int((total - largest) / total * 100) if total else 0
'''


def text_fragmentation_story() -> tuple[int, int]:
    """:data:`TEXT_FRAGMENTATION` on four equal free blocks, and kvlab's measure on a uniform pool like it."""
    ns: dict[str, Any] = {}
    exec(TEXT_FRAGMENTATION, ns)
    pool = metadata_pool(8, 16)
    held = pool.allocate(8)
    pool.free(held[::2])  # four FREE blocks, every other one
    return ns["fragmentation"]([4096] * 4), TextbookPool(pool).calculate_fragmentation()


@register("2.2.2-errata-fragmentation",
          "找错 (find the bug)：\n" + TEXT_FRAGMENTATION +
          "四个一样大的空闲块 fragmentation([4096] * 4) 返回多少？一个 8 块、每隔一块空闲的一级池 "
          "(block_sizes 只有一种) 的 TextbookPool(pool).calculate_fragmentation() 又是多少？"
          "答案写成 (文本公式, kvlab)。",
          ("在一个所有块一样大的池里，任何一个空闲块都能满足任何请求。",
           "文本公式只看“最大的空闲块占全部空闲的多少”；kvlab 问的是空闲内存里有多少拼不成一个最大的块。",
           "文本公式：把四个 4096 字节的空闲块代入 (总空闲 − 最大空闲) / 总空闲。kvlab 问的是另一件事："
           "只有一种块大小的池里，有没有空闲块会小到用不上？"),
          kind="errata")
def _judge_errata_fragmentation(answer: Any) -> Verdict:
    return same(answer, text_fragmentation_story(), "(text formula, kvlab)", ("文本公式 (text)", "kvlab"))
