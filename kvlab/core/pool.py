"""BlockPool: fixed-size blocks carved from one KV tensor (text §2.2.2 "块池管理"), the reference to read.

The idea: one tensor is cut into ``num_blocks`` blocks of ``block_size`` token slots. A sequence holds a list of
block ids (its block table), so its K/V need not be contiguous, and a block is shared by counting references::

    FREE --allocate--> ALLOCATED (refcount 1) --incref / decref--> ALLOCATED (refcount >= 1)
    ALLOCATED --free, refcount -> 0--> FREE, or *cached* if its data is reusable (ALLOCATED, refcount 0)
    cached --incref (a prefix-cache hit)--> ALLOCATED;   cached --evict (the policy's victim)--> FREE
    FREE --reserve--> PENDING --commit--> ALLOCATED;     ALLOCATED --begin_eviction--> EVICTING --> FREE

Invariants (:meth:`BlockPool.check_invariants`, asserted after every step of the property tests):

* the blocks tile the pool, each aligned to its size; FREE + PENDING + ALLOCATED + EVICTING == ``num_blocks``;
* a block is on a free stack iff it is FREE, and in the eviction policy iff it is cached;
* refcount >= 0; a FREE block has refcount 0, no tokens, no owner and no reusable data;
* a block counts at most its capacity in tokens.

Every public mutation validates all of its input first (a rejected call changes nothing, not even the clock),
then takes the lock once, ticks the clock once and publishes one event per effect (:mod:`kvlab.core.events`).
The parts: per-block fields in :mod:`kvlab.core.meta`, free stacks and buddies in :mod:`kvlab.core.freelists`,
victims from :mod:`kvlab.core.eviction`, input rules in :mod:`kvlab.core.checks`. Speed lives apart
(:mod:`kvlab.fast.pool`, held equal to this class by tests); the text's own method names are an adapter around it
(:mod:`kvlab.textbook.pool`).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from itertools import islice
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvlab.core import events as ev
from kvlab.core.block import ALLOCATED, EVICTING, FREE, PENDING, STATE_NAMES, BlockStatus
from kvlab.core.checks import INT32_MAX, check_block_sizes, check_clock, check_count, check_flag, check_owner, is_int, \
    occurrences
from kvlab.core.clock import Clock, LogicalClock
from kvlab.core.errors import (ConfigError, DoubleFreeError, IllegalTransitionError, KVDataError, OutOfBlocksError,
                               RefcountUnderflowError, UnknownBlockError)
from kvlab.core.events import notify
from kvlab.core.eviction import EvictionPolicy, make_policy
from kvlab.core.freelists import FreeLists
from kvlab.core.meta import FIELDS, NO_OWNER, BlockMeta
from kvlab.core.spec import KVSpec
from kvlab.core.storage import KVStorage
from kvlab.core.interrupts import atomic

RANKED = 8  # candidates an Evicted event lists: the victim, then the ones it was preferred to
Ids = Sequence[int] | np.ndarray | torch.Tensor


@atomic()
class BlockPool:
    """``num_blocks`` KV blocks (or as many as ``total_memory`` bytes hold) of ``spec``'s shape, with states,
    refcounts, an ``eviction_policy`` (``"lru"``, ``"fifo"``, ``"lfu"``, ``"random"`` or an
    :class:`EvictionPolicy`, ``seed`` for the random one), batch operations and events. ``block_sizes``: the
    text's size classes in tokens, power-of-two multiples of the smallest (buddy blocks). ``clock`` ticks once
    per public mutation; ``with_storage=False`` builds a metadata-only pool (no tensor) for large simulations."""

    def __init__(self, num_blocks: int | None = None, *, spec: KVSpec | None = None,
                 total_memory: int | None = None, block_sizes: Sequence[int] | None = None,
                 eviction_policy: str | EvictionPolicy = "lru", clock: Clock | None = None,
                 with_storage: bool = True, seed: int = 0) -> None:
        spec, self.max_order = check_block_sizes(spec or KVSpec(), block_sizes)
        if (num_blocks is None) == (total_memory is None):
            raise ConfigError("give exactly one of num_blocks or total_memory")
        num_blocks = spec.blocks_for_budget(total_memory) if total_memory is not None else num_blocks
        if not is_int(num_blocks) or not 1 <= num_blocks <= INT32_MAX:
            raise ConfigError(f"num_blocks must be an int in 1..{INT32_MAX}, got {num_blocks!r}")
        self.clock: Clock = check_clock(clock or LogicalClock())
        self.spec, self.num_blocks, self.block_size = spec, int(num_blocks), spec.block_size
        self.bytes_per_block = spec.bytes_per_block
        self.block_sizes = [spec.block_size << k for k in range(self.max_order + 1)]
        self.storage = KVStorage(spec, self.num_blocks) if check_flag(with_storage, "with_storage") else None
        self.meta = BlockMeta(self.num_blocks)  # the only writable copy of the per-block fields
        self.free_lists = FreeLists(self.meta, self.max_order)
        self.lock = threading.RLock()
        self.events = ev.EventBus()
        self.policy = make_policy(eviction_policy, seed).bind(self)
        self.eviction_policy = self.policy.name
        self.evict_guard: Callable[[int], bool] | None = None  # may veto a victim (prefix-chain order), see _evictable
        self.evict_hooks: list[Callable[[int], None]] = []  # told which cached block lost its data
        self.relocation_hooks: list[Callable[[np.ndarray, np.ndarray], None]] = []  # told src -> dst moves
        # told which blocks stopped keeping reusable data without an eviction (swapped out, unmarked while held)
        self.stale_hooks: list[Callable[[list[int]], None]] = []
        self.counts = dict.fromkeys(("allocations", "frees", "decrefs", "evictions", "splits", "merges",
                                     "migrations", "served_free", "served_split", "served_evict"), 0)
        self.lock_acquisitions = 0  # public mutations (each takes the lock once)
        # What other modules may read: the fields as read-only memoryviews (fast scalar reads) and numpy arrays.
        self.fields = SimpleNamespace(**{k: memoryview(getattr(self.meta, k)).toreadonly() for k in FIELDS})
        self.arrays = self.meta.readonly()

    # ------------------------------------------------------------------ allocate
    def allocate(self, n: int = 1, *, size_class: int = 0, owner: int = -1,
                 status: BlockStatus = BlockStatus.ALLOCATED, block_id: int | None = None) -> list[int]:
        """Allocate ``n`` blocks of ``size_class`` (refcount 1 each): from the free stack, else by splitting a
        larger free block, else by evicting the policy's victim. All or nothing: :class:`OutOfBlocksError`, with
        nothing changed, if the pool cannot supply ``n``, counting as evictable only what the ``evict_guard``
        lets go (see :meth:`_evictable`). ``status=PENDING`` reserves blocks whose data is still to arrive;
        ``block_id`` takes that one FREE block (``n`` must be 1). An evict hook that raises reaches the caller
        with every block taken back on the free stack (the victims evicted so far stay FREE); a listener that
        raises stops nothing (:class:`~kvlab.core.events.EventBus`)."""
        with self.lock:
            n, k, owner = check_count(n, "number of blocks"), self.check_class(size_class), check_owner(owner)
            if type(status) not in (int, BlockStatus) or status not in (ALLOCATED, PENDING):
                raise IllegalTransitionError(f"allocation ends in ALLOCATED or PENDING, not {status!r}")
            if block_id is not None:
                b = self.check_id(block_id)
                BlockStatus.check(b, self.meta.status[b], int(status))
                if n != 1 or self.meta.status[b] != FREE:
                    raise IllegalTransitionError(f"block {b} is {STATE_NAMES[self.meta.status[b]]}: only one FREE "
                                                 f"block can be allocated by id (n={n})")
                k = self.meta.size_class[b]
            elif n > (free := self.free_lists.capacity(k)) and n - free > (gone := self._evictable(k, n - free)):
                raise OutOfBlocksError(
                    f"asked for {n} blocks of {self.block_size << k} tokens; the pool has {self.num_free_blocks} "
                    f"free base blocks and {len(self.policy)} cached, of which the guard lets {gone} go "
                    f"(of {self.num_blocks} blocks)")
            if not n:
                return []
            t = self._mutation()
            taken: list[tuple[int, str]] = []
            if block_id is not None:
                self.free_lists.remove(b)
                taken.append((b, "free"))
            try:
                while len(taken) < n:
                    taken.append(self._take(k, t))
            except BaseException:  # a guard broke its promise (see _evictable), or a hook raised: hand back
                for b, _ in reversed(taken):  # what was taken (the blocks evicted so far stay FREE)
                    self.free_lists.push(b)
                raise
            out, served = [b for b, _ in taken], [how for _, how in taken]
            for b, how in taken:
                self.meta.stamp(b, t, owner, int(status))
                self.counts["served_" + how] += 1
            self.counts["allocations"] += n
            if self.events and n:  # the strategy reported is the one that served most of the blocks
                how = max(("free", "split", "evict"), key=served.count)
                self.events.publish(ev.Allocated(t, tuple(out), k, owner, STATE_NAMES[status], how))
            return out

    def reserve(self, n: int = 1, *, size_class: int = 0, owner: int = -1) -> list[int]:
        """Allocate ``n`` blocks as PENDING (owned, data still arriving); :meth:`commit` makes them ALLOCATED."""
        return self.allocate(n, size_class=size_class, owner=owner, status=BlockStatus.PENDING)

    def _evictable(self, k: int, need: int) -> int:
        """Blocks of class ``k`` that evicting cached blocks of class >= ``k`` would yield, counted until ``need``.

        With an ``evict_guard`` only what it lets go counts, so that an allocation the guard would stop half-way
        is refused before anything is evicted. A guard that knows which candidates it keeps however many others
        go (a ``held_back(min_order) -> set`` method, as the prefix cache's :class:`~kvlab.core.prefix.ChainGuard`
        has: it frees a chain's head once its tails are gone) is asked that; a plain callable is taken to keep
        its verdicts for the whole allocation, and counts the candidates it accepts now."""
        size, guard = self.meta.size_class, self.evict_guard
        held_back = getattr(guard, "held_back", None)
        kept = held_back(k) if held_back is not None else ()
        if not self.max_order and (guard is None or held_back is not None):
            return len(self.policy) - len(kept)
        got = 0
        for b, _ in self.policy.order():
            if size[b] >= k and (b not in kept if held_back is not None else guard is None or guard(b)):
                got += 1 << (size[b] - k)
                if got >= need:
                    break
        return got

    def _take(self, k: int, t: int) -> tuple[int, str]:
        """One FREE block of class ``k`` off the free stacks (splitting if needed), else by evicting."""
        got = self.free_lists.take(k)
        if got is None:
            if self._evict_one("allocation pressure", t, min_order=k) is None:  # every candidate was vetoed
                raise OutOfBlocksError(f"no block of {self.block_size << k} tokens is free or evictable")
            return self._take(k, t)[0], "evict"
        b, splits = got
        self.counts["splits"] += len(splits)
        if self.events:
            for parent, order, buddy in splits:
                self.events.publish(ev.Split(t, parent, order, buddy))
        return b, "split" if splits else "free"

    # ------------------------------------------------------------------ references
    def free(self, ids: Ids) -> None:
        """Drop one reference per id (a repeated id drops one per occurrence). A block reaching 0 is FREE, or
        cached if marked reusable; a PENDING block is aborted back to FREE. Blocks going FREE are pushed so that
        the first id comes out first again. :class:`DoubleFreeError` for a FREE, cached or EVICTING block or
        more releases than references; nothing changes then."""
        self._drop_refs(ids, free=True)

    def decref(self, ids: Ids) -> None:
        """Drop one reference per id; at 0 a block keeps its data and becomes cached (evictable), whether or
        not it is marked reusable. :class:`RefcountUnderflowError` if a refcount would go below 0."""
        self._drop_refs(ids, free=False)

    def _drop_refs(self, ids: Ids, free: bool) -> None:
        with self.lock:
            m = self.meta
            want = occurrences(self.check_ids(ids))  # {id: occurrences}, first occurrence first
            for b, c in want.items():
                s, r = m.status[b], m.refcount[b]
                if free and not (s == ALLOCATED and r >= c or s == PENDING and c == 1):
                    what = "cached (refcount 0)" if s == ALLOCATED and not r else STATE_NAMES[s]
                    raise DoubleFreeError(f"block {b} is {what} with refcount {r}: it cannot be released {c} "
                                          f"time(s) (double free?)")
                if not free and s != ALLOCATED:
                    raise IllegalTransitionError(f"block {b} is {STATE_NAMES[s]}: only ALLOCATED blocks hold "
                                                 f"references")
                if not free and r < c:
                    raise RefcountUnderflowError(f"block {b} has refcount {r}; this call drops {c}")
            if not want:
                return
            t = self._mutation()
            self.counts["frees" if free else "decrefs"] += sum(want.values())
            left, kept, gone = [], [], []
            for b, c in want.items():
                r = m.refcount[b] = m.refcount[b] - c
                if r:
                    left.append(b)
                elif m.status[b] == ALLOCATED and (m.reusable[b] or not free):
                    kept.append(b)
                else:
                    gone.append(b)
            for b in left + kept:  # a block going FREE keeps its last access: releasing it is no access
                m.last_access[b] = t
            for b in kept:
                self.policy.add(b)
            for b in reversed(gone):
                self._push_free(b)
            if self.events:
                if left:
                    self.events.publish(ev.RefChanged(t, tuple(left), tuple(-want[b] for b in left),
                                                      tuple(m.refcount[b] for b in left)))
                if kept:
                    self.events.publish(ev.Cached(t, tuple(kept)))
                if gone:
                    self.events.publish(ev.Freed(t, tuple(gone)))

    def incref(self, ids: Ids) -> None:
        """Add one reference per id (a repeated id adds one per occurrence). A cached block becomes referenced
        again and leaves the evictable set: how a prefix-cache hit reuses data instead of recomputing it."""
        with self.lock:
            m = self.meta
            want = self._allocated_counts(ids, "can be referenced")
            if not want:
                return
            t = self._mutation()
            for b, c in want.items():
                if not m.refcount[b]:
                    self.policy.discard(b)
                m.refcount[b] += c
                m.hits[b] += c
                m.last_access[b] = t
            if self.events:
                self.events.publish(ev.RefChanged(t, tuple(want), tuple(want.values()),
                                                  tuple(m.refcount[b] for b in want)))

    def _allocated_counts(self, ids: Ids, what: str) -> dict[int, int]:
        """``{id: occurrences}`` of ``ids``, each ALLOCATED, else :class:`IllegalTransitionError`."""
        want = occurrences(self.check_ids(ids))  # {id: occurrences}, first occurrence first
        for b in want:
            if self.meta.status[b] != ALLOCATED:
                raise IllegalTransitionError(f"block {b} is {STATE_NAMES[self.meta.status[b]]}: only ALLOCATED blocks "
                                             f"{what}")
        return want

    def touch(self, ids: Ids) -> None:
        """Record an access (an attention read) without taking a reference: last access = now, one hit per
        occurrence, and cached blocks move in the policy's order accordingly. Only ALLOCATED blocks."""
        with self.lock:
            m = self.meta
            want = self._allocated_counts(ids, "are read")
            if not want:
                return
            t = self._mutation()
            for b, c in want.items():
                m.last_access[b] = t
                m.hits[b] += c
                if b in self.policy:
                    self.policy.touched(b)

    def mark_reusable(self, ids: Ids, reusable: bool = True) -> None:
        """Mark blocks whose data is worth keeping at refcount 0 (full prefix-cache blocks); repeats are
        harmless. Unmarking a cached block releases it to FREE at once (its data is no longer wanted)."""
        with self.lock:
            reusable, m = check_flag(reusable, "reusable"), self.meta
            blocks = list(dict.fromkeys(self.check_ids(ids)))
            for b in blocks:
                if m.status[b] not in (ALLOCATED, PENDING):
                    raise IllegalTransitionError(f"block {b} is {STATE_NAMES[m.status[b]]}: it holds no data to keep")
            if not blocks:
                return
            t = self._mutation()
            gone = [b for b in blocks if not reusable and m.status[b] == ALLOCATED and not m.refcount[b]]
            held = [b for b in blocks if not reusable and m.reusable[b] and b not in gone]
            for b in blocks:
                m.reusable[b] = int(reusable)
            for b in reversed(gone):
                self._uncache(b)
            if held:
                notify(self.stale_hooks, held)
            if gone and self.events:
                self.events.publish(ev.Freed(t, tuple(gone)))

    def set_token_counts(self, ids: Ids, counts: Sequence[int]) -> None:
        """Filled slots of each block (sequences update them as they append). Not an event: the data moves,
        not the block."""
        with self.lock:
            blocks = self.check_ids(ids)
            if not isinstance(counts, (list, tuple)) or len(counts) != len(blocks):
                raise ConfigError(f"set_token_counts needs one count per block, got {counts!r} for {blocks}")
            for b, c in zip(blocks, counts):
                cap = self.block_size << self.meta.size_class[b]
                if not is_int(c) or not 0 <= c <= cap:
                    raise KVDataError(f"block {b} holds at most {cap} tokens, not {c!r}")
                if self.meta.status[b] == FREE:
                    raise IllegalTransitionError(f"block {b} is FREE: it has no tokens to count")
            for b, c in zip(blocks, counts):
                self.meta.tokens[b] = int(c)

    def set_token_count(self, block_id: int, count: int) -> None:
        """:meth:`set_token_counts` of one block."""
        self.set_token_counts([block_id], [count])

    def set_owner(self, ids: Ids, owner: int) -> None:
        """Record who holds the blocks (shown by the views; a shared block shows its last owner)."""
        with self.lock:
            blocks, owner = self.check_ids(ids), check_owner(owner)
            for b in blocks:
                if self.meta.status[b] == FREE:
                    raise IllegalTransitionError(f"block {b} is FREE: no one holds it")
            for b in blocks:
                self.meta.owner[b] = owner

    # ------------------------------------------------------------------ the rest of the state machine
    def commit(self, ids: Ids) -> None:
        """PENDING -> ALLOCATED (the data has arrived)."""
        self._transition(ids, PENDING, ALLOCATED)

    def begin_eviction(self, ids: Ids) -> None:
        """ALLOCATED -> EVICTING: the data is about to leave (swap-out); no one may take the block meanwhile."""
        self._transition(ids, ALLOCATED, EVICTING)

    def finish_eviction(self, ids: Ids) -> None:
        """EVICTING -> FREE: the data has left."""
        self._transition(ids, EVICTING, FREE)

    def _transition(self, ids: Ids, old: int, new: int) -> None:
        with self.lock:
            blocks = self.check_ids(ids)
            for b in blocks:
                BlockStatus.check(b, self.meta.status[b], new)
                if self.meta.status[b] != old:
                    raise IllegalTransitionError(f"block {b} is {STATE_NAMES[self.meta.status[b]]}, expected "
                                                 f"{STATE_NAMES[old]} for -> {STATE_NAMES[new]}")
            if len(set(blocks)) != len(blocks):
                raise IllegalTransitionError(f"block ids repeat in {blocks}")
            if not blocks:
                return
            t = self._mutation()
            leaving = [b for b in blocks if old == ALLOCATED and self.meta.reusable[b]]
            for b in blocks:
                self.policy.discard(b)
                if new == FREE:
                    self._push_free(b)
                else:
                    self.meta.set_status(b, new)
                    self.meta.last_access[b] = t
            if leaving:
                notify(self.stale_hooks, leaving)
            if self.events:
                self.events.publish(ev.StatusChanged(t, tuple(blocks), STATE_NAMES[old], STATE_NAMES[new]))

    def _push_free(self, b: int) -> None:
        self.meta.reset(b)
        self.free_lists.push(b)

    def _uncache(self, b: int) -> None:
        """Cached block ``b`` loses its data (evicted or released): FREE, and every evict hook is told."""
        self.policy.discard(b)
        self._push_free(b)
        notify(self.evict_hooks, b)

    # ------------------------------------------------------------------ eviction
    def _evict_one(self, reason: str, t: int, min_order: int = 0) -> int | None:
        """Evict the policy's first acceptable victim (cached, not vetoed, of class >= ``min_order``). Its event
        carries the victim and the candidates it was preferred to, with their scores."""
        order = self.policy.order()
        ranked, victim = [], None
        for b, score in order:
            ranked.append((b, score))
            if self.meta.size_class[b] >= min_order and (self.evict_guard is None or self.evict_guard(b)):
                victim = b
                break
        if victim is None:
            return None
        if self.events:  # the victim first, then the candidates it was preferred to (passed over or next)
            ranked = [ranked[-1], *ranked[:-1], *islice(order, max(0, RANKED - len(ranked)))]
        self.policy.evicting(victim)  # a policy whose state moves with its choice (CLOCK's hand) commits it
        self._uncache(victim)
        self.counts["evictions"] += 1
        if self.events:
            self.events.publish(ev.Evicted(t, victim, self.policy.name, reason, tuple(ranked[:RANKED])))
        return victim

    def evict(self, reason: str = "explicit") -> int | None:
        """Evict one cached block chosen by the policy; returns its id (now FREE), or None when no block is
        evictable. Referenced blocks are never candidates; a vetoed candidate is passed over for the next."""
        with self.lock:
            if not isinstance(reason, str):
                raise ConfigError(f"reason must be a str, got {reason!r}")
            guard = self.evict_guard
            if not any(guard is None or guard(b) for b, _ in self.policy.order()):
                return None  # nothing cached, or every candidate vetoed: nothing changes, not even the clock
            return self._evict_one(reason, self._mutation())

    def release_cached(self, block_id: int) -> None:
        """Drop the data of cached block ``block_id`` (ALLOCATED, refcount 0) and return it to FREE."""
        with self.lock:
            b = self.check_id(block_id)
            if self.meta.status[b] != ALLOCATED or self.meta.refcount[b]:
                raise IllegalTransitionError(f"block {b} is {STATE_NAMES[self.meta.status[b]]} with refcount "
                                             f"{self.meta.refcount[b]}: only a cached block can be released")
            t = self._mutation()
            self._uncache(b)
            if self.events:
                self.events.publish(ev.Freed(t, (b,)))

    # ------------------------------------------------------------------ buddies and migration
    def split_block(self, block_id: int) -> tuple[int, int]:
        """Split FREE block ``block_id`` of size class k > 0 into two FREE buddies of class k-1."""
        with self.lock:
            b = self.check_id(block_id)
            k = self.meta.size_class[b]
            if self.meta.status[b] != FREE or not k:
                raise IllegalTransitionError(f"block {b} is {STATE_NAMES[self.meta.status[b]]} of size class {k}: "
                                             f"only a FREE block of class > 0 can be split")
            t = self._mutation()
            buddy = self.free_lists.split(b)
            self.counts["splits"] += 1
            if self.events:
                self.events.publish(ev.Split(t, b, k, buddy))
            return b, buddy

    def merge_free_buddies(self, max_merges: int | None = None) -> int:
        """Merge pairs of FREE buddies into their parent, smallest classes first and repeatedly (at most
        ``max_merges`` pairs), so freed space becomes large blocks again. Returns the number of merges."""
        with self.lock:
            if max_merges is not None:
                check_count(max_merges, "max_merges")
            merged = self.free_lists.merge_buddies(max_merges)
            if not merged:
                return 0
            t = self._mutation()
            self.counts["merges"] += len(merged)
            if self.events:
                for b, k in merged:
                    self.events.publish(ev.Merged(t, b, k))
            return len(merged)

    def sort_free_lists(self) -> None:
        """Reorder every free stack so the lowest ids come out first, as in a fresh pool (after compaction the
        free space is then handed out in address order). Changes no block's state."""
        with self.lock:
            self.free_lists.sort()

    def migrate(self, src: Ids, dst: Ids, reason: str = "compaction") -> None:
        """Move ALLOCATED blocks ``src[i]`` into FREE blocks ``dst[i]`` of the same size class: one batched
        tensor copy, metadata moved, sources FREE, then every relocation hook rewrites its block tables."""
        with self.lock:
            s, d = self.check_ids(src), self.check_ids(dst)
            m = self.meta
            if len(s) != len(d):
                raise ConfigError(f"migrate got {len(s)} sources and {len(d)} destinations")
            if len(set(s) | set(d)) != 2 * len(s):
                raise IllegalTransitionError(f"migrate needs distinct blocks, got {s} -> {d}")
            if not isinstance(reason, str):
                raise ConfigError(f"reason must be a str, got {reason!r}")
            for a, b in zip(s, d):
                if m.status[a] != ALLOCATED:
                    raise IllegalTransitionError(f"block {a} is {STATE_NAMES[m.status[a]]}: only ALLOCATED blocks move")
                if m.status[b] != FREE:
                    raise IllegalTransitionError(f"target block {b} is {STATE_NAMES[m.status[b]]}, not FREE")
                if m.size_class[a] != m.size_class[b]:
                    raise ConfigError(f"block {a} (class {m.size_class[a]}) cannot move into block {b} "
                                      f"(class {m.size_class[b]})")
            if not s:
                return
            t = self._mutation()
            if self.storage is not None:
                self.storage.copy_blocks(_base_blocks(s, m), _base_blocks(d, m))
            self.free_lists.remove_many(np.array(d))
            for a, b in zip(s, d):
                m.copy(a, b)
            self.policy.relabel({a: b for a, b in zip(s, d) if a in self.policy})  # moving is no access
            for a in s:
                self._push_free(a)
            self.counts["migrations"] += len(s)
            notify(self.relocation_hooks, np.array(s), np.array(d))
            if self.events:
                self.events.publish(ev.Migrated(t, tuple(s), tuple(d), reason))

    # ------------------------------------------------------------------ ids and views
    def check_id(self, block_id: Any) -> int:
        """``block_id`` as an int naming the first base block of a block, else :class:`UnknownBlockError`."""
        if not is_int(block_id):
            raise UnknownBlockError(f"a block id is an int, not {block_id!r}")
        b = int(block_id)
        if not 0 <= b < self.num_blocks:
            raise UnknownBlockError(f"block {b} is not in this pool (ids 0..{self.num_blocks - 1})")
        if self.max_order and (head := b & ~(self.meta.span(b) - 1)) != b:
            raise UnknownBlockError(f"block {b} is inside block {head} of size class {self.meta.size_class[b]}, "
                                    f"not the start of a block")
        return b

    def check_ids(self, ids: Any) -> list[int]:
        """A sequence of block ids (list, tuple, range, 1-D integer array or tensor) as validated ints."""
        if isinstance(ids, (list, tuple, range)):
            return [self.check_id(b) for b in ids]
        if isinstance(ids, (torch.Tensor, np.ndarray)):
            if ids.ndim != 1 or (len(ids) and (ids.dtype in (torch.bool, np.bool_) or ids.is_floating_point()
                                               if isinstance(ids, torch.Tensor) else ids.dtype.kind not in "iu")):
                raise UnknownBlockError(f"block ids must be a 1-D sequence of ints, got {ids!r}")
            return [self.check_id(b) for b in ids.tolist()]
        raise UnknownBlockError(f"block ids must be a list, tuple, range or 1-D int array, got {ids!r}")

    def storage_of(self) -> KVStorage:
        """The KV tensor's storage; :class:`ConfigError` for a metadata-only pool."""
        if self.storage is None:
            raise ConfigError("this pool is metadata-only (with_storage=False): it has no KV tensor")
        return self.storage

    def span(self, block_id: int) -> int:
        """Number of base blocks in ``block_id``."""
        return self.meta.span(self.check_id(block_id))

    def is_cached(self, block_id: int) -> bool:
        """ALLOCATED with refcount 0: the block keeps reusable data and may be evicted."""
        b = self.check_id(block_id)
        return self.meta.status[b] == ALLOCATED and not self.meta.refcount[b]

    @property
    def num_free_blocks(self) -> int:
        """FREE base blocks."""
        return len(self.free_lists)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with refcount 0 that keep reusable data (evictable)."""
        return len(self.policy)

    def free_ids(self, size_class: int = 0) -> list[int]:
        """FREE blocks of ``size_class``, the next to be handed out first."""
        return self.free_lists.stacks[self.check_class(size_class)][::-1].tolist()

    def __len__(self) -> int:
        return self.num_blocks

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.num_blocks} blocks x {self.block_size} tokens, "
                f"free={self.num_free_blocks}, cached={len(self.policy)}, policy={self.policy.name}, "
                f"device={self.spec.device})")

    def check_class(self, size_class: Any) -> int:
        """``size_class`` as an int naming one of this pool's classes, else :class:`ConfigError`."""
        if not is_int(size_class) or not 0 <= size_class <= self.max_order:
            raise ConfigError(f"size_class {size_class!r} is not one of this pool's 0..{self.max_order} "
                              f"(block sizes {self.block_sizes})")
        return int(size_class)

    def _mutation(self) -> int:
        """Count a public mutation that passed validation and tick the clock: the step its events carry."""
        self.lock_acquisitions += 1
        return self.clock.tick()

    # ------------------------------------------------------------------ reporting
    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of the per-base-block fields (:mod:`kvlab.core.meta`), taken atomically, plus ``cached``."""
        with self.lock:
            snap = self.meta.snapshot()
        snap["cached"] = (snap["status"] == ALLOCATED) & (snap["refcount"] == 0)
        return snap

    def status_counts(self) -> dict[str, int]:
        """Base blocks per state, e.g. ``{"FREE": 10, "PENDING": 0, "ALLOCATED": 6, "EVICTING": 0}``."""
        c = np.bincount(self.arrays.status, minlength=4)
        return {name: int(c[i]) for i, name in enumerate(STATE_NAMES)}

    def stats(self) -> dict[str, int]:
        """Counters since creation (allocations, frees, evictions, splits, merges, migrations, how allocations
        were served), the base blocks per state now, cached blocks and lock acquisitions."""
        with self.lock:
            return {**self.counts, **self.status_counts(), "cached": len(self.policy),
                    "lock_acquisitions": self.lock_acquisitions}

    def free_runs(self) -> np.ndarray:
        """Lengths (in base blocks) of the maximal runs of consecutive FREE base blocks, in address order."""
        free = np.zeros(self.num_blocks + 2, bool)  # FREE flags between two non-free sentinels
        np.equal(self.arrays.status, FREE, out=free[1:-1])
        edges = np.flatnonzero(free[1:] != free[:-1])  # where runs start and end (10x faster than np.diff)
        return edges[1::2] - edges[::2]

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (see the module docstring)."""
        with self.lock:
            n, a = self.num_blocks, self.arrays
            st, order, refs = a.status, a.size_class, a.refcount
            heads, u = [], 0
            while u < n:  # tiling: aligned blocks, one status and one class within each
                k = 1 << int(order[u])
                assert u % k == 0 and u + k <= n, f"block {u} of class {order[u]} is misaligned"
                assert (order[u:u + k] == order[u]).all() and (st[u:u + k] == st[u]).all(), f"block {u} is torn"
                heads.append(u)
                u += k
            h = np.array(heads)
            stacked = self.free_lists.ids()
            assert len(stacked) == len(set(stacked)), "a block is on a free stack twice"
            for k, stack in enumerate(self.free_lists.stacks):
                assert all(order[b] == k for b in stack), f"free stack {k} holds a block of another class"
            free = set(h[st[h] == FREE].tolist())
            assert set(stacked) == free, f"free stacks disagree with status at {sorted(set(stacked) ^ free)[:5]}"
            assert (refs >= 0).all(), f"negative refcount at block {int(np.argmax(refs < 0))}"
            for name, value in (("refcount", 0), ("tokens", 0), ("owner", NO_OWNER), ("reusable", 0)):
                assert (getattr(a, name)[st == FREE] == value).all(), f"a FREE block has {name} != {value}"
            cap = self.block_size << order.astype(np.int64)
            assert (a.tokens <= cap).all(), f"block {int(np.argmax(a.tokens > cap))} counts more tokens than it holds"
            cached = set(h[(st[h] == ALLOCATED) & (refs[h] == 0)].tolist())
            in_policy = [b for b, _ in self.policy.order()]
            assert len(self.policy) == len(in_policy) == len(set(in_policy)), "the policy's size and order disagree"
            odd = sorted(set(in_policy) ^ cached)[:5]
            assert not odd, f"evictable set disagrees with cached blocks at {odd}"


def _base_blocks(ids: list[int], meta: BlockMeta) -> list[int]:
    """The base blocks of blocks ``ids``, block by block."""
    return [u for b in ids for u in range(b, b + meta.span(b))]
