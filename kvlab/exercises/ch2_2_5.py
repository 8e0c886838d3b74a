"""Exercises of §2.2.5 (performance): how often the pool takes its lock, why identical work reads ~1x, and what a
pre-allocation reserve costs the other tenants; the chapter's predictions and the chapter's measurements
(pre-allocation and batching, each changed alone)."""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlab.core.pool import BlockPool
from kvlab.core.spec import KVSpec
from kvlab.fast.pool import FastBlockPool
from kvlab.memory.allocator import DynamicAllocator
from kvlab.memory.preallocation import Preallocator
from kvlab.exercises.framework import Unreadable, Verdict, canon, metadata_pool, register, register_prediction, same

register_prediction("2.2.5-splits", "有预分配时，高峰之内还会发生几次块切分？"
                    "(with pre-allocation, how many splits happen "
                    "inside the bursts?)", rel_tol=0.0)
register_prediction("2.2.5-gain-n1", "n=1 时，“逐个”与“批量”每块耗时之比大约是多少？(at n=1, one-by-one / batched "
                    "time per block is about?)", rel_tol=0.25)


def lock_scenario(n: int = 100) -> tuple[int, int]:
    """Lock acquisitions for ``n`` one-block allocations and frees, and for one batched allocate and free."""
    one = metadata_pool(n, 16)
    for _ in range(n):
        one.allocate(1)
    for b in range(n):
        one.free([b])
    batch = metadata_pool(n, 16)
    batch.free(batch.allocate(n))
    return one.lock_acquisitions, batch.lock_acquisitions


@register("2.2.5-locks",
          "把 100 个块一个一个 allocate(1) 再一个一个 free([b])，与 allocate(100) 后一次 free(全部) 相比，"
          "BlockPool.lock_acquisitions 各是多少？答案写成 (逐个, 批量)。",
          ("锁是按调用拿的，还是按块拿的？",
           "数一数两种做法各调用了几次公开的修改操作。",
           "每次公开的修改调用拿一次锁：逐个分配 100 块要调用 allocate 几次、free 几次？批量时各几次？"))
def _judge_locks(answer: Any) -> Verdict:
    return same(answer, lock_scenario(), "(one by one, batched)", ("逐个 (one by one)", "批量 (batched)"))


REASONS = ("both columns make the same calls", "batching is slower for one block", "the first column pays the warm-up")


def n1_reason() -> str:
    """Why the n=1 row reads ~1x: with one block both ways make one allocate and one free call (same locks)."""
    one, batched = lock_scenario(1)
    return REASONS[0] if one == batched else REASONS[1]


@register("2.2.5-gain",
          "本章的表里，n=1 那一行“逐个 / 批量”约为 1x（旧版本曾显示 3–4 倍）。"
          f"为什么应当是 1x？从 {list(REASONS)} 中选一个。",
          ("n=1 时，“逐个”和“批量”各调用了哪些方法？",
           "数 n=1 时两种做法的公开调用次数和锁获取次数（lock_acquisitions）。",
           "把两列在 n=1 时调用的方法逐个写出来对比；再想：哪一列先测？第一次调用要付哪些只付一次的代价？"),
          kind="interpret")
def _judge_gain(answer: Any) -> Verdict:
    c = canon(answer)
    if c not in REASONS:
        raise Unreadable(f"请从 {list(REASONS)} 中选一个 (choose one of them), 而不是 {c!r}")
    truth = n1_reason()
    if c == truth:
        return True, f"n=1 时两边的锁获取次数都是 {lock_scenario(1)[0]}：同样的调用 (the same calls)"
    if c == REASONS[2]:
        return False, "热身解释了旧表为什么错，但不是“为什么应当是 1x”"
    return False, f"不是 {c!r}"


def reserve_scenario(headroom: float = 0.5) -> tuple[int, int]:
    """Tenant 1 allocates 48 of 64 blocks in one burst and frees them; after ``replenish`` with ``headroom``:
    (blocks reserved for tenant 1, blocks free for everyone else)."""
    pool = metadata_pool(64, 16)
    pre = Preallocator(pool, allocator=DynamicAllocator(pool), window=8, horizon=64, headroom=headroom)
    pool.free(pre.allocate(48, owner=1))
    pre.replenish()
    return pre.reserved, pool.num_free_blocks


@register("2.2.5-headroom",
          "改一个参数 (move a parameter)：本章“预留的代价”那个例子（64 块，租户 1 一次用了 48 块），把 Preallocator 的 "
          "headroom 从 1.0 改成 0.5。replenish 之后给租户 1 预留了几个块？别的租户还剩几个空闲块？"
          "答案写成 (reserved, free)。",
          ("headroom 乘在什么上？",
           "预测 = 最近 horizon 步里任意 window 步内的最大需求 × headroom（向上取整）；预留只用空闲内存。",
           "reserved = ceil(基数 × headroom)：基数是谁的块数？free = 池的块数 − reserved。"), kind="parameter")
def _judge_headroom(answer: Any) -> Verdict:
    return same(answer, reserve_scenario(0.5), "(reserved, free)", ("reserved", "free"))


# ---------------------------------------------------------------------------------------------- the chapter's runs
# Chapter 2.2.5 measures pre-allocation and batching with the functions below, so that its cells hold the reading
# and the tests (tests/test_claims.py) check the same counts the chapter prints.

#: the four ways of serving a burst, as (pre-allocation, batched): neighbours in the chapter's table differ in one
VARIANTS = ((False, False), (False, True), (True, False), (True, True))
VARIANT_NAMES = {(False, False): "逐个，无预分配 (one by one)", (False, True): "批量，无预分配 (batched)",
                 (True, False): "逐个，有预分配 (one by one, pre-allocated)",
                 (True, True): "批量，有预分配 (batched, pre-allocated)"}


@dataclass(frozen=True)
class BurstRow:
    """One way of serving the bursts. ``splits`` and ``locks`` (inside the bursts) and ``reserve`` (the most
    blocks held in reserve while idle) are counts, the same in every round; ``us`` is the time per block in a
    burst, measured: median, min and max over the rounds of each round's median over its bursts (the first burst
    of a round warms the code up and is left out)."""
    prealloc: bool
    batched: bool
    splits: int
    locks: int
    reserve: int
    us: tuple[float, float, float]

    @property
    def name(self) -> str:
        return VARIANT_NAMES[self.prealloc, self.batched]


def serve_bursts(prealloc: bool, batched: bool, *, num_blocks: int, bursts: int, burst: int,
                 window: int | None = None) -> tuple[int, int, int, list[float]]:
    """Owner 1 takes ``burst`` 16-token blocks ``bursts`` times from a fresh pool of 16..128-token classes and
    frees them; between bursts (idle time) the free buddies merge back into large blocks and, with
    ``prealloc``, a :class:`Preallocator` reserves what the history predicts. ``batched`` takes a burst in one
    call, else one call per block. Returns (splits inside the bursts, lock acquisitions inside the bursts, most
    blocks in reserve, seconds of each burst).

    ``window`` (clock steps, one per public call) defaults to the steps one burst spans plus one, so that a window
    holds one burst whichever way it is taken: the prediction is then one burst's blocks."""
    pool = metadata_pool(num_blocks, 16, block_sizes=[16, 32, 64, 128])
    span = 1 if batched else burst
    pre = Preallocator(pool, window=window or span + 1, horizon=100 * burst) if prealloc else None
    take = pool.allocate if pre is None else pre.allocate
    splits = locks = reserve = 0
    seconds = []
    for _ in range(bursts):
        if pre is not None:
            pre.replenish()                          # idle time: reserve what the history predicts
            reserve = max(reserve, pre.reserved)
        s0, l0 = pool.stats()["splits"], pool.lock_acquisitions
        t0 = time.perf_counter()
        got = take(burst, owner=1) if batched else [b for _ in range(burst) for b in take(1, owner=1)]
        seconds.append(time.perf_counter() - t0)
        splits += pool.stats()["splits"] - s0
        locks += pool.lock_acquisitions - l0
        pool.free(got)
        pool.merge_free_buddies()                    # idle time: free space becomes large blocks again
        pool.check_invariants()
    return splits, locks, reserve, seconds


def burst_experiment(num_blocks: int, bursts: int, burst: int, rounds: int) -> dict[tuple[bool, bool], BurstRow]:
    """:func:`serve_bursts` for each of :data:`VARIANTS`, ``rounds`` times, the variants taking turns within a
    round (a disturbance of the machine hits all four alike). Keyed by (pre-allocation, batched)."""
    counts: dict[tuple[bool, bool], tuple[int, int, int]] = {}
    per_round: dict[tuple[bool, bool], list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v in VARIANTS:
            splits, locks, reserve, seconds = serve_bursts(*v, num_blocks=num_blocks, bursts=bursts, burst=burst)
            assert counts.setdefault(v, (splits, locks, reserve)) == (splits, locks, reserve), "counts are exact"
            per_round[v].append(1e6 * float(np.median(seconds[1:] or seconds)) / burst)
    return {v: BurstRow(*v, *counts[v], (float(np.median(t)), min(t), max(t))) for v, t in per_round.items()}


def burst_table(rows: dict[tuple[bool, bool], BurstRow]) -> str:
    """The rows of :func:`burst_experiment` as text, one line per way, the name last (it is the wide column)."""
    lines = ["列 (columns)：高峰内的切分次数 (splits)、高峰内的锁获取次数 (locks)、每块微秒数 (us per block: 各轮中位数"
             "的中位数 [最小-最大])、空闲时最多预留的块 (reserve)、做法 (way)"]
    for r in rows.values():
        lines.append(f"{r.splits:6d} {r.locks:6d}   {r.us[0]:6.2f} [{r.us[1]:5.2f}-{r.us[2]:6.2f}] {r.reserve:6d}   "
                     f"{r.name}")
    return "\n".join(lines)


@dataclass(frozen=True)
class BatchTiming:
    """Allocating and freeing ``n`` blocks one by one (``n`` calls of one block) and batched (one call of ``n``) on
    a pool of class ``pool``: lock acquisitions of each (counts) and ns per block (measured: median, min, max over
    the rounds), with the per-round ratio one by one / batched (``gain``)."""
    pool: str
    n: int
    locks_one: int
    locks_batched: int
    one_ns: tuple[float, float, float]
    batched_ns: tuple[float, float, float]
    gain: tuple[float, float, float]


def _spread(x: np.ndarray) -> tuple[float, float, float]:
    return float(np.median(x)), float(x.min()), float(x.max())


def batch_timings(ns: Sequence[int], *, rounds: int, budget: int) -> list[BatchTiming]:
    """:class:`BatchTiming` for every ``n`` in ``ns`` on :class:`BlockPool` and :class:`FastBlockPool` (in that
    order). Each variant is warmed up once; the two take turns in every round; a round repeats each variant
    ``max(1, budget // n)`` times. At ``n = 1`` both variants run the very same calls: their ratio checks the
    timing method itself."""
    out = []
    for cls in (BlockPool, FastBlockPool):
        for n in ns:
            pool = cls(n, spec=KVSpec(block_size=16, device=torch.device("cpu")), with_storage=False)

            def one_by_one(pool: BlockPool = pool, n: int = n) -> None:
                for _ in range(n):
                    pool.free(pool.allocate(1))

            def batched(pool: BlockPool = pool, n: int = n) -> None:
                for _ in range(1):                   # the same loop as above: at n=1 the very same code
                    pool.free(pool.allocate(n))

            locks: list[int] = []
            for fn in (one_by_one, batched):         # one call each: the warm-up, and the lock count
                before = pool.lock_acquisitions
                fn()
                locks.append(pool.lock_acquisitions - before)
            reps = max(1, budget // n)
            a: list[float] = []
            b: list[float] = []
            for _ in range(rounds):
                for fn, got in ((one_by_one, a), (batched, b)):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    got.append(1e9 * (time.perf_counter() - t0) / (reps * n))
            pool.check_invariants()
            x, y = np.array(a), np.array(b)
            out.append(BatchTiming(cls.__name__, n, locks[0], locks[1], _spread(x), _spread(y), _spread(x / y)))
    return out


def batch_table(rows: Sequence[BatchTiming]) -> str:
    """The rows of :func:`batch_timings` as text."""
    lines = ["列 (columns)：池 (pool)、每次操作的块数 n、锁获取次数 逐个 / 批量 (locks one by one / batched)、"
             "每块纳秒 逐个 (ns per block one by one)、每块纳秒 批量 (batched)、"
             "逐个 / 批量 (gain, 各轮之比的中位数 [范围])"]
    for r in rows:
        lines.append(f"{r.pool:>13s} {r.n:5d} | {r.locks_one:5d} / {r.locks_batched:<3d} | {r.one_ns[0]:7.0f} "
                     f"[{r.one_ns[1]:5.0f}-{r.one_ns[2]:6.0f}] | {r.batched_ns[0]:6.0f} [{r.batched_ns[1]:5.0f}-"
                     f"{r.batched_ns[2]:6.0f}] | {r.gain[0]:5.2f}x [{r.gain[1]:.2f}-{r.gain[2]:.2f}]")
    return "\n".join(lines)


def contended(batch: bool, threads: int = 4, rounds: int = 500, n: int = 16) -> tuple[int, float]:
    """``threads`` threads each allocate and free ``n`` blocks ``rounds`` times on one :class:`BlockPool`,
    batched (one call each way) or one block per call: (lock acquisitions, seconds). The count is exact; the
    seconds depend on the GIL and on the machine's load."""
    pool = metadata_pool(threads * n, 16)

    def work() -> None:
        for _ in range(rounds):
            if batch:
                pool.free(pool.allocate(n))
            else:
                ids = [pool.allocate(1)[0] for _ in range(n)]
                for b in ids:
                    pool.free([b])

    workers = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    pool.check_invariants()
    return pool.lock_acquisitions, time.perf_counter() - t0


def batch_memory(n: int = 100) -> tuple[list[int], list[int]]:
    """The blocks ``n`` one-block allocations take, and the blocks one allocation of ``n`` takes, each from a
    fresh pool of ``n`` blocks: what batching changes about memory (the text says it "optimises memory use")."""
    one, batch = metadata_pool(n, 16), metadata_pool(n, 16)
    taken = [b for _ in range(n) for b in one.allocate(1)]
    return sorted(taken), sorted(batch.allocate(n))
