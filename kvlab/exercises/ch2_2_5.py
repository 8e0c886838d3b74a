"""Exercises of §2.2.5 (performance): how often the pool takes its lock, why identical work reads ~1x, and what a
pre-allocation reserve costs the other tenants; the chapter's predictions."""
from __future__ import annotations

from typing import Any

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
