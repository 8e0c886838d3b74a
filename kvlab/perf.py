"""FastBlockPool: the same pool, with the speed tricks of text §2.2.5 ("批量操作优化") — the exhibit.

:class:`kvlab.pool.BlockPool` is written to be read; this module's pools are written to be fast, and property
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
compiled (``kvlab/_fastpath.c``, built when kvlab is installed with a C compiler at hand; :data:`COMPILED` says
whether it was, and ``KVLAB_PURE_PYTHON=1`` switches it off); without the binary it *is* ``PyFastBlockPool``.
Why it pays: in CPython a method call costs about as much as an array store, so the reference's tidy helpers
(validate, stamp, push) dominate a one-block call; a batch of n blocks costs one numpy call per field instead
of n stores, and in C neither cost is there. ``kvlab bench`` and ``docs/benchmarks.md`` measure them against
peer-style pools. Events are published on these paths too: a live view listens, and must not slow the pool
down to the reference.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from . import events as ev
from .block import BlockStatus
from .clock import LogicalClock
from .pool import ALLOCATED, FREE, INT32_MAX, BlockPool, Ids

BATCH_MIN = 9  # measured crossover: numpy's per-call cost pays from about 9 blocks on
_ALLOCATED = bytes([ALLOCATED])
_ONE_REF = np.ones(1, dtype=np.int32).tobytes()


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
        """:meth:`BlockPool.allocate`, fast for base blocks the free stack already holds."""
        stack = self._stack
        if (type(n) is int and 0 < n <= len(stack) and type(size_class) is int and not size_class
                and block_id is None and status == ALLOCATED and type(status) in (int, BlockStatus)
                and type(owner) is int and -1 <= owner <= INT32_MAX):
            with self.lock:
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
        return super().allocate(n, size_class=size_class, owner=owner, status=status, block_id=block_id)

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
            with self.lock:
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
        super().free(ids)

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


def _load_fastpath(source: Path = Path(__file__).with_name("_fastpath.c")) -> type | None:
    """The compiled base type, or None: switched off (``KVLAB_PURE_PYTHON=1``), or not built — with one warning
    when it should have been (a binary older than its source, or a source checkout with a compiler but no
    binary: reinstall)."""
    if os.environ.get("KVLAB_PURE_PYTHON"):
        return None
    try:
        from ._fastpath import SOURCE_SHA256, FastPath
    except ImportError:
        if source.exists() and shutil.which(os.environ.get("CC", "").split(" ")[0] or "cc"):
            warnings.warn("kvlab/_fastpath.c is not compiled although a C compiler is at hand; reinstall kvlab "
                          "(`make install`). FastBlockPool runs its Python paths meanwhile.", stacklevel=3)
        return None
    if source.exists() and hashlib.sha256(source.read_bytes()).hexdigest() != SOURCE_SHA256:
        warnings.warn(f"{source} changed after it was compiled; reinstall kvlab (`make install`) to rebuild it. "
                      "FastBlockPool runs its Python paths meanwhile.", stacklevel=3)
        return None
    return FastPath


_FastPath = _load_fastpath()
COMPILED = _FastPath is not None

if _FastPath is not None:
    from ._fastpath import PoolLock as _PoolLock

    class FastBlockPool(_FastPath, PyFastBlockPool):  # type: ignore[misc,valid-type]
        """:class:`PyFastBlockPool` with ``allocate`` and ``free`` compiled (``kvlab/_fastpath.c``): the C
        serves what the Python fast paths serve and hands every other call to them."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.lock = _PoolLock()  # reentrant like threading.RLock; the C takes it without a method call
            m = self.meta
            self._bind_fastpath(
                allocate=PyFastBlockPool.allocate, free=PyFastBlockPool.free, lock=self.lock, stack=self._stack,
                clock=self.clock, step_slot=LogicalClock.__dict__["step"] if type(self.clock) is LogicalClock else None,
                events=self.events, allocated=ev.Allocated, freed=ev.Freed,
                status=m.status, refcount=m.refcount, hits=m.hits, last_access=m.last_access, created=m.created,
                owner=m.owner, tokens=m.tokens, reusable=m.reusable, uniform=not self.max_order)

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
else:
    FastBlockPool = PyFastBlockPool  # type: ignore[misc,assignment]
