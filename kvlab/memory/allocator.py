"""DynamicAllocator: how a request for one block is served (text §2.2.3, "动态分配策略").

Strategies, tried in this order until one leaves a FREE block of the requested size class on the free list:

1. ``exact``  — a FREE block of that class exists;
2. ``split``  — split the smallest larger FREE block in halves down to the class (the buddy system's split);
3. ``merge``  — FREE buddies merged back together make a block big enough (the text's ``_merge_adjacent_blocks``);
4. ``evict``  — evict cached blocks (refcount 0, reusable data) so that an aligned window of the class becomes
   FREE. Evicting whatever the policy ranks first may not help a large request: the freed blocks can be scattered
   between referenced ones. So the allocator plans first: among windows made only of FREE and evictable blocks it
   takes the one that discards the least cached data, then the fewest blocks, then the coldest (by the pool's
   policy rank of its hottest victim); it evicts exactly those, merges, and re-checks. On a uniform pool every
   window is one block and this is simply the policy's first victim.
5. ``wait``   — nothing can make room now: the request joins a FIFO wait queue and gets a :class:`Ticket`.

The wait queue is strict FIFO: a frees serves the oldest waiter first and a waiter is never overtaken, even by a
smaller request that would fit (so a large request cannot starve). Waiters time out on the pool's clock (logical
steps by default) or are cancelled. New requests queue behind existing waiters for the same reason.

Invariants: every served request took its block through the pool (refcount 1, ALLOCATED); a ticket is served at
most once and ends in exactly one of SERVED, TIMED_OUT or CANCELLED; every allocation is recorded with the
strategy that served it (``stats``, ``allocation_history`` and an :class:`AllocationServed` event).

What the text's version got wrong: strategy 2 asked the pool for the same ``get_best_block`` as strategy 1 (the
pool's best block already is the smallest that fits), ``split_block`` returned ``[]``, the merge was a stub, an
eviction freed whichever block the policy liked whether or not it made room of the needed size, and the "wait
queue" only retried the split once and returned None.
"""
from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch

from kvlab.core import events as ev
from kvlab.core.block import FREE, BlockStatus
from kvlab.core.checks import check_flag, check_kv_data, check_owner, check_real, is_int
from kvlab.core.errors import ConfigError, IllegalTransitionError, KVDataError, OutOfBlocksError
from kvlab.core.pool import BlockPool
from kvlab.core.spec import KVSpec
from kvlab.core.interrupts import atomic
from kvlab.textbook.pool import KVBlock

STRATEGIES = ("exact", "split", "merge", "evict")


class TicketState(Enum):
    WAITING = "WAITING"
    SERVED = "SERVED"
    TIMED_OUT = "TIMED_OUT"
    CANCELLED = "CANCELLED"


@dataclass(eq=False, slots=True)
class Ticket:
    """A request for one block of ``size_class``. ``block`` and ``strategy`` are set once it is SERVED."""

    id: int
    size_class: int
    owner: int
    submitted: float
    deadline: float | None
    kv_data: torch.Tensor | None = field(default=None, repr=False)
    state: TicketState = TicketState.WAITING
    block: KVBlock | None = None
    strategy: str | None = None
    served_at: float | None = None

    @property
    def served(self) -> bool:
        return self.state is TicketState.SERVED


@dataclass(frozen=True, slots=True)
class AllocationRecord:
    """One served allocation, as kept in ``DynamicAllocator.allocation_history`` (learned from by pre-allocation)."""

    step: float
    size_class: int
    owner: int
    strategy: str
    waited: float


@dataclass(slots=True)
class AllocationServed(ev.Event):
    """Request ``ticket`` got ``block_id`` through ``strategy`` ("exact", "split", "merge", "evict") after
    waiting ``waited`` clock steps in the queue (0 when served at once)."""
    ticket: int
    block_id: int
    size_class: int
    owner: int
    strategy: str
    waited: float


@dataclass(slots=True)
class AllocationQueued(ev.Event):
    """Request ``ticket`` could not be served and waits at ``position`` (0 = head) of the FIFO queue."""
    ticket: int
    size_class: int
    owner: int
    position: int


@dataclass(slots=True)
class AllocationAbandoned(ev.Event):
    """Waiting request ``ticket`` left the queue unserved; ``reason`` is "timeout" or "cancelled"."""
    ticket: int
    reason: str


@atomic()
class DynamicAllocator:
    """Serves one-block requests on ``pool`` by exact fit, split, merge, planned eviction, or the wait queue.

    Frees made through :meth:`deallocate_block` serve waiters at once; code that frees through the pool directly
    calls :meth:`handle_wait_queue` afterwards (an engine does so once per step).
    """

    def __init__(self, pool: BlockPool, *, history: int | None = 10_000) -> None:
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"a DynamicAllocator needs a BlockPool, got {pool!r}")
        if history is not None and not (is_int(history) and 0 <= history <= sys.maxsize):  # a deque's maxlen
            raise ConfigError(f"history must be an int in 0..{sys.maxsize} (records kept) or None (all), got "
                              f"{history!r}")
        history = None if history is None else int(history)
        self.pool = pool
        self.waiters: deque[Ticket] = deque()
        self.allocation_history: deque[AllocationRecord] = deque(maxlen=history)
        self.stats = dict.fromkeys((*STRATEGIES, "queued", "served_from_queue", "timed_out", "cancelled"), 0)
        self._next_ticket = 0

    # ------------------------------------------------------------------ requests
    def size_class_for(self, tokens: int) -> int:
        """The smallest size class holding ``tokens`` tokens."""
        if not is_int(tokens) or tokens < 0:
            raise ConfigError(f"tokens must be an int >= 0, got {tokens!r}")
        for o, size in enumerate(self.pool.block_sizes):
            if size >= tokens:
                return o
        raise KVDataError(f"{tokens} tokens exceed the largest block ({self.pool.block_sizes[-1]} tokens)")

    def allocate_optimal_block(self, kv_data: torch.Tensor | None = None, *, tokens: int | None = None,
                               size_class: int | None = None, owner: int = -1, timeout: float | None = None,
                               wait: bool = True) -> Ticket:
        """Request one block sized for ``kv_data`` ``[2, layers, t, heads, dim]`` (written into its first ``t``
        slots), for ``tokens`` tokens, or of ``size_class`` (default 0). Returns a :class:`Ticket`: SERVED with
        its ``block`` when a strategy found room, else WAITING in the queue (``timeout`` in clock steps). Waiters
        the queue can serve now go first (their tickets turn SERVED, each with an :class:`AllocationServed`
        event): a new request never overtakes them. With ``wait=False`` an unservable request raises
        :class:`OutOfBlocksError` instead of queueing; waiters served before it stay served."""
        pool = self.pool
        with pool.lock:
            order = self._order_of(kv_data, tokens, size_class)
            owner = check_owner(owner)
            check_flag(wait, "wait")
            if timeout is not None:  # None: wait for ever
                check_real(timeout, "timeout", lo=0, finite=False, unit=" of clock steps")
            if pool.num_blocks < 1 << order:
                raise OutOfBlocksError(f"size class {order} ({pool.block_sizes[order]} tokens) needs {1 << order} "
                                       f"base blocks; the pool has only {pool.num_blocks}")
            now = pool.clock.now()
            ticket = Ticket(self._next_ticket, order, owner, now, None if timeout is None else now + timeout,
                            kv_data)
            self.handle_wait_queue()  # older waiters first: a new request never overtakes them
            if not self.waiters and (how := self.make_room(order)) is not None:
                self._next_ticket += 1
                self._serve(ticket, how)
                return ticket
            if not wait:
                raise OutOfBlocksError(f"no block of size class {order} ({pool.block_sizes[order]} tokens) can be "
                                       f"freed, merged or evicted now, and {len(self.waiters)} requests wait")
            self._next_ticket += 1
            self.waiters.append(ticket)
            self.stats["queued"] += 1
            if pool.events:
                pool.events.publish(AllocationQueued(now, ticket.id, order, owner, len(self.waiters) - 1))
            return ticket

    def _order_of(self, kv_data: torch.Tensor | None, tokens: int | None, size_class: int | None) -> int:
        if (kv_data is not None) + (tokens is not None) + (size_class is not None) > 1:
            raise ConfigError("give at most one of kv_data, tokens or size_class")
        if kv_data is not None:
            check_kv_data(self.pool.spec, self.pool.storage_of().kv.device, kv_data, self.pool.block_sizes[-1])
            return self.size_class_for(kv_data.shape[2])
        if tokens is not None:
            return self.size_class_for(tokens)
        return 0 if size_class is None else self.pool.check_class(size_class)

    def _serve(self, ticket: Ticket, how: str) -> None:
        """Take the FREE block ``make_room`` left on the free list, write the request's data, record it."""
        pool = self.pool
        b = pool.allocate(1, size_class=ticket.size_class, owner=ticket.owner)[0]
        if ticket.kv_data is not None:
            t = ticket.kv_data.shape[2]
            KVBlock(pool, b).kv_data[:, :, :t].copy_(ticket.kv_data)
            pool.set_token_count(b, t)
        now = pool.clock.now()
        ticket.state, ticket.block, ticket.strategy, ticket.served_at = TicketState.SERVED, KVBlock(pool, b), how, now
        ticket.kv_data = None  # written: the ticket no longer pins the caller's tensor
        self.stats[how] += 1
        self.allocation_history.append(AllocationRecord(now, ticket.size_class, ticket.owner, how,
                                                        now - ticket.submitted))
        if pool.events:
            pool.events.publish(AllocationServed(now, ticket.id, b, ticket.size_class, ticket.owner, how,
                                                 now - ticket.submitted))

    # ------------------------------------------------------------------ strategies
    def make_room(self, size_class: int) -> str | None:
        """Leave a FREE block of ``size_class`` on the pool's free list without taking it; return the strategy
        that did it ("exact", "split", "merge", "evict"), or None (and change nothing) if none can."""
        pool = self.pool
        size_class = pool.check_class(size_class)
        with pool.lock:
            if pool.free_lists.count(size_class):
                return "exact"
            if self._split_down(size_class):
                return "split"
            if self._fits_after_merge(size_class):
                pool.merge_free_buddies()
                if not pool.free_lists.count(size_class):
                    self._split_down(size_class)
                return "merge"
            if not pool.max_order:  # uniform pool: any victim frees a whole block, so the policy's first will do
                return "evict" if pool.evict("allocation pressure") is not None else None
            victims = self._plan_eviction(size_class)
            if victims is None:
                return None
            self._evict_exactly(victims)
            pool.merge_free_buddies()
            if not pool.free_lists.count(size_class):
                self._split_down(size_class)
            return "evict"

    def _split_down(self, size_class: int) -> bool:
        """Split the smallest FREE block larger than ``size_class`` down to it (best fit); False if none."""
        pool = self.pool
        for o in range(size_class + 1, pool.max_order + 1):
            b = pool.free_lists.top(o)
            if b is not None:
                self.split_block(b, size_class)
                return True
        return False

    def split_block(self, block_id: int, size_class: int) -> list[int]:
        """Split FREE ``block_id`` in halves until its first part has ``size_class``; returns the FREE blocks
        made, ``[block_id, buddies from the smallest up]``. The block is taken from the low end, so the buddies
        stay together and can merge back."""
        pool = self.pool
        with pool.lock:
            b = pool.check_id(block_id)
            k = pool.fields.size_class[b]
            if pool.fields.status[b] != FREE or not is_int(size_class) or not 0 <= size_class < k:
                raise IllegalTransitionError(
                    f"block {b} is {BlockStatus(pool.fields.status[b]).name} of size class {k}: only a FREE "
                    f"block larger than class {size_class!r} can be split down to it")
            buddies = [pool.split_block(b)[1] for _ in range(pool.fields.size_class[b] - size_class)]
            return [b, *buddies[::-1]]

    def _windows(self, size_class: int) -> tuple[int, np.ndarray]:
        k = 1 << size_class
        return k, np.arange(self.pool.num_blocks // k * k)

    def _fits_after_merge(self, size_class: int) -> bool:
        """True if some aligned window of the class is all FREE: merging buddies then yields such a block."""
        k, units = self._windows(size_class)
        return bool((self.pool.arrays.status[units] == FREE).reshape(-1, k).all(axis=1).any())

    def _plan_eviction(self, size_class: int) -> list[int] | None:
        """The cached blocks to evict so that an aligned window of ``size_class`` becomes FREE (see the module
        docstring for the choice of window), in policy order; None if no window can be cleared."""
        pool = self.pool
        guard = pool.evict_guard
        rank = np.full(pool.num_blocks, -1, np.int64)  # policy position of each evictable block, -1: not evictable
        for i, (b, _) in enumerate(pool.policy.order()):
            if guard is None or guard(b):
                rank[b] = i
        k, units = self._windows(size_class)
        if not units.size or not (rank >= 0).any():
            return None
        span = np.left_shift(1, pool.arrays.size_class[units].astype(np.int64))
        heads = units & ~(span - 1)  # the block each base block belongs to
        victim_rank = rank[heads]
        clear = (pool.arrays.status[units] == FREE) | (victim_rank >= 0)
        ok = clear.reshape(-1, k).all(axis=1)
        if not ok.any():
            return None
        # A victim is counted once per window: at its head, or at the window start if it began before it.
        starts = (victim_rank >= 0) & ((units == heads) | (units % k == 0))
        lost = np.where(starts, span, 0).reshape(-1, k).sum(axis=1)
        count = starts.reshape(-1, k).sum(axis=1)
        hottest = np.where(starts, victim_rank, -1).reshape(-1, k).max(axis=1)
        cand = np.flatnonzero(ok)
        w = int(cand[np.lexsort((hottest[cand], count[cand], lost[cand]))[0]])
        sel = starts[w * k:(w + 1) * k]
        victims = heads[w * k:(w + 1) * k][sel]
        return victims[np.argsort(victim_rank[w * k:(w + 1) * k][sel])].tolist()

    def _evict_exactly(self, victims: list[int]) -> None:
        """Evict exactly ``victims`` through the pool (hooks, events and counters as for any eviction): the pool's
        guard is narrowed to them for the duration, so its policy walk stops at each of them in turn."""
        pool = self.pool
        guard, chosen = pool.evict_guard, set(victims)
        pool.evict_guard = chosen.__contains__  # the real guard approved every victim while planning
        try:
            for _ in victims:
                pool.evict("allocation pressure")
        finally:
            pool.evict_guard = guard

    # ------------------------------------------------------------------ wait queue and release
    def handle_wait_queue(self) -> list[Ticket]:
        """Expire waiters past their deadline, then serve waiters from the head of the queue while room can be
        made for them. Returns the tickets served by this call."""
        pool = self.pool
        with pool.lock:
            now = pool.clock.now()
            for t in [t for t in self.waiters if t.deadline is not None and now > t.deadline]:
                self._abandon(t, TicketState.TIMED_OUT)
            served = []
            while self.waiters and (how := self.make_room(self.waiters[0].size_class)) is not None:
                t = self.waiters.popleft()
                self._serve(t, how)
                self.stats["served_from_queue"] += 1
                served.append(t)
            return served

    def cancel(self, ticket: Ticket) -> list[Ticket]:
        """Withdraw a WAITING request; the waiters it held back may then be served (returned)."""
        with self.pool.lock:
            if not isinstance(ticket, Ticket):
                raise IllegalTransitionError(f"expected a Ticket of this allocator, got {ticket!r}")
            if ticket.state is not TicketState.WAITING or ticket not in self.waiters:
                raise IllegalTransitionError(f"ticket {ticket.id} is {ticket.state.name}: only a WAITING ticket of "
                                             f"this allocator can be cancelled")
            self._abandon(ticket, TicketState.CANCELLED)
            return self.handle_wait_queue()

    def _abandon(self, ticket: Ticket, state: TicketState) -> None:
        self.waiters.remove(ticket)
        ticket.state, ticket.kv_data = state, None
        self.stats["timed_out" if state is TicketState.TIMED_OUT else "cancelled"] += 1
        if self.pool.events:
            reason = "timeout" if state is TicketState.TIMED_OUT else "cancelled"
            self.pool.events.publish(AllocationAbandoned(self.pool.clock.now(), ticket.id, reason))

    def deallocate_block(self, block_id: int) -> list[Ticket]:
        """Drop one reference to ``block_id`` (the pool frees or caches it), then serve waiters; returns them."""
        with self.pool.lock:
            self.pool.free([block_id])
            return self.handle_wait_queue()


def layout(pool: BlockPool) -> str:
    """``pool``'s blocks as one character per base block: a FREE block shows its size class at its first base block
    and ``.`` inside it; a block in use shows ``A`` (referenced) or ``c`` (cached: refcount 0, data kept) on every
    base block it covers. Read from one :meth:`~kvlab.BlockPool.snapshot`, so it is consistent."""
    snap, out = pool.snapshot(), []
    for i in range(pool.num_blocks):
        head = i - i % (1 << int(snap["size_class"][i]))  # first base block of the block holding i
        if snap["status"][i] == BlockStatus.FREE:
            out.append(str(snap["size_class"][i]) if i == head else ".")
        else:
            out.append("c" if snap["cached"][head] else "A")
    return "".join(out)


@dataclass(frozen=True)
class SharingCurve:
    """:func:`prefix_sharing_curve`'s counts: blocks in use for each number of ``users``, each user a
    ``prefix``-token shared prompt plus ``own`` tokens of their own, without (``plain``) and with (``shared``)
    sharing the prefix's full blocks. ``str()`` is the last point's line; :meth:`plot` draws both curves."""
    users: list[int]
    plain: list[int]
    shared: list[int]

    def __str__(self) -> str:
        n, p, s = self.users[-1], self.plain[-1], self.shared[-1]
        return (f"{n} 个用户 (users)：不共享 {p} 块，共享 {s} 块 (without / with sharing)，"
                f"少 {100 * (1 - s / p):.0f}% (fewer)")

    def plot(self) -> Any:
        """Blocks in use against users, both ways. Returns the Figure."""
        from kvlab.viz.static import Picture

        fig = Picture(figsize=(5, 2.8))
        ax = fig.subplots()
        ax.plot(self.users, self.plain, "o-", label="不共享 (no sharing)")
        ax.plot(self.users, self.shared, "s-", label="共享前缀 (shared prefix, refcounts)")
        ax.set_xlabel("用户数 (users)")
        ax.set_ylabel("在用的块 (blocks in use)")
        ax.legend()
        return fig


def prefix_sharing_curve(users: Sequence[int], *, prefix: int = 300, own: int = 200,
                         block_size: int = 16) -> SharingCurve:
    """Count the blocks a pool holds for each number in ``users`` of users who each send the same ``prefix``
    tokens and ``own`` tokens of their own: every user allocating all their blocks, and users sharing the
    prefix's full blocks (one allocation, one :meth:`~kvlab.BlockPool.incref` per user; the partly filled last
    prefix block cannot be shared, so each user's own blocks start there). Counts only: no K/V storage."""
    counts = [prefix, own, block_size, *users]
    if not users or any(not is_int(n) or n < (0 if i == 1 else 1) for i, n in enumerate(counts)):
        raise ConfigError(f"users, prefix, block_size must be positive ints and own >= 0; got "
                          f"users={list(users)!r:.80}, prefix={prefix!r}, own={own!r}, block_size={block_size!r}")
    full, each = prefix // block_size, -(-(prefix + own) // block_size)
    spec = KVSpec(block_size=block_size, device=torch.device("cpu"))

    def used(n: int, share: bool) -> int:
        pool = BlockPool(n * each + full, spec=spec, with_storage=False)
        common = pool.allocate(full) if share else []
        for _ in range(n):
            if share:
                pool.incref(common)
            pool.allocate(each - full if share else each)
        return pool.num_blocks - pool.num_free_blocks

    return SharingCurve(list(users), [used(n, False) for n in users], [used(n, True) for n in users])
