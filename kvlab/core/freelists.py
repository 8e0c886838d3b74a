"""Free lists and the buddy system (text §2.2.3 ``split_block``, §2.2.4 ``_merge_adjacent_blocks``).

One LIFO stack of FREE block ids per size class. A pool with one block size (the paged case, and every
production engine) uses stack 0 only: any free block serves any request, so there is nothing to split, merge or
search. With size classes (``block_sizes=[16, 32, 64]``), a block of class k spans ``2**k`` base blocks and
starts at a multiple of ``2**k``; its *buddy* is the block at ``id ^ 2**k``. A missing class-k block is made by
splitting a larger one in halves; two FREE buddies merge back into their parent.

Invariants (asserted by :meth:`kvlab.core.pool.BlockPool.check_invariants`):

* a block is on exactly one stack iff it is FREE, and on the stack of its own size class;
* a fresh pool's stacks hand out the lowest ids first (the top of a stack is its end).

The stacks are ``array('i')``: compact, and their bytes convert to numpy without a copy for the batch paths.
"""
from __future__ import annotations

from array import array

import numpy as np

from kvlab.core.meta import BlockMeta


class FreeLists:
    """Free stacks over ``meta`` (whose ``size_class`` field they read and, when splitting or merging, write)."""

    def __init__(self, meta: BlockMeta, max_order: int) -> None:
        self.meta, self.max_order = meta, max_order
        self.stacks: list[array] = [array("i") for _ in range(max_order + 1)]
        self.carve(0, meta.num_blocks)

    def carve(self, start: int, stop: int) -> None:
        """Tile base blocks ``[start, stop)`` with the largest aligned blocks and push them, lowest on top."""
        if not self.max_order:  # one size: every base block is a block (one C-level extend for a million)
            self.stacks[0].extend(range(stop - 1, start - 1, -1))
            return
        tiles, u = [], start
        while u < stop:
            k = self.max_order
            while k and (u & ((1 << k) - 1) or u + (1 << k) > stop):
                k -= 1
            tiles.append((u, k))
            u += 1 << k
        for u, k in reversed(tiles):
            self.meta.np.size_class[u:u + (1 << k)] = k
            self.stacks[k].append(u)

    def __len__(self) -> int:
        """FREE base blocks."""
        return sum(len(s) << k for k, s in enumerate(self.stacks))

    def count(self, k: int) -> int:
        """FREE blocks of class ``k``."""
        return len(self.stacks[k])

    def capacity(self, k: int) -> int:
        """Blocks of class ``k`` the free stacks could yield, splitting larger ones."""
        if k == self.max_order:
            return len(self.stacks[k])
        return sum(len(self.stacks[o]) << (o - k) for o in range(k, self.max_order + 1))

    def top(self, k: int) -> int | None:
        """The block :meth:`pop` would return for class ``k``, without splitting; None if the stack is empty."""
        s = self.stacks[k]
        return s[-1] if s else None

    def push(self, b: int) -> None:
        self.stacks[self.meta.size_class[b]].append(b)

    def pop(self, k: int) -> int:
        return self.stacks[k].pop()

    def remove(self, b: int) -> None:
        """Take FREE block ``b`` off its stack (O(stack length): only for allocating one chosen block)."""
        self.stacks[self.meta.size_class[b]].remove(b)

    def split(self, b: int) -> int:
        """Split FREE block ``b`` of class k > 0 into buddies ``b`` and ``b + 2**(k-1)`` of class k-1; both stay
        FREE, ``b`` on top. Returns the upper buddy."""
        k = self.meta.size_class[b]
        self.stacks[k].remove(b)
        half = 1 << (k - 1)
        self.meta.np.size_class[b:b + 2 * half] = k - 1
        self.stacks[k - 1].extend((b + half, b))
        return b + half

    def take(self, k: int) -> tuple[int, list[tuple[int, int, int]]] | None:
        """A FREE block of class ``k`` off the stacks, splitting the smallest larger block if needed; with the
        splits made as ``(block, class, buddy)``. None if no free block is large enough."""
        if self.stacks[k]:
            return self.stacks[k].pop(), []
        o = next((o for o in range(k + 1, self.max_order + 1) if self.stacks[o]), None)
        if o is None:
            return None
        b, splits = self.stacks[o][-1], []
        while self.meta.size_class[b] > k:
            splits.append((b, self.meta.size_class[b], self.split(b)))
        return self.stacks[k].pop(), splits

    def merge_buddies(self, max_merges: int | None = None) -> list[tuple[int, int]]:
        """Merge pairs of FREE buddies into their parents, smallest classes first and repeatedly, at most
        ``max_merges`` pairs. Returns the merged blocks as ``(block, new class)``."""
        merged: list[tuple[int, int]] = []
        for k in range(self.max_order):
            free = set(self.stacks[k])
            pairs = sorted(b for b in free if not b & (1 << k) and b + (1 << k) in free)
            if max_merges is not None:
                pairs = pairs[:max_merges - len(merged)]
            if not pairs:
                continue
            gone = set(pairs) | {b + (1 << k) for b in pairs}
            self.stacks[k][:] = array("i", [b for b in self.stacks[k] if b not in gone])
            for b in pairs:
                self.meta.np.size_class[b:b + (2 << k)] = k + 1
                self.stacks[k + 1].append(b)
                merged.append((b, k + 1))
        return merged

    def sort(self) -> None:
        """Reorder every stack so the lowest ids come out first, as in a fresh pool."""
        for s in self.stacks:
            s[:] = array("i", np.sort(np.frombuffer(s, dtype=np.int32))[::-1].tobytes())

    def remove_many(self, ids: np.ndarray) -> None:
        """Take FREE blocks ``ids`` off their stacks (one pass per stack)."""
        for s in self.stacks:
            if s:
                f = np.frombuffer(s, dtype=np.int32).copy()  # a copy: a live view would pin the stack's size
                keep = f[~np.isin(f, ids)]
                if keep.size != f.size:
                    s[:] = array("i", keep.tobytes())

    def ids(self) -> list[int]:
        """Every FREE block id, stack by stack."""
        return [b for s in self.stacks for b in s]
