"""Exercises of §2.2.2 (block management): the state machine, LRU order, reference counts."""
from __future__ import annotations

from typing import Any

from ..block import BlockStatus
from ..errors import ConfigError, KVLabError
from . import Canon, Unreadable, Verdict, canon, metadata_pool, register, same


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
           "FREE→PENDING, FREE→ALLOCATED, PENDING→ALLOCATED, PENDING→FREE, ALLOCATED→FREE, "
           "ALLOCATED→EVICTING, EVICTING→FREE 之外还有没有？用 BlockStatus.check(-1, old, new) 逐对试。"))
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
        parts.append("多了 (not legal): " + ", ".join(f"{o.name}->{n.name}" for o, n in sorted(extra)))
    if missing:
        parts.append(f"少了 {len(missing)} 条 (missing {len(missing)})")
    return False, "; ".join(parts)


def lru_scenario() -> list[int]:
    """Four reusable blocks, released in the order 2, 0, 3, 1; block 0 is then reused and released again."""
    pool = metadata_pool(4, 16, eviction_policy="lru")
    blocks = pool.allocate(4)
    pool.mark_reusable(blocks)
    for b in (2, 0, 3, 1):
        pool.free([b])
    pool.incref([0])
    pool.free([0])
    order = []
    for _ in range(4):
        victim = pool.evict_block()
        if victim is None:
            raise ConfigError("2.2.2-lru scenario: the pool found nothing to evict")  # a scenario bug, not an answer
        order.append(victim.block_id)
    return order


@register("2.2.2-lru",
          "一个 4 块的池（eviction_policy='lru'）：allocate(4) 得到块 0,1,2,3，全部 mark_reusable；"
          "按 2, 0, 3, 1 的顺序 free（它们变成 cached）；然后 incref([0]) 再 free([0])。"
          "接下来连续调用 4 次 evict_block()，依次淘汰哪些块？答案写成列表。",
          ("LRU 淘汰的是最久没有被用过的块，不是最先分配的块。",
           "按时间写下每个块最后一次被访问的时刻（free 和 incref 都算访问），从最早的开始淘汰。",
           "最后访问顺序是 2, 3, 1, 0（块 0 在最后被 incref/free 过），淘汰顺序就是这个顺序。"))
def _judge_lru(answer: Any) -> Verdict:
    return same(answer, lru_scenario(), "淘汰顺序 (order)", [f"第 {i + 1} 个淘汰 (victim {i + 1})" for i in range(4)])


def refcount_scenario() -> tuple[int, str]:
    """A block allocated, incref'd twice through one list, decref'd once and freed once: (refcount, status)."""
    pool = metadata_pool(4, 16)
    (b,) = pool.allocate(1)
    pool.incref([b, b])
    pool.decref([b])
    pool.free([b])
    return pool.block(b).reference_count, pool.block(b).status.name


@register("2.2.2-refcount",
          "在一个新池上：(b,) = pool.allocate(1)；pool.incref([b, b])；pool.decref([b])；pool.free([b])。"
          "此时块 b 的 reference_count 和 status.name 是什么？答案写成 (refcount, 'STATUS')。",
          ("free 不是“立刻回收”，它只是放下一个引用。",
           "从 allocate 的计数开始，逐步加减：列表里重复的 id 各算一次。",
           "1 (allocate) + 2 (incref [b, b]) − 1 (decref) − 1 (free)；计数不为 0 时块仍是 ALLOCATED。"))
def _judge_refcount(answer: Any) -> Verdict:
    return same(answer, refcount_scenario(), "(refcount, status)", ("reference_count", "status"))
