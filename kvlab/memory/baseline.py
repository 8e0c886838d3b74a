"""The pre-paging baseline: one contiguous region per request, reserved at its maximum length (text §2.2.6).

Before paged KV caches, a serving system gave each request one contiguous run of token slots large enough for
the longest sequence it might become (the model's context limit, since the output length is unknown when the
request arrives). Two costs follow, and the claims report measures both against the paged engine:

* **reservation waste** -- slots reserved for tokens that never come (a 100-token chat reply in a 2048-slot
  region leaves 95% of it empty);
* **external fragmentation** -- regions of different sizes come and go, and the free space splits into runs too
  short for the next reservation although their sum would fit it.

:class:`ContiguousAllocator` is a first-fit allocator over one arena of slots (the same bytes a
:class:`~kvlab.BlockPool` would hold). Invariant: the free extents and the reserved regions tile the arena
exactly, free extents are sorted by start and never adjacent (they are merged on release). The engine runs on it
through :class:`~kvlab.serve.memory.ContiguousMemory`.
"""
from __future__ import annotations

from bisect import bisect_left

from kvlab.core.checks import check_count, is_int
from kvlab.core.errors import ConfigError, DoubleFreeError, OutOfBlocksError


class ContiguousAllocator:
    """First-fit reservations of contiguous slot runs in an arena of ``capacity`` token slots."""

    def __init__(self, capacity: int) -> None:
        if not is_int(capacity) or capacity < 1:
            raise ConfigError(f"capacity must be a positive number of slots, got {capacity!r}")
        self.capacity = capacity = int(capacity)
        self._starts: list[int] = [0]  # free extents as parallel sorted lists (start, length)
        self._lens: list[int] = [capacity]
        self.regions: dict[int, tuple[int, int]] = {}  # owner -> (start, length)
        self.reserved = 0

    @property
    def free(self) -> int:
        return self.capacity - self.reserved

    @property
    def largest_free(self) -> int:
        return max(self._lens, default=0)

    def reserve(self, owner: int, n: int) -> int:
        """Reserve the first free run of ``n`` slots for ``owner``; returns its start. Raises
        :class:`OutOfBlocksError` (nothing changes) when no run is long enough."""
        owner = check_count(owner, "owner")
        if owner in self.regions:
            raise ConfigError(f"owner {owner} already holds slots {self.regions[owner]}")
        if not is_int(n) or n < 1:
            raise ConfigError(f"a reservation needs >= 1 slot, got {n!r}")
        n = int(n)
        for i, length in enumerate(self._lens):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i], self._lens[i] = start + n, length - n
                self.regions[owner] = (start, n)
                self.reserved += n
                return start
        raise OutOfBlocksError(f"no run of {n} contiguous slots for owner {owner}: {self.free} slots free, the "
                               f"longest run is {self.largest_free} (external fragmentation)")

    def release(self, owner: int) -> None:
        """Return ``owner``'s region to the free extents, merging with free neighbours."""
        owner = check_count(owner, "owner")
        if owner not in self.regions:
            raise DoubleFreeError(f"owner {owner} holds no contiguous region (released twice?)")
        start, n = self.regions.pop(owner)
        self.reserved -= n
        i = bisect_left(self._starts, start)
        if i < len(self._starts) and start + n == self._starts[i]:  # merge with the next extent
            n += self._lens[i]
            del self._starts[i], self._lens[i]
        if i and self._starts[i - 1] + self._lens[i - 1] == start:  # and with the previous one
            self._lens[i - 1] += n
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, n)

    def fragmentation(self) -> float:
        """External fragmentation in [0, 1]: the share of free slots outside the longest free run."""
        return 1 - self.largest_free / self.free if self.free else 0.0

    def check_invariants(self) -> None:
        """Raise AssertionError unless free extents and regions tile the arena without overlap."""
        spans = sorted([*zip(self._starts, self._lens), *self.regions.values()])
        pos = 0
        for start, n in spans:
            assert start == pos and n > 0, f"gap or overlap at slot {pos} (next span starts at {start})"
            pos += n
        assert pos == self.capacity, f"spans cover {pos} of {self.capacity} slots"
        assert all(a + n < b for a, n, b in zip(self._starts, self._lens, self._starts[1:])), "adjacent free runs"
        assert self.reserved == sum(n for _, n in self.regions.values()), "reserved counter drifted"
