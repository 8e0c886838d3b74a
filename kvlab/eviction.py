"""Eviction policies (text §2.2.2, ``BlockPool.evict_block``).

A policy orders the pool's *evictable* blocks: ALLOCATED blocks with refcount 0 that still hold reusable data
(cached blocks). Referenced blocks are never in the set, so a policy can never pick one; when the pool vetoes a
candidate (a prefix-cache head whose child is still cached) it simply takes the next one. Every policy can rank
its candidates with scores (lower score = evicted sooner), which is what a widget shows to explain a choice.

Cost per operation: LRU is O(1) (an insertion-ordered dict); FIFO (by creation), LFU and random use a heap
with lazy deletion, O(log n). The text's version scanned every
active block with ``min`` on each eviction, O(n).
"""
from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .pool import BlockPool


class EvictionPolicy:
    """Interface: the pool calls ``add`` when a block becomes evictable, ``discard`` when it stops being
    evictable (referenced again, freed or evicted), and ``order`` to walk candidates, best victim first."""

    name = "base"

    def bind(self, pool: "BlockPool") -> "EvictionPolicy":
        self.pool = pool
        return self

    def add(self, block_id: int) -> None:
        raise NotImplementedError

    def discard(self, block_id: int) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, block_id: int) -> bool:
        raise NotImplementedError

    def order(self) -> Iterator[tuple[int, float]]:
        """Evictable blocks as ``(block_id, score)``, the block to evict first coming first."""
        raise NotImplementedError

    def touched(self, block_id: int) -> None:
        """Evictable ``block_id`` was read (its last access and hits changed): re-rank it."""
        self.discard(block_id)
        self.add(block_id)

    def relabel(self, moved: dict[int, int]) -> None:
        """Evictable blocks moved ``old -> new`` (compaction copied their stamps): same place in the order."""
        for old, new in moved.items():
            self.discard(old)
            self.add(new)

    def rank(self, k: int = 8) -> list[tuple[int, float]]:
        """The first ``k`` candidates with their scores."""
        out: list[tuple[int, float]] = []
        for item in self.order():
            if len(out) == k:
                break
            out.append(item)
        return out


class LRUPolicy(EvictionPolicy):
    """Least recently used first. A block's last access is stamped when its last reference is dropped, so the
    insertion order of the evictable set *is* LRU order; score = last access time."""

    name = "lru"

    def __init__(self) -> None:
        self._set: dict[int, None] = {}

    def add(self, block_id: int) -> None:
        self._set[block_id] = None

    def discard(self, block_id: int) -> None:
        self._set.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._set)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._set

    def relabel(self, moved: dict[int, int]) -> None:
        self._set = {moved.get(b, b): None for b in self._set}

    def order(self) -> Iterator[tuple[int, float]]:
        last = self.pool.fields.last_access
        return ((b, float(last[b])) for b in self._set)


class _HeapPolicy(EvictionPolicy):
    """Evictable blocks in a heap keyed by ``key(block_id)``, with lazy deletion of stale entries."""

    def __init__(self) -> None:
        self._keys: dict[int, tuple[float, ...]] = {}
        self._heap: list[tuple[tuple[float, ...], int]] = []

    def key(self, block_id: int) -> tuple[float, ...]:
        raise NotImplementedError

    def add(self, block_id: int) -> None:
        k = self.key(block_id)
        self._keys[block_id] = k
        heapq.heappush(self._heap, (k, block_id))
        if len(self._heap) > 2 * len(self._keys) + 64:  # drop stale entries so the heap stays O(live)
            self._heap = [(k, b) for b, k in self._keys.items()]
            heapq.heapify(self._heap)

    def discard(self, block_id: int) -> None:
        self._keys.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._keys

    def order(self) -> Iterator[tuple[int, float]]:
        heap, keys = self._heap, self._keys
        while heap and keys.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        if not heap:
            return
        yield heap[0][1], float(heap[0][0][0])  # the common case wants only the victim: O(1) after cleaning
        k = 8  # then widen lazily: each round is one O(n) partial selection, not a full sort
        while True:
            top = heapq.nsmallest(k, ((key, b) for b, key in keys.items()))
            for key, b in top[k // 2 if k > 8 else 1:]:  # the heap top is the smallest live key
                yield b, float(key[0])
            if len(top) < k:
                return
            k *= 2


class FIFOPolicy(_HeapPolicy):
    """Oldest block first (by creation time, the text's ``creation_time``); score = creation time."""

    name = "fifo"

    def key(self, block_id: int) -> tuple[float, ...]:
        return (self.pool.fields.created[block_id], block_id)


class LFUPolicy(_HeapPolicy):
    """Least frequently used first (allocations + references taken), ties broken by LRU; score = use count."""

    name = "lfu"

    def key(self, block_id: int) -> tuple[float, ...]:
        return (self.pool.fields.hits[block_id], self.pool.fields.last_access[block_id], block_id)


class RandomPolicy(_HeapPolicy):
    """A uniformly random evictable block, reproducible with its seed. Each block draws a random key from the
    seeded generator when it becomes evictable, and the smallest key goes first: the minimum of independent
    uniform draws is a uniform choice. Draws happen only when the pool changes, so asking for a ranking (a view
    does, ``check_invariants`` does) never changes which victims later evictions pick. Score = the draw."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def key(self, block_id: int) -> tuple[float, ...]:
        return (self._rng.random(), block_id)

    def touched(self, block_id: int) -> None:
        """A read changes nothing for a random choice."""

    def relabel(self, moved: dict[int, int]) -> None:
        """Moved blocks keep their draws."""
        for old, new in moved.items():
            k = (self._keys.pop(old)[0], new)
            self._keys[new] = k
            heapq.heappush(self._heap, (k, new))


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy, "fifo": FIFOPolicy, "lfu": LFUPolicy, "random": RandomPolicy,
}


def make_policy(policy: "str | EvictionPolicy", seed: int = 0) -> EvictionPolicy:
    """A policy from its name (``lru``, ``fifo``, ``lfu``, ``random``) or an :class:`EvictionPolicy` instance."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if policy == "random":
        return RandomPolicy(seed)
    try:
        return POLICIES[policy]()
    except (KeyError, TypeError):
        raise ConfigError(f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}") from None
