"""Pre-allocation learned from allocation history (text §2.2.5, "预分配策略").

Idea: demand comes in bursts (a batch of prompts arrives, a tenant's job starts). Whatever an allocation costs in
the burst — splitting, merging, evicting, waiting — can be paid earlier, in idle time, by *reserving* blocks for
the demand the history predicts. A reserved block is PENDING: owned by the tenant, invisible to allocation,
eviction and compaction, so the burst takes it with one :meth:`BlockPool.commit`.

Prediction, per key ``(owner, size_class)``: the largest number of blocks the key allocated within any ``window``
clock steps during the last ``horizon`` steps, times ``headroom``. :meth:`Preallocator.replenish` (call it when
the system is idle, e.g. between engine steps) tops each reserve up to its prediction using FREE memory only — a
guess never evicts cached data — and returns the surplus. A key with no demand for ``horizon`` steps predicts 0,
so reserves not used within the horizon go back to the pool. While requests wait in the allocator's queue nothing
is reserved: real requests come before predicted ones.

Invariants: every reserved block is PENDING with its key's owner and size class, and is in exactly one reserve;
:meth:`Preallocator.allocate` is all or nothing.
"""
from __future__ import annotations

import math
from collections import defaultdict, deque

import numpy as np

from kvlab.memory.allocator import DynamicAllocator
from kvlab.core.errors import ConfigError, OutOfBlocksError
from kvlab.core.checks import check_count, check_real, is_int
from kvlab.core.checks import INT32_MAX, check_owner
from kvlab.core.pool import BlockPool
from kvlab.core.interrupts import atomic

Key = tuple[int, int]  # (owner, size_class)


@atomic()
class Preallocator:
    """Reserves blocks per ``(owner, size_class)`` ahead of predicted bursts (see the module docstring).

    Args:
        pool: the pool to reserve from.
        allocator: if given, misses in a burst go through it, and nothing is reserved while requests wait in
            its queue.
        window: burst length in clock steps over which demand is counted (steps ``t`` to ``t + window - 1``).
        horizon: how far back (clock steps) history counts, demand ``horizon`` steps old included; older demand,
            and the reserve kept for it, expire.
        headroom: factor on the predicted demand.
        max_reserve: cap on the blocks reserved per key (None: no cap).
    """

    def __init__(self, pool: BlockPool, *, allocator: DynamicAllocator | None = None, window: int = 64,
                 horizon: int = 1024, headroom: float = 1.0, max_reserve: int | None = None) -> None:
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"a Preallocator needs a BlockPool, got {pool!r}")
        if allocator is not None and not (isinstance(allocator, DynamicAllocator) and allocator.pool is pool):
            raise ConfigError(f"allocator must be a DynamicAllocator of this pool or None; {allocator!r} is not "
                              f"(one of another pool, or no allocator)")
        if not (is_int(window) and is_int(horizon) and 0 < window <= horizon):
            raise ConfigError(f"need integers 0 < window <= horizon, got window={window!r}, horizon={horizon!r}")
        check_real(headroom, "headroom", lo=0, lo_open=True)  # finite: ceil(inf) has no int
        if max_reserve is not None:
            max_reserve = check_count(max_reserve, "max_reserve")
        window, horizon = int(window), int(horizon)
        self.pool, self.allocator = pool, allocator
        self.window, self.horizon, self.headroom, self.max_reserve = window, horizon, headroom, max_reserve
        self.demand: dict[Key, deque[tuple[float, int]]] = defaultdict(deque)  # (step, blocks) per allocation
        self.reserves: dict[Key, list[int]] = defaultdict(list)
        self.stats = {"from_reserve": 0, "fallback": 0, "reserved": 0, "returned": 0}

    # ------------------------------------------------------------------ learning
    def observe(self, owner: int, size_class: int, n: int = 1) -> None:
        """Record that ``owner`` allocated ``n`` blocks of ``size_class`` now (``allocate`` does this itself)."""
        key, n = self._key(owner, size_class), check_count(n, "number of blocks")
        if n > INT32_MAX:  # no pool holds more; a larger count would overflow the predictions' arrays
            raise ConfigError(f"number of blocks must be at most {INT32_MAX}, got {n}")
        self.demand[key].append((self.pool.clock.now(), n))

    def _key(self, owner: object, size_class: object) -> Key:
        """``(owner, size_class)`` checked as the pool would, as plain ints: ``(7, 0.0)`` would find the
        reserve of ``(7, 0)`` in a dict."""
        return check_owner(owner), self.pool.check_class(size_class)

    def predict(self, owner: int, size_class: int) -> int:
        """Blocks to hold in reserve for the key: its peak demand within ``window`` steps over the horizon."""
        log = self.demand.get(self._key(owner, size_class))
        now = self.pool.clock.now()
        while log and log[0][0] < now - self.horizon:
            log.popleft()
        if not log:
            return 0
        steps, blocks = (np.array(x) for x in zip(*log))
        cum = np.concatenate(([0], np.cumsum(blocks)))
        ends = np.searchsorted(steps, steps + self.window, side="left")
        peak = int((cum[ends] - cum[np.arange(steps.size)]).max())
        want = math.ceil(peak * self.headroom)
        return want if self.max_reserve is None else min(want, self.max_reserve)

    # ------------------------------------------------------------------ serving
    def allocate(self, n: int = 1, *, owner: int = -1, size_class: int = 0) -> list[int]:
        """``n`` ALLOCATED blocks for ``owner``: from its reserve (one commit), the rest from the allocator if one
        was given (one request each, no waiting) else in one batch from the pool. Raises
        :class:`OutOfBlocksError` if the rest cannot be supplied, with the reserves untouched and no block taken:
        the pool's batch changes nothing; through the allocator, blocks taken are returned, but cached blocks it
        evicted on the way stay evicted."""
        n = check_count(n, "number of blocks")
        owner, size_class = self._key(owner, size_class)
        pool = self.pool
        with pool.lock:
            reserve = self.reserves.get((owner, size_class), [])
            hit = min(n, len(reserve))
            if n - hit > pool.num_blocks:  # said here, where the message can name the request
                raise OutOfBlocksError(f"owner {owner} asked for {n} blocks ({hit} reserved); the pool has "
                                       f"{pool.num_blocks}")
            extra = self._allocate_misses(n - hit, owner, size_class) if n > hit else []
            taken = reserve[len(reserve) - hit:]
            pool.commit(taken)
            del reserve[len(reserve) - hit:]
            self.stats["from_reserve"] += hit
            self.stats["fallback"] += len(extra)
            if n:
                self.observe(owner, size_class, n)
            return taken + extra

    def _allocate_misses(self, n: int, owner: int, size_class: int) -> list[int]:
        if self.allocator is None:
            return self.pool.allocate(n, size_class=size_class, owner=owner)
        got: list[int] = []
        try:
            for _ in range(n):
                t = self.allocator.allocate_optimal_block(size_class=size_class, owner=owner, wait=False)
                assert t.block is not None  # wait=False: served, or OutOfBlocksError
                got.append(t.block.block_id)
        except OutOfBlocksError:
            if got:
                self.pool.free(got)
            raise
        return got

    def replenish(self) -> dict[Key, int]:
        """Return each reserve's surplus over its prediction, then top it up from FREE memory (never evicting);
        nothing is reserved while requests wait. Returns the change per key (positive: reserved)."""
        pool = self.pool
        with pool.lock:
            change: dict[Key, int] = {}
            targets = {key: self.predict(*key) for key in set(self.demand) | set(self.reserves)}
            for key, want in targets.items():
                reserve = self.reserves[key]
                if len(reserve) > want:
                    surplus = reserve[:len(reserve) - want]  # the oldest go back first
                    pool.free(surplus)
                    del reserve[:len(surplus)]
                    self.stats["returned"] += len(surplus)
                    change[key] = -len(surplus)
            if self.allocator is not None and self.allocator.waiters:
                return change
            if pool.max_order:
                pool.merge_free_buddies()  # so free capacity below reads in whole blocks of each class
            for (owner, order), want in targets.items():
                reserve = self.reserves[(owner, order)]
                free = pool.free_lists.capacity(order)
                need = min(want - len(reserve), free)
                if need > 0:  # free capacity suffices, so the pool splits but never evicts for these
                    reserve.extend(pool.reserve(need, size_class=order, owner=owner))
                    self.stats["reserved"] += need
                    change[(owner, order)] = need
            return change

    def release_all(self) -> int:
        """Return every reserved block to the pool; returns how many."""
        with self.pool.lock:
            ids = [b for r in self.reserves.values() for b in r]
            if ids:
                self.pool.free(ids)
            self.reserves.clear()
            self.stats["returned"] += len(ids)
            return len(ids)

    @property
    def reserved(self) -> int:
        """Blocks currently held in reserve."""
        return sum(len(r) for r in self.reserves.values())
