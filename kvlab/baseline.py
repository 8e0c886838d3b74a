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
exactly, free extents are sorted by start and never adjacent (they are merged on release).
"""
from __future__ import annotations

from bisect import bisect_left

from .checks import check_count, is_int
from .clock import LogicalClock
from .errors import ConfigError, DoubleFreeError, OutOfBlocksError
from .events import EventBus


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


class ContiguousMemory:
    """The engine's memory when ``EngineConfig.memory == "contiguous"``: every admitted request reserves
    ``max_model_len`` contiguous slots up front (its output length is unknown), so it never grows, never needs a
    block later and is never preempted; admission waits until a long enough free run exists. Metadata only.
    Same interface as :class:`kvlab.engine.PagedMemory`. With ``memory == "contiguous-exact"`` a request reserves
    exactly its prompt plus output length instead: an oracle that knows the output length, the strongest
    contiguous baseline (the PagedAttention paper's "Orca (Oracle)"); only external fragmentation is left."""

    def __init__(self, cfg, model=None) -> None:  # cfg: kvlab.engine.EngineConfig (no import: it imports us)
        if model is not None:
            raise ConfigError("the contiguous baseline runs metadata-only: pass no model")
        self.bs, self.region = cfg.block_size, cfg.max_model_len
        self.exact = cfg.memory == "contiguous-exact"
        self.arena = ContiguousAllocator(cfg.num_blocks * cfg.block_size)
        self.capacity_slots = self.arena.capacity
        self.events, self.clock = EventBus(), LogicalClock()  # the clock ticks per reservation and release
        self.evictions = 0  # nothing is cached, so nothing is ever evicted
        self.promised = 0  # a region never grows: nothing is ever promised
        self._tokens = 0

    def prompt_ids(self, req) -> list[int]:
        return [0] * req.prompt_len

    def available(self) -> int:
        """Blocks' worth of slots in the longest free run: only a contiguous run can take a request."""
        return self.arena.largest_free // self.bs

    def slots_for(self, job) -> int:
        """The slots ``job``'s region reserves: the context limit, or (exact) its own prompt + output length."""
        return job.req.total_len if self.exact else self.region

    def held(self, job) -> int:
        return -(-self.slots_for(job) // self.bs) if job.req.id in self.arena.regions else 0

    def blocks_for(self, job, n: int) -> int:
        return 0

    def lookup(self, job) -> list[int]:
        return []

    def admission_bound(self, job) -> int:
        return -(-self.slots_for(job) // self.bs)

    def admission_need(self, job, hits, n: int) -> int:
        return -(-self.slots_for(job) // self.bs)

    def admit(self, job) -> None:
        self.arena.reserve(job.req.id, self.slots_for(job))
        self.clock.tick()
        job.computed = 0

    def execute(self, batch) -> None:
        self._tokens += sum(n for _, n in batch)

    def release(self, job) -> None:
        if job.req.id in self.arena.regions:
            self.arena.release(job.req.id)
            self.clock.tick()
            self._tokens -= job.computed

    def swap_out(self, job) -> int:
        raise ConfigError(f"request {job.req.id}: the contiguous baseline never preempts (its regions never grow)")

    swap_in = swap_out

    def swap_need(self, job) -> int:
        return 0

    def swappable(self, job) -> int:
        return 0

    def gauges(self) -> tuple[int, int, float]:
        return self.arena.reserved, self._tokens, self.arena.fragmentation()

    def hit_rate(self) -> float:
        return 0.0

    def check_invariants(self) -> None:
        self.arena.check_invariants()
        assert self._tokens >= 0, f"token count {self._tokens} < 0"
