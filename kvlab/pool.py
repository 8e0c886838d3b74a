"""BlockPool: fixed-size blocks carved from one KV tensor (text §2.2.2 "块池管理", §2.2.5 batch operations).

Lifecycle of a block (see :mod:`kvlab.block` for the enforced state machine)::

    FREE --allocate--> ALLOCATED(refs=1) --incref/decref--> ALLOCATED(refs>=1)
    ALLOCATED --free, refs->0, not reusable--> FREE                     (data gone)
    ALLOCATED --free/decref, refs->0, reusable--> ALLOCATED(refs=0) = *cached*, evictable
    cached --incref (e.g. a prefix-cache hit)--> ALLOCATED(refs=1)   (data reused, nothing recomputed)
    cached --evict (policy's victim)--> FREE
    FREE --reserve--> PENDING --commit--> ALLOCATED;  ALLOCATED --begin_eviction--> EVICTING --finish--> FREE

Invariants (checked by :meth:`BlockPool.check_invariants`, after every step of the property tests):

* every base block is in exactly one block, blocks are buddy-aligned, and FREE + PENDING + ALLOCATED + EVICTING
  base blocks == ``num_blocks``;
* a block is in a free list iff it is FREE, and in the eviction policy's set iff it is cached;
* refcount >= 0 everywhere, and a FREE block has refcount 0, token_count 0, owner -1 and is not reusable.

Metadata lives in flat ``array.array`` / ``bytearray`` buffers (fast single-element access from Python) with
zero-copy numpy views (vectorised batch operations, snapshots for widgets); a :class:`KVBlock` is only a view
onto them. Allocating or freeing 9 or more base blocks writes metadata with numpy, as slices when the ids form
a run ``lo..hi-1`` (the free stack hands out lowest ids first, so runs are common).
Size classes: a pool built with ``block_sizes=[16, 32, 64]`` has base blocks of 16 tokens and blocks of order
``k`` spanning ``2**k`` base blocks, split from and merged back into larger buddies. A block's id is the index
of its first base block. The default pool has one size (order 0 only): the uniform paged case.

Every public mutation takes the pool's lock once (batch operations included), ticks the clock once, and
publishes one typed event per effect (see :mod:`kvlab.events`).

Allocating one base block and freeing a one-block list are the hottest calls; where kvlab was built with a C
compiler, a compiled twin of just those two branches (``kvlab/_hotpath.c``) answers ``pool.allocate`` and
``pool.free`` and hands every other call to the methods below, which stay the reference.
"""
from __future__ import annotations

import hashlib
import operator
import os
import threading
import warnings
from itertools import islice
from array import array
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import events as ev
from .block import BlockStatus, KVBlock
from .clock import Clock, LogicalClock
from .errors import (ConfigError, DoubleFreeError, IllegalTransitionError, KVDataError, OutOfBlocksError,
                     RefcountUnderflowError, UnknownBlockError)
from .eviction import EvictionPolicy, make_policy
from .spec import KVSpec
from .storage import KVStorage

FREE, PENDING, ALLOCATED, EVICTING = (int(s) for s in BlockStatus)
_NAMES = [s.name for s in BlockStatus]
_ALLOCATED_BYTE = bytes([ALLOCATED])
_ONE_REF = np.ones(1, dtype=np.int32).tobytes()  # one refcount as the refs array stores it
# Crossovers timed on the development machine: the allocate/free fast paths match scalar Python at 8 blocks and
# win from there on; the general vectorised paths (validation, repeats, all or nothing) only from about 33.
_FAST_MIN, _SCALAR_MAX = 9, 32
_INT32_MAX = 2**31 - 1  # owners are stored as int32

Ids = Sequence[int] | np.ndarray | torch.Tensor


def _load_hotpath(source: Path = Path(__file__).with_name("_hotpath.c")) -> type | None:
    """The compiled twin of :meth:`BlockPool.allocate` / :meth:`BlockPool.free`'s single-block paths
    (``kvlab/_hotpath.c``, built when kvlab is installed), or None: not built (no C compiler), switched off with
    ``KVLAB_PURE_PYTHON=1`` (to step through the Python in a debugger), or built from another version of
    ``source`` (a warning then says to reinstall)."""
    if os.environ.get("KVLAB_PURE_PYTHON"):
        return None
    try:
        from ._hotpath import SOURCE_SHA256, HotPath
    except ImportError:
        return None
    if source.exists() and hashlib.sha256(source.read_bytes()).hexdigest() != SOURCE_SHA256:
        warnings.warn(f"{source} changed after it was compiled; reinstall kvlab (`make install`) to rebuild it. "
                      "Using the Python paths meanwhile.", stacklevel=2)
        return None
    return HotPath


HotPath = _load_hotpath()


def _is_owner(owner: Any) -> bool:
    """Whether the int32 owner field can store ``owner`` (-1 = no one)."""
    return type(owner) is int and -1 <= owner <= _INT32_MAX


def _check_owner(owner: Any) -> int:
    """``owner`` as the int32 owner field stores it, else :class:`ConfigError`."""
    if not _is_owner(owner):
        raise ConfigError(f"owner must be an int in -1..{_INT32_MAX} (-1 = no one), got {owner!r}")
    return owner


def _zeros(code: str, n: int) -> tuple[array | bytearray, np.ndarray]:
    """A zeroed buffer for scalar access from Python plus a zero-copy numpy view of it. Byte fields are a
    ``bytearray``, whose item stores cost about two thirds of an ``array('B')``'s."""
    a = bytearray(n) if code == "B" else array(code, bytes(n * array(code).itemsize))
    return a, np.frombuffer(a, dtype=np.uint8 if code == "B" else np.int64 if code == "q" else code)


class BlockPool:
    """A pool of ``num_blocks`` fixed-size KV blocks (or of ``total_memory`` bytes) with states, refcounts,
    an eviction policy, batch operations and events.

    Args:
        num_blocks: number of base blocks; or give ``total_memory`` (bytes) instead.
        spec: the :class:`KVSpec` (model shape, block size, dtype, device). Default: a small spec.
        total_memory: the text's budget in bytes; ``num_blocks = total_memory // spec.bytes_per_block``.
        block_sizes: the text's size classes in tokens, each a power-of-two multiple of the smallest (which
            becomes ``spec.block_size``). Default: one size, ``spec.block_size``.
        eviction_policy: ``"lru"``, ``"fifo"``, ``"lfu"``, ``"random"`` or an :class:`EvictionPolicy`.
        clock: default a :class:`LogicalClock` ticking once per public mutation.
        with_storage: False builds a metadata-only pool (no tensor), for large simulations.
        seed: seeds the random policy.
    """

    def __init__(self, num_blocks: int | None = None, *, spec: KVSpec | None = None,
                 total_memory: int | None = None, block_sizes: Sequence[int] | None = None,
                 eviction_policy: str | EvictionPolicy = "lru", clock: Clock | None = None,
                 with_storage: bool = True, seed: int = 0) -> None:
        spec = spec or KVSpec()
        if block_sizes is not None:
            sizes = sorted(set(block_sizes))
            if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
                raise ConfigError(f"block_sizes must be positive ints, got {list(block_sizes)!r}")
            base = sizes[0]
            bad = [s for s in sizes if s % base or (s // base) & (s // base - 1)]
            if bad:
                raise ConfigError(f"block sizes {bad} are not power-of-two multiples of the smallest, {base}")
            spec = replace(spec, block_size=base)
            self.max_order = (sizes[-1] // base).bit_length() - 1
        else:
            self.max_order = 0
        if (num_blocks is None) == (total_memory is None):
            raise ConfigError("give exactly one of num_blocks or total_memory")
        if total_memory is not None:
            num_blocks = spec.blocks_for_budget(total_memory)
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ConfigError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.spec, self.num_blocks, self.block_size = spec, num_blocks, spec.block_size
        self.bytes_per_block = spec.bytes_per_block
        self.block_sizes = [spec.block_size << k for k in range(self.max_order + 1)]
        self.storage = KVStorage(spec, num_blocks) if with_storage else None

        n = num_blocks
        self._status, self.status_np = _zeros("B", n)
        self._order, self.order_np = _zeros("B", n)
        self._refs, self.refs_np = _zeros("i", n)
        self._tokens, self.tokens_np = _zeros("i", n)
        self._last, self.last_np = _zeros("q", n)
        self._created, self.created_np = _zeros("q", n)
        self._hits, self.hits_np = _zeros("q", n)
        self._owner, self.owner_np = _zeros("i", n)
        self.owner_np[:] = -1
        self._reusable, self.reusable_np = _zeros("B", n)
        # Batch-path helpers: duplicate detection without sorting, and recognising runs lo..hi-1 of ids (as a
        # caller's list, and as they sit on a free stack) so that metadata writes become slices.
        self._scratch = np.zeros(n, dtype=np.uint32)
        self._arange32 = np.arange(n, dtype=np.uint32)
        self._desc32 = np.arange(n - 1, -1, -1, dtype=np.int32)
        # The int objects for ids below 65,536, shared by the lists the batch paths hand out: slicing this list
        # costs a quarter of list(range(...)), and comparing a caller's list with a slice of it recognises a
        # run without converting the list (the way CPython caches small ints, for the same reason).
        self._id_objs = list(range(min(n, 1 << 16)))
        # One free stack per order, popped from the end; lowest ids come out first. Changed in place, never
        # replaced: the compiled hot path holds the order-0 stack.
        self._free: list[array] = [array("i") for _ in range(self.max_order + 1)]
        self._carve(0, n)

        self.lock = threading.RLock()
        self.clock: Clock = clock or LogicalClock()
        if not isinstance(now := self.clock.now(), int):
            raise ConfigError(f"the clock must count in ints (stamps are int64), but now() gave {now!r}")
        self.events = ev.EventBus()
        self.policy = make_policy(eviction_policy, seed).bind(self)
        self.eviction_policy = self.policy.name
        self.evict_guard: Callable[[int], bool] | None = None  # may veto a victim (prefix-chain order)
        self.evict_hooks: list[Callable[[int], None]] = []  # told which block was evicted
        self.relocation_hooks: list[Callable[[np.ndarray, np.ndarray], None]] = []  # told src -> dst moves
        self._locks = 0  # lock acquisitions outside the hot paths (see lock_acquisitions)
        self._subs = self.events.subscribers  # the bus's own list: a truthiness test skips building events
        self._hot_allocs = self._hot_frees = 0  # hot-path counters (int attributes are cheaper than dict items)
        self._counts = {"allocations": 0, "frees": 0, "evictions": 0, "splits": 0, "merges": 0,
                        "migrations": 0, "decrefs": 0, "served_free": 0, "served_split": 0, "served_evict": 0}
        self._hot = None
        if HotPath is not None and type(self).allocate is BlockPool.allocate and type(self).free is BlockPool.free:
            # The compiled single-block paths answer pool.allocate / pool.free and hand every other call to the
            # methods below; they share this pool's lock, free stack, clock and buffers.
            self._hot = HotPath(
                pool=self, allocate=BlockPool.allocate, free=BlockPool.free, lock=self.lock, stack=self._free[0],
                subscribers=self._subs, clock=self.clock,
                step_slot=LogicalClock.step if type(self.clock) is LogicalClock else None,
                status=self._status, refs=self._refs, hits=self._hits, last=self._last, created=self._created,
                owner=self._owner, tokens=self._tokens, reusable=self._reusable, num_blocks=n,
                uniform=not self.max_order, free_code=FREE, allocated_code=ALLOCATED)
            self.allocate, self.free = self._hot.allocate, self._hot.free

    def _carve(self, start: int, stop: int) -> None:
        """Tile base blocks [start, stop) with the largest aligned free blocks and push them (lowest on top)."""
        tiles = []
        u = start
        while u < stop:
            o = self.max_order
            while o and (u & ((1 << o) - 1) or u + (1 << o) > stop):
                o -= 1
            tiles.append((u, o))
            u += 1 << o
        if self.max_order == 0:
            self._free[0].extend(range(stop - 1, start - 1, -1))
            return
        for u, o in reversed(tiles):
            self.order_np[u:u + (1 << o)] = o
            self._free[o].append(u)

    # ------------------------------------------------------------------ ids and views
    def _check_id(self, block_id: Any) -> int:
        """``block_id`` as an int naming the first base block of a block, else :class:`UnknownBlockError`."""
        try:
            b = operator.index(block_id)
        except TypeError:
            raise UnknownBlockError(f"block id must be an int, got {block_id!r}") from None
        if not 0 <= b < self.num_blocks:
            raise UnknownBlockError(f"block {b} is not in this pool (ids 0..{self.num_blocks - 1})")
        if b & ((1 << self._order[b]) - 1):
            raise UnknownBlockError(f"block {b} is inside block {b & ~((1 << self._order[b]) - 1)} "
                                    f"of size class {self._order[b]}, not the start of a block")
        return b

    def _ids(self, ids: Ids) -> np.ndarray:
        """Validated int64 array of block ids."""
        if isinstance(ids, torch.Tensor):
            ids = ids.cpu().numpy()
        if isinstance(ids, list):
            try:  # array('I') converts ~3x faster than array('q'); a negative id falls through to 'q'
                a = np.frombuffer(array("I", ids), dtype=np.uint32).astype(np.int64)
            except (TypeError, OverflowError):
                try:
                    a = np.frombuffer(array("q", ids), dtype=np.int64)
                except (TypeError, OverflowError):
                    raise UnknownBlockError(f"block ids must be ints in 0..{self.num_blocks - 1}, "
                                            f"got {ids!r}") from None
        else:
            a = np.asarray(ids)
            if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                raise UnknownBlockError(f"block ids must be a 1-D sequence of ints, got {ids!r}")
            a = a.astype(np.int64, copy=False)
        if a.size:
            if a.max() >= self.num_blocks or a.min() < 0:
                bad = (a < 0) | (a >= self.num_blocks)
                raise UnknownBlockError(f"block {int(a[bad][0])} is not in this pool (ids 0..{self.num_blocks - 1})")
            if self.max_order:
                for b in a[(a & ((1 << self.order_np[a].astype(np.int64)) - 1)) != 0]:
                    self._check_id(int(b))
        return a

    def _distinct(self, a: np.ndarray) -> bool:
        """Whether in-range ids ``a`` hold no repeats: two scatters and a bytes comparison, no sort."""
        pos = self._arange32[:a.size]
        self._scratch[a] = pos
        return self._scratch[a].tobytes() == pos.tobytes()

    def block(self, block_id: int) -> KVBlock:
        """A :class:`KVBlock` view of ``block_id``."""
        return KVBlock(self, block_id)

    def storage_of(self) -> KVStorage:
        if self.storage is None:
            raise ConfigError("this pool is metadata-only (with_storage=False): it has no KV tensor")
        return self.storage

    def span(self, block_id: int) -> int:
        """Number of base blocks in ``block_id``."""
        return 1 << self._order[block_id]

    @property
    def lock_acquisitions(self) -> int:
        """How many times a public mutation took the pool lock (one per call, batch calls included)."""
        return self._locks + sum(self._hot_counts())

    def _hot_counts(self) -> tuple[int, int]:
        """Single-block allocations and frees served by the hot paths, in Python and in C."""
        if self._hot is None:
            return self._hot_allocs, self._hot_frees
        return self._hot_allocs + self._hot.allocs, self._hot_frees + self._hot.frees

    @property
    def num_free_blocks(self) -> int:
        """FREE base blocks."""
        return sum(len(f) << o for o, f in enumerate(self._free))

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with refcount 0 that keep reusable data (evictable)."""
        return len(self.policy)

    def __len__(self) -> int:
        return self.num_blocks

    def __repr__(self) -> str:
        return (f"BlockPool({self.num_blocks} blocks x {self.block_size} tokens, free={self.num_free_blocks}, "
                f"cached={len(self.policy)}, policy={self.policy.name}, device={self.spec.device})")

    # ------------------------------------------------------------------ events and bookkeeping helpers
    def _set_status(self, b: int, s: int) -> None:
        if self._order[b]:
            self.status_np[b:b + (1 << self._order[b])] = s
        else:
            self._status[b] = s

    def _push_free(self, b: int) -> None:
        """Block ``b`` becomes FREE: metadata reset, pushed on its order's free stack."""
        self._set_status(b, FREE)
        self._refs[b] = self._tokens[b] = self._reusable[b] = 0
        self._owner[b] = -1
        self._free[self._order[b]].append(b)

    def _pop_exact(self, b: int) -> None:
        """Remove FREE block ``b`` from its free stack (O(free blocks of its order), rare path)."""
        self._free[self._order[b]].remove(b)

    def _publish(self, event: ev.Event) -> None:
        self.events.publish(event)

    # ------------------------------------------------------------------ allocation
    def _capacity_for(self, order: int) -> int:
        """How many blocks of ``order`` the free lists plus the evictable set could yield right now."""
        free = sum(len(self._free[o]) << (o - order) for o in range(order, self.max_order + 1))
        if not self.max_order:
            return free + len(self.policy)
        return free + sum(1 << (self._order[b] - order) for b, _ in self.policy.order() if self._order[b] >= order)

    def _take(self, order: int) -> tuple[int, str]:
        """One FREE block of ``order``: from its free stack, else by splitting a larger one, else by evicting."""
        if self._free[order]:
            b = self._free[order].pop()
            return b, "free"
        for o in range(order + 1, self.max_order + 1):
            if self._free[o]:
                b = self._free[o][-1]
                while self._order[b] > order:
                    self._split(b)
                return self._take(order)[0], "split"
        if self._evict_one("allocation pressure", min_order=order) is None:
            raise OutOfBlocksError(f"no block of size class {order} ({self.block_size << order} tokens) is free "
                                   f"or evictable")
        return self._take(order)[0], "evict"

    def allocate(self, n: int = 1, *, size_class: int = 0, owner: int = -1,
                 status: BlockStatus = BlockStatus.ALLOCATED) -> list[int]:
        """Allocate ``n`` blocks of ``size_class`` (refcount 1 each) in one lock acquisition; evicts cached blocks
        when the free lists run dry. All or nothing: raises :class:`OutOfBlocksError` and changes nothing if the
        pool cannot supply ``n``. ``status=PENDING`` reserves blocks whose data is still to arrive."""
        lock = self.lock
        lock.acquire()  # acquire/release is ~2x cheaper than `with` on the hot path
        try:
            if (n == 1 and not size_class and self._free[0] and status == ALLOCATED  # hot path: one base block
                    and (owner == -1 or _is_owner(owner))):
                b = self._free[0].pop()  # _pop_one inlined: a method call is a tenth of this path
                t = self.clock.tick()
                self._status[b] = ALLOCATED
                self._refs[b] = self._hits[b] = 1
                self._last[b] = self._created[b] = t
                if owner != -1:
                    self._owner[b] = owner
                self._hot_allocs += 1
                if self._subs:
                    self._publish(ev.Allocated(t, (b,), 0, owner, "ALLOCATED", "free"))
                return [b]
            self._locks += 1
            return self._allocate_many(n, size_class, owner, status)
        finally:
            lock.release()

    def _allocate_many(self, n: int, order: int, owner: int, status: int) -> list[int]:
        if not isinstance(n, int) or n < 0:
            raise ConfigError(f"number of blocks must be an int >= 0, got {n!r}")
        if not isinstance(order, int) or not 0 <= order <= self.max_order:
            raise ConfigError(f"size_class {order!r} is not one of this pool's 0..{self.max_order} "
                              f"(block sizes {self.block_sizes})")
        if status not in (ALLOCATED, PENDING):
            raise IllegalTransitionError(f"allocation ends in ALLOCATED or PENDING, not {_NAMES[status]}")
        _check_owner(owner)
        if n > len(self._free[order]) and n > self._capacity_for(order):
            raise OutOfBlocksError(
                f"asked for {n} blocks of {self.block_size << order} tokens; the pool has "
                f"{self.num_free_blocks} free base blocks and {len(self.policy)} evictable of {self.num_blocks}")
        t, status = self.clock.tick(), int(status)
        if not order and len(self._free[0]) >= n:  # enough FREE base blocks: no split, no eviction
            out = self._pop_many(n, t, owner, status) if n >= _FAST_MIN else [self._pop_one(t, owner, status)
                                                                     for _ in range(n)]
            self._counts["served_free"] += n
            how = "free"
        else:
            out, served = [], {}
            for _ in range(n):
                b, how = self._take(order)
                self._set_status(b, status)
                self._refs[b] = self._hits[b] = 1
                self._last[b] = self._created[b] = t
                self._owner[b] = owner
                out.append(b)
                served[how] = served.get(how, 0) + 1
            for how, k in served.items():
                self._counts["served_" + how] += k
            how = max(served, key=served.get, default="free")
        self._counts["allocations"] += n
        if self._subs and n:
            self._publish(ev.Allocated(t, tuple(out), order, owner, _NAMES[status], how))
        return out

    def _pop_one(self, t: int, owner: int, status: int) -> int:
        """Take the top base block of the free stack (for batches below ``_FAST_MIN`` blocks)."""
        b = self._free[0].pop()
        self._status[b] = status
        self._refs[b] = self._hits[b] = 1
        self._last[b] = self._created[b] = t
        if owner != -1:  # FREE blocks already have owner -1
            self._owner[b] = owner
        return b

    def _pop_many(self, n: int, t: int, owner: int, status: int) -> list[int]:
        """Take the top ``n`` base blocks of the free stack with vectorised metadata writes: slices when they
        form a run (the stack hands out lowest ids first, so runs are common), fancy indexing otherwise."""
        free = self._free[0]
        top = free[-1]
        chunk = free[-n:]
        del free[-n:]
        hi = self.num_blocks - top  # the run top..top+n-1 sits on the stack as _desc32[hi-n:hi]
        if chunk.tobytes() == self._desc32[max(hi - n, 0):hi].tobytes():
            ix: slice | np.ndarray = slice(top, top + n)
            out = self._id_objs[top:top + n] if top + n <= len(self._id_objs) else list(range(top, top + n))
        else:
            ix = np.frombuffer(chunk, dtype=np.int32)[::-1].astype(np.int64)
            out = ix.tolist()
        self.status_np[ix] = status
        self.refs_np[ix] = 1
        self.hits_np[ix] = 1
        self.last_np[ix] = t
        self.created_np[ix] = t
        if owner != -1:
            self.owner_np[ix] = owner
        return out

    def reserve(self, n: int = 1, *, size_class: int = 0, owner: int = -1) -> list[int]:
        """Allocate ``n`` blocks as PENDING (owned, data still arriving); :meth:`commit` makes them ALLOCATED."""
        return self.allocate(n, size_class=size_class, owner=owner, status=BlockStatus.PENDING)

    def get_best_block(self, required_size: int) -> KVBlock | None:
        """The smallest FREE block whose capacity is at least ``required_size`` bytes, without taking it
        (the text's method; the text's pool never held any block, so it always returned None)."""
        if not isinstance(required_size, int) or required_size < 0:
            raise ConfigError(f"required_size must be a byte count >= 0, got {required_size!r}")
        with self.lock:
            for o in range(self.max_order + 1):
                if self.bytes_per_block << o >= required_size and self._free[o]:
                    return KVBlock(self, self._free[o][-1])
            return None

    def allocate_block(self, block_id: int | None = None, kv_data: torch.Tensor | None = None,
                       owner: int = -1) -> KVBlock:
        """Allocate FREE block ``block_id`` (or the best block for ``kv_data``, or any block) and write
        ``kv_data`` ``[2, layers, t, heads, dim]`` into its first ``t`` slots. Nothing changes on error."""
        with self.lock:
            _check_owner(owner)
            if kv_data is not None:
                self._check_kv(kv_data, block_id)
            if block_id is None:
                need = 0 if kv_data is None else kv_data.shape[2] * self.spec.bytes_per_token
                order = next((o for o in range(self.max_order + 1) if self.bytes_per_block << o >= need), None)
                if order is None:
                    raise KVDataError(f"{kv_data.shape[2]} tokens exceed the largest block "
                                      f"({self.block_sizes[-1]} tokens)")
                b = self._allocate_many(1, order, owner, ALLOCATED)[0]
            else:
                b = self._check_id(block_id)
                BlockStatus.check(b, self._status[b], ALLOCATED)
                self._pop_exact(b)
                t = self.clock.tick()
                self._set_status(b, ALLOCATED)
                self._refs[b] = self._hits[b] = 1
                self._last[b] = self._created[b] = t
                self._owner[b] = owner
                self._counts["allocations"] += 1
                self._counts["served_free"] += 1
                if self._subs:
                    self._publish(ev.Allocated(t, (b,), self._order[b], owner, "ALLOCATED", "free"))
            self._locks += 1
            if kv_data is not None:
                t = kv_data.shape[2]
                self.storage_of().block_view(b, self.span(b))[:, :, :t].copy_(kv_data)
                self._tokens[b] = t
            return KVBlock(self, b)

    def _check_kv(self, kv: torch.Tensor, block_id: int | None) -> None:
        s = self.spec
        if not isinstance(kv, torch.Tensor):
            raise KVDataError(f"kv_data must be a torch.Tensor, got {type(kv).__name__}")
        want = (2, s.num_layers, s.num_kv_heads, s.head_dim)
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
            raise KVDataError(f"kv_data has shape {list(kv.shape)}, expected [2, {s.num_layers}, tokens, "
                              f"{s.num_kv_heads}, {s.head_dim}]")
        if kv.dtype != s.dtype or kv.device != self.storage_of().kv.device:
            raise KVDataError(f"kv_data is {kv.dtype} on {kv.device}; the pool stores {s.dtype} on {s.device}")
        if block_id is not None:
            b = self._check_id(block_id)
            if kv.shape[2] > self.block_size << self._order[b]:
                raise KVDataError(f"kv_data holds {kv.shape[2]} tokens but block {b} holds "
                                  f"{self.block_size << self._order[b]}")

    # ------------------------------------------------------------------ references and release
    def free(self, ids: Ids) -> None:
        """Drop one reference from each block; a block reaching 0 is released: FREE, or cached (evictable) if
        marked reusable. A PENDING block is aborted back to FREE. Raises :class:`DoubleFreeError` for a FREE
        or cached block (nothing to drop) and changes nothing."""
        lock = self.lock
        lock.acquire()
        try:
            if type(ids) is list and len(ids) == 1 and not self.max_order:  # hottest path: one base block
                b = ids[0]
                s = self._status[b] if type(b) is int and 0 <= b < self.num_blocks else -1
                r = self._refs[b] if s == ALLOCATED else 0
                if r == 1 and not self._reusable[b]:
                    self._status[b] = FREE
                    self._refs[b] = self._tokens[b] = 0
                    self._owner[b] = -1
                    self._free[0].append(b)
                    self._hot_frees += 1
                    t = self.clock.tick()
                    if self._subs:
                        self._publish(ev.Freed(t, (b,)))
                    return
            if type(ids) is list and len(ids) >= _FAST_MIN and not self.max_order and self._free_many(ids):
                return
            few = self._few(ids)  # everything else, including every error, takes the general paths
            if few is not None:
                self._release_few(few, free=True)
            else:
                self._locks += 1
                self._release(self._ids(ids), free=True)
        finally:
            lock.release()

    def _free_many(self, ids: list) -> bool:
        """:meth:`free` of a long list of distinct base blocks that each hold their only reference and keep no
        reusable data (a finished sequence): the common case, in about a dozen numpy calls, with slices when
        the ids are a run. Returns False, having changed nothing, for any other list; the general path then
        serves or rejects it."""
        n, lo, v = len(ids), ids[0], None
        run = type(lo) is int and 0 <= lo and lo + n <= len(self._id_objs) and ids == self._id_objs[lo:lo + n]
        if run:
            at: slice | np.ndarray = slice(lo, lo + n)
        else:
            try:  # array('I') converts ~3x faster than array('q') or np.asarray, and refuses negatives, non-ints
                v = np.frombuffer(array("I", ids), dtype=np.uint32)
            except (TypeError, OverflowError):
                return False
            at = v.astype(np.int64)
        try:
            if (self.status_np[at].tobytes() != _ALLOCATED_BYTE * n  # IndexError: an id past the end
                    or self.refs_np[at].tobytes() != _ONE_REF * n
                    or self.reusable_np[at].tobytes() != bytes(n)
                    or not (run or self._distinct(at))):
                return False
        except IndexError:
            return False
        t = self.clock.tick()
        self.status_np[at] = FREE
        self.refs_np[at] = 0
        self.tokens_np[at] = 0
        self.owner_np[at] = -1
        hi = self.num_blocks - lo  # push the first id on top, as _carve does, so runs survive reuse
        self._free[0].frombytes(self._desc32[hi - n:hi].tobytes() if v is None else v[::-1].tobytes())
        self._locks += 1
        self._counts["frees"] += n
        if self._subs:
            self._publish(ev.Freed(t, tuple(ids)))
        return True

    def _few(self, ids: Ids) -> list[int] | None:
        """``ids`` as validated distinct ints when the scalar path applies (a short list or tuple without
        repeats); None sends the call down the vectorised path. Scalar Python beats numpy's per-call overhead
        below a few dozen blocks."""
        if type(ids) not in (list, tuple) or len(ids) > _SCALAR_MAX:
            return None
        try:
            if len(set(ids)) != len(ids):
                return None
        except TypeError:  # an unhashable "id": the general path rejects it with a typed error
            return None
        n, out = self.num_blocks, []
        for b in ids:
            if type(b) is not int or not 0 <= b < n or self.max_order:
                b = self._check_id(b)
            out.append(b)
        return out

    def _release_few(self, ids: list[int], free: bool) -> None:
        """Scalar :meth:`free` / :meth:`decref` of distinct blocks: validate all, then apply."""
        status, refs = self._status, self._refs
        for b in ids:
            s = status[b]
            if free and (s == FREE or s == EVICTING or (s == ALLOCATED and not refs[b])):
                raise DoubleFreeError(self._double_free_msg(b))
            if not free and s != ALLOCATED:
                raise IllegalTransitionError(f"block {b} is {_NAMES[s]}: only ALLOCATED blocks hold references")
            if not free and not refs[b]:
                raise RefcountUnderflowError(f"block {b} has refcount 0; there is no reference to drop")
        t = self.clock.tick()
        if free:
            self._hot_frees += 1
            self._counts["frees"] += len(ids) - 1  # one is counted by _hot_frees
        else:
            self._locks += 1
            self._counts["decrefs"] += len(ids)
        left, kept, freed = [], [], []
        for b in ids:  # a block going FREE keeps its last access time: releasing it is not an access
            r = refs[b] = refs[b] - 1
            if r:
                self._last[b] = t
                left.append(b)
            elif status[b] == ALLOCATED and (not free or self._reusable[b]):
                self._last[b] = t
                self.policy.add(b)
                kept.append(b)
            else:
                freed.append(b)
        for b in reversed(freed):  # the first id ends on top of the free stack, as in every free path
            self._push_free(b)
        if self._subs:
            if left:
                self._publish(ev.RefChanged(t, tuple(left), -1, tuple(refs[b] for b in left)))
            if kept:
                self._publish(ev.Cached(t, tuple(kept)))
            if freed:
                self._publish(ev.Freed(t, tuple(freed)))

    def _unique(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray | int]:
        """``(distinct ids, multiplicities)``; the common no-duplicate case costs two scatters, not a sort."""
        if self._distinct(a):
            return a, 1
        return np.unique(a, return_counts=True)

    def _double_free_msg(self, b: int) -> str:
        s = self._status[b]
        what = "cached (refcount 0)" if s == ALLOCATED else _NAMES[s]
        return f"block {b} is {what}: it holds no reference to release (double free?)"

    def _release(self, a: np.ndarray, free: bool) -> None:
        """Vectorised decref of ``a`` (duplicates allowed while refcounts last); zeros are freed or cached."""
        if not a.size:
            return
        st = self.status_np[a]
        uniq, counts = self._unique(a)
        refs = self.refs_np[uniq]
        ok_state = (st == ALLOCATED) | ((st == PENDING) if free else False)
        if not ok_state.all() or (refs < counts).any():
            bad = int(a[~ok_state][0]) if not ok_state.all() else int(uniq[refs < counts][0])
            if free:
                raise DoubleFreeError(self._double_free_msg(bad) if self._refs[bad] == 0 or not ok_state.all()
                                      else f"block {bad} released more times than its refcount "
                                           f"{self._refs[bad]} in one call")
            if self._status[bad] != ALLOCATED:
                raise IllegalTransitionError(f"block {bad} is {_NAMES[self._status[bad]]}: only ALLOCATED blocks "
                                             f"hold references")
            raise RefcountUnderflowError(f"block {bad} has refcount {self._refs[bad]}; this call drops more "
                                         f"references than it holds")
        t = self.clock.tick()
        new = refs - counts
        self.refs_np[uniq] = new
        self._counts["frees" if free else "decrefs"] += a.size
        zero = uniq[new == 0]
        kept = self.status_np[zero] == ALLOCATED
        if free:
            kept &= self.reusable_np[zero] == 1
        keep, gone = zero[kept], zero[~kept]
        self.last_np[uniq[new > 0]] = t  # blocks going FREE keep their last access time
        self.last_np[keep] = t
        for b in keep.tolist():
            self.policy.add(b)
        if gone.size:
            if self.max_order:
                for b in gone.tolist():
                    self._push_free(b)
            else:
                self.status_np[gone] = FREE
                self.tokens_np[gone] = 0
                self.reusable_np[gone] = 0
                self.owner_np[gone] = -1
                self._free[0].frombytes(gone[::-1].astype(np.int32).tobytes())
        if self._subs:
            left = uniq[new > 0]
            if left.size:
                self._publish(ev.RefChanged(t, tuple(left.tolist()), -1, tuple(self.refs_np[left].tolist())))
            if keep.size:
                self._publish(ev.Cached(t, tuple(keep.tolist())))
            if gone.size:
                self._publish(ev.Freed(t, tuple(gone.tolist())))

    def decref(self, ids: Ids) -> None:
        """Drop one reference from each block; at 0 a block keeps its data and becomes cached (evictable).
        Raises :class:`RefcountUnderflowError` (refcount already 0) and changes nothing."""
        with self.lock:
            few = self._few(ids)
            if few is not None:
                self._release_few(few, free=False)
            else:
                self._locks += 1
                self._release(self._ids(ids), free=False)

    def release_block(self, block_id: int) -> None:
        """The text's name for releasing one block: :meth:`free` of ``[block_id]``."""
        self.free([block_id])

    def incref(self, ids: Ids) -> None:
        """Add one reference to each block (duplicates add several). A cached block becomes referenced again
        and leaves the evictable set: this is how a prefix-cache hit reuses data instead of recomputing it."""
        with self.lock:
            self._locks += 1
            few = self._few(ids)
            if few is not None:
                self._incref_few(few)
                return
            a = self._ids(ids)
            if not a.size:
                return
            st = self.status_np[a]
            if (st != ALLOCATED).any():
                b = int(a[st != ALLOCATED][0])
                raise IllegalTransitionError(f"block {b} is {_NAMES[self._status[b]]}: only ALLOCATED blocks "
                                             f"can be referenced")
            t = self.clock.tick()
            uniq, counts = self._unique(a)
            was = self.refs_np[uniq]
            for b in uniq[was == 0].tolist():
                self.policy.discard(b)
            self.refs_np[uniq] = was + counts
            self.hits_np[uniq] += counts
            self.last_np[uniq] = t
            if self._subs:
                self._publish(ev.RefChanged(t, tuple(uniq.tolist()), 1, tuple(self.refs_np[uniq].tolist())))

    def _incref_few(self, ids: list[int]) -> None:
        status, refs = self._status, self._refs
        for b in ids:
            if status[b] != ALLOCATED:
                raise IllegalTransitionError(f"block {b} is {_NAMES[status[b]]}: only ALLOCATED blocks "
                                             f"can be referenced")
        t = self.clock.tick()
        for b in ids:
            if not refs[b]:
                self.policy.discard(b)
            refs[b] += 1
            self._hits[b] += 1
            self._last[b] = t
        if self._subs and ids:
            self._publish(ev.RefChanged(t, tuple(ids), 1, tuple(refs[b] for b in ids)))

    def touch(self, ids: Ids) -> None:
        """Record an access (attention read) without changing references: LRU time and LFU count."""
        with self.lock:
            a = self._ids(ids)
            self.last_np[a] = self.clock.tick()
            self.hits_np[a] += 1

    def mark_reusable(self, ids: Ids, reusable: bool = True) -> None:
        """Mark blocks whose data is worth keeping at refcount 0 (e.g. full prefix-cache blocks)."""
        with self.lock:
            a = self._ids(ids)
            st = self.status_np[a]
            if (st == FREE).any():
                raise IllegalTransitionError(f"block {int(a[st == FREE][0])} is FREE: it holds no data to keep")
            self.reusable_np[a] = int(reusable)
            if not reusable:  # cached blocks that lose their value are released at once
                for b in a[(self.refs_np[a] == 0) & (st == ALLOCATED)].tolist():
                    self.policy.discard(b)
                    self._push_free(b)

    def set_token_count(self, block_id: int, count: int) -> None:
        """Number of filled slots of ``block_id`` (sequences update it as they append)."""
        with self.lock:
            b = self._check_id(block_id)
            if not isinstance(count, (int, np.integer)) or not 0 <= count <= self.block_size << self._order[b]:
                raise KVDataError(f"block {b} holds at most {self.block_size << self._order[b]} tokens, "
                                  f"not {count!r}")
            if self._status[b] == FREE:
                raise IllegalTransitionError(f"block {b} is FREE: it has no tokens to count")
            self._tokens[b] = count

    def set_owner(self, ids: Ids, owner: int) -> None:
        """Record who holds the blocks (shown by widgets; a shared block shows its last owner)."""
        with self.lock:
            a = self._ids(ids)
            free = a[self.status_np[a] == FREE]
            if free.size:
                raise IllegalTransitionError(f"block {int(free[0])} is FREE: no one holds it")
            self.owner_np[a] = _check_owner(owner)

    # ------------------------------------------------------------------ state machine beyond alloc/free
    def commit(self, ids: Ids) -> None:
        """PENDING -> ALLOCATED (data has arrived)."""
        self._transition(ids, ALLOCATED, expect=PENDING)

    def begin_eviction(self, ids: Ids) -> None:
        """ALLOCATED -> EVICTING: the data is about to leave (eviction, swap-out); no one may take the block."""
        self._transition(ids, EVICTING, expect=ALLOCATED)

    def finish_eviction(self, ids: Ids) -> None:
        """EVICTING -> FREE: the data has left."""
        self._transition(ids, FREE, expect=EVICTING)

    def _transition(self, ids: Ids, new: int, expect: int) -> None:
        with self.lock:
            self._locks += 1
            a = self._ids(ids)
            for b in a.tolist():
                BlockStatus.check(b, self._status[b], new)
                if self._status[b] != expect:
                    raise IllegalTransitionError(f"block {b} is {_NAMES[self._status[b]]}, expected "
                                                 f"{_NAMES[expect]} for -> {_NAMES[new]}")
            if len(set(a.tolist())) != a.size:
                raise IllegalTransitionError(f"block ids repeat in {a.tolist()}")
            t = self.clock.tick()
            for b in a.tolist():
                self.policy.discard(b)
                if new == FREE:
                    self._push_free(b)
                else:
                    self._set_status(b, new)
                    self._last[b] = t
            if self._subs and a.size:
                self._publish(ev.StatusChanged(t, tuple(a.tolist()), _NAMES[expect], _NAMES[new]))

    # ------------------------------------------------------------------ eviction
    def _evict_one(self, reason: str, min_order: int = 0) -> int | None:
        """Evict the policy's first acceptable victim (cached, not vetoed, at least ``min_order``). When someone
        listens, the event carries the victim and the policy's next candidates with their scores."""
        order = self.policy.order()
        ranked = []
        victim = None
        for b, score in order:
            ranked.append((b, score))
            if self._order[b] >= min_order and (self.evict_guard is None or self.evict_guard(b)):
                victim = b
                break
        if victim is None:
            return None
        if self._subs:  # victim first, then the candidates it was preferred to (passed over or next in line)
            ranked = [ranked[-1]] + ranked[:-1]
            ranked.extend(islice(order, max(0, 8 - len(ranked))))
        self.policy.discard(victim)
        t = self.clock.now()
        self._push_free(victim)
        self._counts["evictions"] += 1
        for hook in self.evict_hooks:
            hook(victim)
        if self._subs:
            self._publish(ev.Evicted(t, victim, self.policy.name, reason, tuple(ranked[:8])))
        return victim

    def evict_block(self, reason: str = "explicit") -> KVBlock | None:
        """Evict one cached block chosen by the policy and return a view of it (now FREE), or None when no
        block is evictable. Referenced blocks are never candidates; a vetoed candidate is skipped for the next."""
        with self.lock:
            self._locks += 1
            self.clock.tick()
            b = self._evict_one(reason)
            return None if b is None else KVBlock(self, b)

    def release_cached(self, block_id: int) -> None:
        """Drop the data of cached block ``block_id`` (ALLOCATED, refcount 0) and return it to FREE."""
        with self.lock:
            self._locks += 1
            b = self._check_id(block_id)
            BlockStatus.check(b, self._status[b], FREE)
            if self._status[b] == PENDING or self._refs[b]:
                raise IllegalTransitionError(f"block {b} is {_NAMES[self._status[b]]} with refcount "
                                             f"{self._refs[b]}: only a cached block (refcount 0) can be released")
            t = self.clock.tick()
            self.policy.discard(b)
            self._push_free(b)
            if self._subs:
                self._publish(ev.Freed(t, (b,)))

    # ------------------------------------------------------------------ buddy split / merge
    def _split(self, b: int) -> int:
        o = self._order[b]
        self._free[o].remove(b)
        half = 1 << (o - 1)
        self.order_np[b:b + 2 * half] = o - 1
        self._free[o - 1].extend((b + half, b))
        self._counts["splits"] += 1
        if self._subs:
            self._publish(ev.Split(self.clock.now(), b, o, b + half))
        return b + half

    def split_block(self, block_id: int) -> tuple[int, int]:
        """Split FREE block ``block_id`` of size class k > 0 into two FREE buddies of class k-1."""
        with self.lock:
            self._locks += 1
            b = self._check_id(block_id)
            if self._status[b] != FREE or not self._order[b]:
                raise IllegalTransitionError(f"block {b} is {_NAMES[self._status[b]]} of size class "
                                             f"{self._order[b]}: only a FREE block of class > 0 can be split")
            self.clock.tick()
            return b, self._split(b)

    def merge_free_buddies(self, max_merges: int | None = None) -> int:
        """Merge pairs of FREE buddies into their parent, smallest classes first and repeatedly, so freed
        space becomes large blocks again. Returns the number of merges (the text's stubbed
        ``_merge_adjacent_blocks``)."""
        with self.lock:
            self._locks += 1
            merges = 0
            t = self.clock.tick()
            for o in range(self.max_order):
                free = set(self._free[o])
                pairs = sorted(b for b in free if not b & (1 << o) and b + (1 << o) in free)
                if max_merges is not None:
                    pairs = pairs[:max_merges - merges]
                if not pairs:
                    continue
                gone = set(pairs) | {b + (1 << o) for b in pairs}
                self._free[o][:] = array("i", [b for b in self._free[o] if b not in gone])
                for b in pairs:
                    self.order_np[b:b + (2 << o)] = o + 1
                    self._free[o + 1].append(b)
                    if self._subs:
                        self._publish(ev.Merged(t, b, o + 1))
                merges += len(pairs)
            self._counts["merges"] += merges
            return merges

    def sort_free_lists(self) -> None:
        """Reorder every free stack so the lowest ids come out first, as in a fresh pool. After compaction the
        free space is one region at the top of the pool; sorted stacks hand it out as runs ``lo..hi-1``, which
        the batch paths write with slices. Changes no block's state."""
        with self.lock:
            self._locks += 1
            for f in self._free:
                f[:] = array("i", np.sort(np.frombuffer(f, dtype=np.int32))[::-1].tobytes())

    # ------------------------------------------------------------------ migration (compaction, swap-in)
    def migrate(self, src: Ids, dst: Ids, reason: str = "compaction") -> None:
        """Move ALLOCATED blocks ``src[i]`` into FREE blocks ``dst[i]`` of the same size class: one batched
        tensor copy, metadata moved, sources FREE, then every relocation hook rewrites its block tables.
        PENDING/EVICTING blocks cannot move. Nothing changes on error."""
        with self.lock:
            self._locks += 1
            s, d = self._ids(src), self._ids(dst)
            if s.size != d.size:
                raise ConfigError(f"migrate got {s.size} sources and {d.size} destinations")
            if len(set(s.tolist()) | set(d.tolist())) != 2 * s.size:
                raise IllegalTransitionError(f"migrate needs distinct blocks, got {s.tolist()} -> {d.tolist()}")
            for a, b in zip(s.tolist(), d.tolist()):
                if self._status[a] != ALLOCATED:
                    raise IllegalTransitionError(f"block {a} is {_NAMES[self._status[a]]}: only ALLOCATED blocks move")
                if self._status[b] != FREE:
                    raise IllegalTransitionError(f"target block {b} is {_NAMES[self._status[b]]}, not FREE")
                if self._order[a] != self._order[b]:
                    raise ConfigError(f"block {a} (class {self._order[a]}) cannot move into block {b} "
                                      f"(class {self._order[b]})")
            if not s.size:
                return
            if self.storage is not None:
                spans = [1 << self._order[a] for a in s.tolist()]
                self.storage.copy_blocks(np.concatenate([np.arange(a, a + k) for a, k in zip(s.tolist(), spans)]),
                                         np.concatenate([np.arange(b, b + k) for b, k in zip(d.tolist(), spans)]))
            t = self.clock.tick()
            for o in set(self.order_np[d].tolist()):  # one vectorised pass per free list, not one per target
                f = np.array(self._free[o], dtype=np.int32)  # a copy: a view would pin the stack's size
                self._free[o][:] = array("i", f[~np.isin(f, d)].tobytes())
            for a, b in zip(s.tolist(), d.tolist()):
                self._set_status(b, ALLOCATED)
                for arr in (self._refs, self._tokens, self._last, self._created, self._hits, self._owner,
                            self._reusable):
                    arr[b] = arr[a]
                if a in self.policy:
                    self.policy.discard(a)
                    self.policy.add(b)
                self._push_free(a)
            self._counts["migrations"] += s.size
            for hook in self.relocation_hooks:
                hook(s, d)
            if self._subs:
                self._publish(ev.Migrated(t, tuple(s.tolist()), tuple(d.tolist()), reason))

    # ------------------------------------------------------------------ reporting
    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of the per-base-block metadata arrays, taken atomically: ``status``, ``size_class``,
        ``refcount``, ``tokens``, ``last_access``, ``created``, ``hits``, ``owner``, ``reusable`` and
        ``cached`` (bool)."""
        with self.lock:
            snap = {"status": self.status_np.copy(), "size_class": self.order_np.copy(),
                    "refcount": self.refs_np.copy(), "tokens": self.tokens_np.copy(),
                    "last_access": self.last_np.copy(), "created": self.created_np.copy(),
                    "hits": self.hits_np.copy(), "owner": self.owner_np.copy(),
                    "reusable": self.reusable_np.copy()}
        snap["cached"] = (snap["status"] == ALLOCATED) & (snap["refcount"] == 0)
        return snap

    def status_counts(self) -> dict[str, int]:
        """Base blocks per state, e.g. ``{"FREE": 10, "PENDING": 0, "ALLOCATED": 6, "EVICTING": 0}``."""
        c = np.bincount(self.status_np, minlength=4)
        return {name: int(c[i]) for i, name in enumerate(_NAMES)}

    def get_memory_usage(self) -> dict[str, int]:
        """Bytes: ``total``, ``used`` (PENDING/ALLOCATED/EVICTING), ``free``, ``cached`` (inside ``used``),
        ``token_bytes`` (bytes holding real tokens) and the text's ``fragmentation`` percent."""
        with self.lock:
            c = self.status_counts()
            used = (self.num_blocks - c["FREE"]) * self.bytes_per_block
            return {"total": self.num_blocks * self.bytes_per_block, "used": used,
                    "free": c["FREE"] * self.bytes_per_block,
                    "cached": sum(self.bytes_per_block << self._order[b] for b, _ in self.policy.order()),
                    "token_bytes": int(self.tokens_np.sum()) * self.spec.bytes_per_token,
                    "fragmentation": self.calculate_fragmentation()}

    def free_runs(self) -> np.ndarray:
        """Lengths (in base blocks) of the maximal runs of consecutive FREE base blocks, in address order."""
        free = np.concatenate(([0], (self.status_np == FREE).astype(np.int8), [0]))
        edges = np.flatnonzero(np.diff(free))
        return edges[1::2] - edges[::2]

    def calculate_fragmentation(self) -> int:
        """External fragmentation in percent: the share of free memory that the largest request the pool can
        serve cannot use. A request asks for one block of at most the largest size class, so only free space in
        runs of that size counts as usable. With one size class every free block serves every request: 0 by
        construction, whatever the layout. (The text summed the size of FREE blocks' data, which is always 0.)"""
        with self.lock:
            total = self.num_free_blocks
            if not total:
                return 0
            top = 1 << self.max_order
            aligned = self.status_np[:self.num_blocks // top * top].reshape(-1, top)
            usable = top * int((aligned == FREE).all(axis=1).sum())  # free space that merges into top blocks
            return int(round(100 * (1 - usable / total)))

    def get_stats(self) -> dict[str, Any]:
        """Counters since creation (allocations, frees, evictions, splits, merges, migrations, how allocations
        were served) plus the current state counts, cached blocks and the text's ``fragmentation``."""
        with self.lock:
            out = dict(self._counts)
            allocs, frees = self._hot_counts()
            out["allocations"] += allocs
            out["served_free"] += allocs
            out["frees"] += frees
            out.update(self.status_counts())
            out.update(cached=len(self.policy), lock_acquisitions=self.lock_acquisitions,
                       fragmentation=self.calculate_fragmentation())
            return out

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (see the module docstring)."""
        with self.lock:
            n, st, order, refs = self.num_blocks, self.status_np, self.order_np, self.refs_np
            assert sum(self.status_counts().values()) == n
            heads = []
            u = 0
            while u < n and self.max_order:  # tiling: aligned blocks, uniform status and order within each
                o = int(order[u])
                k = 1 << o
                assert u % k == 0 and u + k <= n, f"block {u} of class {o} is misaligned"
                assert (order[u:u + k] == o).all() and (st[u:u + k] == st[u]).all(), f"block {u} is torn"
                heads.append(u)
                u += k
            heads_a = np.array(heads) if self.max_order else np.arange(n)
            assert self.max_order or not order.any(), "a uniform pool has a block of another class"
            in_free: list[int] = []
            for o, lst in enumerate(self._free):
                assert all(order[b] == o for b in lst), f"free list {o} holds a block of another class"
                in_free.extend(lst)
            assert len(in_free) == len(set(in_free)), "a block is in a free list twice"
            assert self._hot is None or (self._hot.stack is self._free[0] and self._hot.clock is self.clock), \
                "the compiled hot path lost the free stack or the clock (both are fixed at construction)"
            free_heads = set(heads_a[st[heads_a] == FREE].tolist())
            assert set(in_free) == free_heads, f"free lists {sorted(set(in_free) ^ free_heads)[:5]} disagree with status"
            assert (refs >= 0).all(), f"negative refcount at block {int(np.argmax(refs < 0))}"
            assert not refs[st == FREE].any(), "a FREE block has references"
            assert not self.tokens_np[st == FREE].any(), "a FREE block counts tokens"
            assert (self.owner_np[st == FREE] == -1).all(), "a FREE block has an owner"
            assert not self.reusable_np[st == FREE].any(), "a FREE block is marked reusable"
            cached = set(heads_a[(st[heads_a] == ALLOCATED) & (refs[heads_a] == 0)].tolist())
            in_policy = {b for b, _ in self.policy.order()}
            assert len(self.policy) == len(in_policy), "eviction policy size disagrees with its order"
            assert in_policy == cached, f"evictable set disagrees with cached blocks: {sorted(in_policy ^ cached)[:5]}"
