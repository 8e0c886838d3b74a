"""FastBlockPool: the same pool, with the speed tricks of text §2.2.5 ("批量操作优化") — the exhibit.

:class:`kvlab.core.pool.BlockPool` is written to be read; this module's pools are written to be fast, and property
tests hold them equal to it (``tests/test_perf.py``: the same random operation sequences give the same return
values, errors, metadata, free stacks, events and clock). They override only the two hottest calls, and only for
the calls that need neither eviction, size classes nor an error — everything else goes to the reference method
unchanged, so every error message is the reference's own:

* ``allocate(n)`` of base blocks the free stack holds: one block is a few list/array operations inlined;
  from :data:`BATCH_MIN` blocks on, the metadata is written with numpy, as slices when the ids form a run
  ``lo..hi-1`` (the stack hands out lowest ids first, so runs are common);
* ``free(ids)`` of distinct blocks that each hold their only reference and keep no reusable data (a finished
  sequence): one block inlined, many with a dozen numpy calls.

:class:`PyFastBlockPool` does this in Python. :class:`FastBlockPool` is the same class with those two methods
compiled (``kvlab/fast/_fastpath.c``, built when kvlab is installed with a C compiler at hand; :data:`COMPILED` says
whether it was, and ``KVLAB_PURE_PYTHON=1`` switches it off); without the binary it *is* ``PyFastBlockPool``.
Why it pays: in CPython a method call costs about as much as an array store, so the reference's tidy helpers
(validate, stamp, push) dominate a one-block call; a batch of n blocks costs one numpy call per field instead
of n stores, and in C neither cost is there. ``kvlab bench`` and ``docs/benchmarks.md`` measure them against
peer-style pools. Events are published on these paths too: a live view listens, and must not slow the pool
down to the reference.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from itertools import islice
from typing import Any

import numpy as np

from kvlab.core import events as ev
from kvlab.core.block import BlockStatus
from kvlab.core.clock import LogicalClock
from kvlab.fast.compiled import load_extension
from kvlab.core.errors import OutOfBlocksError
from kvlab.core.eviction import LRUPolicy
from kvlab.core.block import ALLOCATED, FREE, PENDING
from kvlab.core.checks import INT32_MAX, TOKEN_MAX, TokenBytes, check_tenant
from kvlab.core.events import notify
from kvlab.core.pool import RANKED, BlockPool, Ids
from kvlab.core.prefix import ChainGuard, PrefixCache
from kvlab.core.sequence import NewTokens, Sequence, SequenceManager
from kvlab.core.interrupts import atomic

BATCH_MIN = 9  # measured crossover: numpy's per-call cost pays from about 9 blocks on
_HOLDS_DATA = (ALLOCATED, PENDING)
_INT = {int}
_ALLOCATED = bytes([ALLOCATED])
_ONE_REF = np.ones(1, dtype=np.int32).tobytes()


class _WalkVoid(Exception):
    """A walk of the eviction order went void half-way (the policy changed under it)."""


@atomic()
class PyFastBlockPool(BlockPool):
    """A :class:`BlockPool` whose common allocate/free calls take inlined and vectorised Python paths."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        n = self.num_blocks
        self._scratch = np.zeros(n, dtype=np.uint32)  # duplicate detection without sorting
        self._pos = np.arange(n, dtype=np.uint32)
        self._desc = np.arange(n - 1, -1, -1, dtype=np.int32)  # a run lo..hi-1 as it sits on the stack
        self._stack = self.free_lists.stacks[0]
        m = self.meta
        self._status, self._refs, self._tokens, self._owner = m.status, m.refcount, m.tokens, m.owner
        self._hits, self._last, self._created, self._reusable = m.hits, m.last_access, m.created, m.reusable

    def allocate(self, n: int = 1, *, size_class: int = 0, owner: int = -1,
                 status: BlockStatus = BlockStatus.ALLOCATED, block_id: int | None = None) -> list[int]:
        """:meth:`BlockPool.allocate`, fast for base blocks of a one-size pool: off the free stack, then by
        evicting."""
        stack = self._stack
        if (type(n) is int and n > 0 and type(size_class) is int and not size_class
                and block_id is None and status == ALLOCATED and type(status) in (int, BlockStatus)
                and type(owner) is int and -1 <= owner <= INT32_MAX):
            lock = self.lock
            lock.acquire()  # not `with`: half the cost, and a third of what this path spends beside it
            try:
                if n <= len(stack):  # checked again under the lock
                    self.lock_acquisitions += 1
                    t = self.clock.tick()
                    if n == 1:
                        b = stack.pop()
                        self._status[b] = ALLOCATED
                        self._refs[b] = self._hits[b] = 1
                        self._last[b] = self._created[b] = t
                        self._owner[b] = owner
                        out = [b]
                    else:
                        out = self._pop_many(n, t, owner)
                    c = self.counts
                    c["allocations"] += n
                    c["served_free"] += n
                    if self.events:
                        self.events.publish(ev.Allocated(t, tuple(out), 0, owner, "ALLOCATED", "free"))
                    return out
                if not self.max_order and n - len(stack) <= self._evictable(0, n - len(stack)):  # the check passes
                    return self._allocate_evicting(n, owner)
            finally:
                lock.release()
        return super().allocate(n, size_class=size_class, owner=owner, status=status, block_id=block_id)

    def _allocate_evicting(self, n: int, owner: int) -> list[int]:
        """More blocks than the free stack holds: all of it, then the policy's victims (:meth:`_evict_into`),
        stamped together."""
        stack = self._stack
        self.lock_acquisitions += 1
        t = self.clock.tick()
        out = stack.tolist()[::-1]  # popped one by one: the top first
        free = len(out)
        del stack[:]
        try:
            self._evict_into(out, n, t)
        except BaseException:  # hand back what was taken, as the reference does
            stack.extend(reversed(out))
            raise
        status, refs, hits, last, created, owners = (self._status, self._refs, self._hits, self._last, self._created,
                                                     self._owner)
        for b in out:  # meta.stamp, inlined
            status[b] = ALLOCATED
            refs[b] = hits[b] = 1
            last[b] = created[b] = t
            owners[b] = owner
        c = self.counts
        c["allocations"] += n
        c["served_free"] += free
        c["served_evict"] += n - free
        if self.events:  # the strategy that served most of the blocks (ties go to "free")
            self.events.publish(ev.Allocated(t, tuple(out), 0, owner, "ALLOCATED",
                                             "evict" if n - free > free else "free"))
        return out

    def _evict_into(self, out: list[int], n: int, t: int) -> None:
        """Victims until ``out`` holds ``n`` blocks, the ones ``BlockPool._evict_one`` would pick one call at a
        time: each the policy's first candidate the guard accepts, its fields reset to FREE as ``meta.reset``
        does, the evict hooks told and its ``Evicted`` event (with the same ranked candidates) published. Each
        victim goes straight to ``out`` (the reference pushes it on the free stack and pops it back).

        The reference walks the order afresh for every victim. Two cases need fewer walks:

        * a heap policy under the prefix cache's own guard (:meth:`_evict_in_one_walk`): one walk in all;
        * LRU with nobody listening: one walk yields the candidates the guard accepts before it vetoes any.
          Evicting them leaves the order of the rest as it was, and can only make a vetoed candidate acceptable
          (a parent losing its last cached child), never the reverse, so each is the victim a fresh walk would
          find; after a veto the walk starts again, as the reference's does.

        Anything else with a listener is the reference's own ``_evict_one``, victim by victim."""
        policy, guard, hooks, counts = self.policy, self.evict_guard, self.evict_hooks, self.counts
        status, refs, tokens, reusable, owner = self._status, self._refs, self._tokens, self._reusable, self._owner

        def evict(b: int) -> None:
            policy.evicting(b)
            policy.discard(b)
            status[b] = FREE
            refs[b] = tokens[b] = reusable[b] = 0
            owner[b] = -1
            out.append(b)  # before the hooks, which may raise: the reference pushes it on the free stack first
            notify(hooks, b)
            counts["evictions"] += 1

        if policy.walk_survives_discard and isinstance(guard, ChainGuard) and guard.inner is None:
            try:
                self._evict_in_one_walk(out, n, t, evict, guard)
                return
            except _WalkVoid:  # a hook or listener cached a block: the rest as below, each from a fresh walk
                pass
        if self.events:
            while len(out) < n:
                if self._evict_one("allocation pressure", t) is None:
                    raise OutOfBlocksError(f"no block of {self.block_size} tokens is free or evictable")
                out.append(self._stack.pop())
            return
        many = type(policy) is LRUPolicy
        while len(out) < n:
            victims, vetoed = [], False
            for b, _score in policy.order():
                if guard is None or guard(b):
                    victims.append(b)
                    if vetoed or not many or len(out) + len(victims) == n:
                        break
                elif victims:
                    break
                else:
                    vetoed = True
            if not victims:  # every candidate was vetoed
                raise OutOfBlocksError(f"no block of {self.block_size} tokens is free or evictable")
            for b in victims:
                evict(b)

    def _evict_in_one_walk(self, out: list[int], n: int, t: int, evict: Callable[[int], None],
                           guard: ChainGuard) -> None:
        """The victims of :meth:`_evict_into` from one walk of the order, for a policy whose walk survives
        evictions, under the prefix cache's guard, which evicting a block changes on one other block at most: its
        parent (``lifted_by``), which may lose its last child. A fresh walk after each eviction would pass the
        same vetoed candidates again (thousands, when many chains are cached) and stop at the first acceptable
        one; that is the parent when the walk already passed it, else the next acceptable one further on.

        The order a fresh walk would see is the vetoed candidates passed so far, then the rest of this walk; an
        ``Evicted`` event ranks the victim first, then the first others of that order, as the reference's does.
        A listener may look at the ranking meanwhile (a second walk leaves this one alone); if a hook or listener
        caches a block, the walk is void (:class:`_WalkVoid`, raised before anything is decided for the next
        victim) and :meth:`_evict_into` takes the rest from fresh walks."""
        walk, name = self.policy.order(), self.policy.name
        passed: OrderedDict[int, float] = OrderedDict()  # the vetoed candidates this walk passed, in order
        ahead: deque[tuple[int, float]] = deque()  # taken from the walk to rank a victim, not yet judged

        def pull() -> tuple[int, float] | None:
            try:
                return next(walk, None)
            except RuntimeError:  # the policy changed under the walk (a block was cached): nothing is decided
                raise _WalkVoid from None

        def ranked(b: int, score: float) -> tuple[tuple[int, float], ...]:
            need = RANKED - 1 - len(passed)
            while len(ahead) < need and (entry := pull()) is not None:
                ahead.append(entry)
            return ((b, score), *islice(passed.items(), RANKED - 1), *islice(ahead, max(0, need)))

        while len(out) < n:
            while (entry := ahead.popleft() if ahead else pull()) is not None and not guard(entry[0]):
                passed[entry[0]] = entry[1]
            if entry is None:  # every candidate was vetoed
                raise OutOfBlocksError(f"no block of {self.block_size} tokens is free or evictable")
            b, score = entry
            while True:  # b, then each parent it frees that the walk had passed
                up = guard.lifted_by(b)  # asked first: evicting b drops its entry
                rank = ranked(b, score) if self.events else ()  # ranked before, published after, as the reference
                evict(b)
                if rank:
                    self.events.publish(ev.Evicted(t, b, name, "allocation pressure", rank))
                if len(out) == n or up is None or up not in passed or not guard(up):
                    break
                b, score = up, passed.pop(up)

    def _pop_many(self, n: int, t: int, owner: int) -> list[int]:
        """The top ``n`` blocks of the free stack, stamped with vectorised writes (slices for a run)."""
        stack = self._stack
        top = stack[-1]
        chunk = stack[-n:]
        del stack[-n:]
        hi = self.num_blocks - top  # the run top..top+n-1 sits on the stack as _desc[hi-n:hi]
        ix: slice | np.ndarray
        if n >= BATCH_MIN and chunk.tobytes() == self._desc[max(hi - n, 0):hi].tobytes():
            ix, out = slice(top, top + n), list(range(top, top + n))
        elif n >= BATCH_MIN:
            ix = np.frombuffer(chunk, dtype=np.int32)[::-1].astype(np.int64)
            out = ix.tolist()
        else:
            out = chunk.tolist()[::-1]
            for b in out:
                self.meta.stamp(b, t, owner, ALLOCATED)
            return out
        self.meta.stamp(ix, t, owner, ALLOCATED)
        return out

    def free(self, ids: Ids) -> None:
        """:meth:`BlockPool.free`, fast for distinct base blocks that each hold their only reference and keep
        no reusable data."""
        if type(ids) is list and ids and not self.max_order:
            lock = self.lock
            lock.acquire()  # not `with`, as in allocate
            try:
                if len(ids) == 1:
                    b = ids[0]
                    if (type(b) is int and 0 <= b < self.num_blocks and self._status[b] == ALLOCATED
                            and self._refs[b] == 1 and not self._reusable[b]):
                        self.lock_acquisitions += 1
                        t = self.clock.tick()
                        self._status[b] = FREE
                        self._refs[b] = self._tokens[b] = 0
                        self._owner[b] = -1
                        self._stack.append(b)
                        self.counts["frees"] += 1
                        if self.events:
                            self.events.publish(ev.Freed(t, (b,)))
                        return
                elif len(ids) >= BATCH_MIN and self._free_many(ids):
                    return
                if self._release_held(ids):
                    return
            finally:
                lock.release()
        super().free(ids)

    def _free_not_plain(self, ids: Ids) -> None:
        """What the compiled ``free`` hands back: any list but distinct single-reference blocks without reusable
        data (which it served itself), so only the general path or the reference is left to try."""
        if type(ids) is list and ids and not self.max_order:
            with self.lock:
                if self._release_held(ids):
                    return
        BlockPool.free(self, ids)

    def check_ids(self, ids: Any) -> list[int]:
        """:meth:`BlockPool.check_ids`, fast for a list of exact ints on a one-size pool (every id is a block)."""
        if type(ids) is list and not self.max_order:
            n = self.num_blocks
            for b in ids:
                if type(b) is not int or not 0 <= b < n:
                    break
            else:
                return list(ids)
        return super().check_ids(ids)

    def _release_held(self, ids: list) -> bool:
        """Free distinct ALLOCATED blocks that each hold a reference (shared, registered in a prefix cache or
        not): one reference dropped each; at 0 a reusable block becomes cached, any other FREE. False (nothing
        changed) for any other list."""
        n, status, refs = self.num_blocks, self._status, self._refs
        for b in ids:
            if type(b) is not int or not 0 <= b < n or status[b] != ALLOCATED or not refs[b]:
                return False
        if len(set(ids)) != len(ids):
            return False
        self.lock_acquisitions += 1
        t = self.clock.tick()
        left, kept, gone = [], [], []
        last, reusable, policy = self._last, self._reusable, self.policy
        for b in ids:
            r = refs[b] = refs[b] - 1
            if r:
                left.append(b)
                last[b] = t
            elif reusable[b]:
                kept.append(b)
                last[b] = t
                policy.add(b)
            else:
                gone.append(b)
        for b in reversed(gone):  # pushed so that the first id comes out first again
            self._push_free(b)
        self.counts["frees"] += len(ids)
        if self.events:
            if left:
                self.events.publish(ev.RefChanged(t, tuple(left), (-1,) * len(left), tuple(refs[b] for b in left)))
            if kept:
                self.events.publish(ev.Cached(t, tuple(kept)))
            if gone:
                self.events.publish(ev.Freed(t, tuple(gone)))
        return True

    def incref(self, ids: Ids) -> None:
        """:meth:`BlockPool.incref`, fast for distinct ALLOCATED base blocks (a prefix-cache hit)."""
        if type(ids) is list and ids and not self.max_order:
            with self.lock:
                n, status, refs = self.num_blocks, self._status, self._refs
                for b in ids:
                    if type(b) is not int or not 0 <= b < n or status[b] != ALLOCATED:
                        break
                else:
                    if len(set(ids)) == len(ids):  # (a repeat adds a reference per occurrence: the reference's)
                        self.lock_acquisitions += 1
                        t = self.clock.tick()
                        hits, last, policy = self._hits, self._last, self.policy
                        for b in ids:
                            if not refs[b]:
                                policy.discard(b)
                            refs[b] += 1
                            hits[b] += 1
                            last[b] = t
                        if self.events:
                            self.events.publish(ev.RefChanged(t, tuple(ids), (1,) * len(ids),
                                                              tuple(refs[b] for b in ids)))
                        return
        super().incref(ids)

    def mark_reusable(self, ids: Ids, reusable: bool = True) -> None:
        """:meth:`BlockPool.mark_reusable`, fast for marking (not unmarking) base blocks that hold data."""
        if reusable is True and type(ids) is list and ids and not self.max_order:
            with self.lock:
                n, status = self.num_blocks, self._status
                for b in ids:
                    if type(b) is not int or not 0 <= b < n or status[b] not in _HOLDS_DATA:
                        break
                else:
                    self.lock_acquisitions += 1
                    self.clock.tick()
                    flag = self._reusable
                    for b in ids:
                        flag[b] = 1
                    return
        super().mark_reusable(ids, reusable)

    def set_token_counts(self, ids: Ids, counts: Seq[int]) -> None:
        """:meth:`BlockPool.set_token_counts`, fast for lists of exact ints on a one-size pool."""
        if type(ids) is list and type(counts) is list and len(ids) == len(counts) and not self.max_order:
            with self.lock:
                n, cap, status = self.num_blocks, self.block_size, self._status
                for b, c in zip(ids, counts):
                    if type(b) is not int or not 0 <= b < n or type(c) is not int or not 0 <= c <= cap \
                            or status[b] == FREE:
                        break
                else:
                    tokens = self._tokens
                    for b, c in zip(ids, counts):
                        tokens[b] = c
                    return
        super().set_token_counts(ids, counts)

    def set_owner(self, ids: Ids, owner: int) -> None:
        """:meth:`BlockPool.set_owner`, fast for lists of exact ints on a one-size pool."""
        if type(ids) is list and type(owner) is int and -1 <= owner <= INT32_MAX and not self.max_order:
            with self.lock:
                n, status = self.num_blocks, self._status
                for b in ids:
                    if type(b) is not int or not 0 <= b < n or status[b] == FREE:
                        break
                else:
                    field = self._owner
                    for b in ids:
                        field[b] = owner
                    return
        super().set_owner(ids, owner)

    def _free_many(self, ids: list) -> bool:
        """Free many distinct single-reference, non-reusable blocks with numpy; False (nothing changed) for
        any other list, which the reference path then serves or rejects."""
        n = len(ids)
        if n > self.num_blocks:  # more ids than blocks: some repeat, which the reference path words
            return False
        try:  # exact ints only (bools and numpy ints go to the reference); past int64 is an OverflowError
            v = np.array(ids, dtype=np.int64) if all(type(b) is int for b in ids) else None
        except OverflowError:
            return False
        if v is None or v.min() < 0 or v.max() >= self.num_blocks:
            return False
        m = self.meta.np
        if (m.status[v].tobytes() != _ALLOCATED * n or m.refcount[v].tobytes() != _ONE_REF * n
                or m.reusable[v].any() or not self._distinct(v)):
            return False
        self.lock_acquisitions += 1
        t = self.clock.tick()
        self.meta.reset(v)
        self._stack.frombytes(v[::-1].astype(np.int32).tobytes())  # the first id ends on top
        self.counts["frees"] += n
        if self.events:
            self.events.publish(ev.Freed(t, tuple(ids)))
        return True

    def _distinct(self, a: np.ndarray) -> bool:
        """Whether in-range ids ``a`` hold no repeats: two scatters and a bytes comparison, no sort."""
        pos = self._pos[:a.size]
        self._scratch[a] = pos
        return self._scratch[a].tobytes() == pos.tobytes()


@atomic()
class PyFastSequenceManager(SequenceManager):
    """A :class:`SequenceManager` whose ``append_tokens`` (the engine's call every step) takes one lean pass for
    the common batch: live resident sequences of this manager, named once, each given a list of exact-int token
    ids (or a count, for a sequence without ids), none appending into a shared partly filled block. It plans
    (reads only), takes the blocks in one ``pool.allocate``, then applies, as the reference does; every other
    batch, and every error, is the reference method's."""

    def append_tokens(self, seqs: Seq[Sequence], new: Seq[NewTokens]) -> list[int]:
        """:meth:`SequenceManager.append_tokens`, lean for the common batch."""
        need = self._plan_append(seqs, new)
        if need is None:
            return super().append_tokens(seqs, new)
        fresh = self.pool.allocate(need) if need else []
        starts, filled, counts, owned = self._apply_append(seqs, new, fresh)
        for got, seq_id in owned:
            self.pool.set_owner(got, seq_id)
        if filled:
            self.pool.set_token_counts(filled, counts)
        return starts

    def _plan_append(self, seqs: Seq[Sequence], new: Seq[NewTokens]) -> int | None:
        """The new blocks the batch needs, or None when it is not the common batch. Reads only."""
        if type(seqs) is not list or type(new) is not list or len(seqs) != len(new):
            return None
        B, live, refs = self.block_size, self.seqs, self.pool.fields.refcount
        need = 0
        for seq, x in zip(seqs, new):
            if type(seq) is not Sequence or live.get(seq.seq_id) is not seq or seq.swapped is not None:
                return None
            num = seq.num_tokens
            if type(x) is list and seq.token_ids is not None:
                n = len(x)
                if n and (set(map(type, x)) != _INT or min(x) < 0 or max(x) > TOKEN_MAX):
                    return None
            elif type(x) is int and seq.token_ids is None and 0 <= x <= TOKEN_MAX - num:
                n = x
            else:
                return None
            if n and num % B and refs[seq.block_table[-1]] > 1:  # copy-on-write: the reference plans it
                return None
            need += -(-(num + n) // B) - len(seq.block_table)
        return need if len({s.seq_id for s in seqs}) == len(seqs) else None

    def _apply_append(self, seqs: Seq[Sequence], new: Seq[NewTokens],
                      fresh: list[int]) -> tuple[list[int], list[int], list[int], list[tuple[list[int], int]]]:
        """Each sequence takes its new blocks off the front of ``fresh`` and its tokens: (where each started,
        the blocks written and the tokens they now hold, the new blocks of each sequence with its id)."""
        B = self.block_size
        starts: list[int] = []
        filled: list[int] = []
        counts: list[int] = []
        owned: list[tuple[list[int], int]] = []
        at = 0
        for seq, x in zip(seqs, new):
            table, start = seq.block_table, seq.num_tokens
            end = start + (len(x) if isinstance(x, list) else x)  # type: ignore[operator]  # a count otherwise
            more = -(-end // B) - len(table)
            if more:
                got = fresh[at:at + more]
                at += more
                table.extend(got)
                owned.append((got, seq.seq_id))
            starts.append(start)
            seq.num_tokens = end
            for i in range(start // B, -(-end // B)):
                filled.append(table[i])
                counts.append(min(B, end - i * B))
            if type(x) is list and x:
                seq.token_ids += x  # type: ignore[operator]  # lists only for sequences that track ids
        return starts, filled, counts, owned


_FastPath: type | None = load_extension("_fastpath", "FastPath", "FastBlockPool runs its Python paths meanwhile.")
COMPILED = _FastPath is not None

if _FastPath is not None:
    from kvlab.fast._fastpath import PoolLock as _PoolLock  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from kvlab.fast._fastpath import apply_append as _apply_append
    from kvlab.fast._fastpath import plan_append as _plan_append
    from kvlab.fast._fastpath import token_bytes as _token_bytes
    from kvlab.fast._fastpath import walk_chain as _walk_chain

    @atomic()
    class FastBlockPool(_FastPath, PyFastBlockPool):  # type: ignore[misc,valid-type]
        """:class:`PyFastBlockPool` with ``allocate``, ``free``, ``incref``, ``mark_reusable``, ``set_owner``
        and ``set_token_counts`` compiled (``kvlab/fast/_fastpath.c``): the C serves what the Python fast paths serve
        and hands every other call to them."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.lock = _PoolLock()  # reentrant like threading.RLock; the C takes it without a method call
            m = self.meta
            self._bind_fastpath(
                allocate=PyFastBlockPool.allocate, free=PyFastBlockPool.__dict__["_free_not_plain"],
                set_token_counts=PyFastBlockPool.set_token_counts, incref=PyFastBlockPool.incref,
                mark_reusable=PyFastBlockPool.mark_reusable, set_owner=PyFastBlockPool.set_owner,
                discard=self.policy.discard, add=self.policy.add, lock=self.lock, stack=self._stack,
                clock=self.clock, step_slot=LogicalClock.__dict__["step"] if type(self.clock) is LogicalClock else None,
                events=self.events, allocated=ev.Allocated, freed=ev.Freed, refchanged=ev.RefChanged,
                cached=ev.Cached,
                status=m.status, refcount=m.refcount, hits=m.hits, last_access=m.last_access, created=m.created,
                owner=m.owner, tokens=m.tokens, reusable=m.reusable, uniform=not self.max_order,
                capacity=self.block_size)

        @property
        def counts(self) -> dict[str, int]:
            """The pool's counters, with what the C paths served since they were last read added in."""
            c = self._counts
            allocated, freed = self._take_counts()
            if allocated:
                c["allocations"] += allocated
                c["served_free"] += allocated
            if freed:
                c["frees"] += freed
            return c

        @counts.setter
        def counts(self, value: dict[str, int]) -> None:
            self._counts = value
    def _checked(x: object) -> TokenBytes | None:
        """A list of exact ints in 0..2**63-1 as :class:`TokenBytes`, checked and converted in C in one pass
        (``_fastpath.c``'s ``token_bytes``); None for anything else, which the reference checks and words."""
        data = _token_bytes(x) if type(x) is list else None
        return None if data is None else TokenBytes(data)

    @atomic()
    class FastPrefixCache(PrefixCache):
        """A :class:`PrefixCache` whose lookups and stores check a list of token ids in C (``_checked``) and whose
        lookups walk the hash chain in C (``kvlab/fast/_fastpath.c``'s ``walk_chain``: the same hashes, checks and
        stop as the Python ``_walk``'s loop)."""

        def _query(self, token_ids: Any, tenant: str | None, max_blocks: int | None) -> tuple[bytes, Any, int]:
            return super()._query(_checked(token_ids) or token_ids, tenant, max_blocks)

        def store_blocks(self, block_ids: Seq[int], token_ids: Any, parent: bytes | None = None,
                         tenant: str | None = None) -> list[bytes]:
            """:meth:`PrefixCache.store_blocks`, a list of token ids checked in C (``_checked``)."""
            return super().store_blocks(block_ids, _checked(token_ids) or token_ids, parent, tenant)

        def _walk(self, tokens: bytes, salted: Any, n: int) -> tuple[list[int], bytes | None]:
            ids, last, stale = _walk_chain(tokens, n, 8 * self.block_size, salted, self._block, self._tokens,
                                           self._status, self._reusable, self._stamp, self._created)
            if stale >= 0:
                self._drop(stale)
            return ids, last

    @atomic()
    class FastSequenceManager(PyFastSequenceManager):
        """:class:`PyFastSequenceManager` with the loop over the batch compiled (``kvlab/fast/_fastpath.c``'s
        ``plan_append`` and ``apply_append``, which read and write the same fields; the pool calls between them
        stay the pool's) and a list prompt checked in C. ``prefix_cache=True`` builds a :class:`FastPrefixCache`."""

        def __init__(self, pool: BlockPool, prefix_cache: PrefixCache | bool | None = None) -> None:
            if isinstance(prefix_cache, (bool, np.bool_)) and prefix_cache and isinstance(pool, BlockPool):
                prefix_cache = FastPrefixCache(pool)
            super().__init__(pool, prefix_cache)

        def create(self, prompt: Seq[int] | None = None, *, tenant: str | None = None) -> Sequence:
            """:meth:`SequenceManager.create`, a list prompt checked in C (``_checked``)."""
            data = _checked(prompt)
            if data is None:
                return super().create(prompt, tenant=tenant)
            assert isinstance(prompt, list)  # _checked takes nothing else
            return self._open((list(prompt), data), check_tenant(tenant))

        def _plan_append(self, seqs: Seq[Sequence], new: Seq[NewTokens]) -> int | None:
            return _plan_append(seqs, new, self.seqs, Sequence, self.block_size, self.pool.fields.refcount)

        def _apply_append(self, seqs: Seq[Sequence], new: Seq[NewTokens],
                          fresh: list[int]) -> tuple[list[int], list[int], list[int], list[tuple[list[int], int]]]:
            return _apply_append(seqs, new, fresh, self.block_size)
else:
    FastBlockPool = PyFastBlockPool  # type: ignore[misc,assignment]
    FastSequenceManager = PyFastSequenceManager  # type: ignore[misc,assignment]
    FastPrefixCache = PrefixCache  # type: ignore[misc,assignment]
