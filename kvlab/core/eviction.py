"""Eviction policies (text §2.2.2, the text's ``evict_block``).

A policy orders the pool's *evictable* blocks: ALLOCATED blocks with refcount 0 that still hold reusable data
(cached blocks). Invariant (:meth:`BlockPool.check_invariants`): the policy holds exactly the cached blocks, each
once. Referenced blocks are never in the set, so a policy can never pick one (the text picked its LRU block first
and checked the refcount after); when the pool vetoes a candidate (a prefix-cache head whose child is still
cached) it simply takes the next one. Every policy can rank
its candidates with scores (lower score = evicted sooner), which is what a widget shows to explain a choice.

Cost per operation: LRU is O(1) (an insertion-ordered dict), CLOCK O(1) amortised (a ring with a hand); FIFO
(by creation), LFU and Belady's OPT use a heap with lazy deletion, O(log n); random draws from a list, O(1).
The text's version scanned every active block with ``min`` on each eviction, O(n). ``docs/eviction.md``
compares them all and shows how to write a policy of your own.
"""
from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvlab.core.checks import check_list, check_real, check_seed, is_int
from kvlab.core.errors import ConfigError

if TYPE_CHECKING:
    from kvlab.core.pool import BlockPool


class EvictionPolicy:
    """Interface: the pool calls ``add`` when a block becomes evictable, ``discard`` when it stops being
    evictable (referenced again, freed or evicted), and ``order`` to walk candidates, best victim first. Walking
    ``order`` (or ``rank``) changes no later choice: the pool says which candidate it took with ``evicting``.
    A policy with ``walk_survives_discard`` lets a walk go on after ``discard`` of blocks it has passed (an
    eviction in the middle of a walk leaves the order of the rest as it was)."""

    name = "base"
    walk_survives_discard = False

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

    def evicting(self, block_id: int) -> None:
        """The pool evicts ``block_id``, a candidate of the ``order`` just walked (``discard`` follows). Only a
        policy whose state moves with its choice needs this (CLOCK's hand); the others keep no such state."""

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
        # An OrderedDict, not a dict: a dict leaves a hole where its oldest key was popped, and finding the first
        # key again steps over every hole since the last resize (~100 us per eviction at a million cached blocks).
        self._set: OrderedDict[int, None] = OrderedDict()

    def add(self, block_id: int) -> None:
        self._set[block_id] = None

    def discard(self, block_id: int) -> None:
        self._set.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._set)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._set

    def relabel(self, moved: dict[int, int]) -> None:
        self._set = OrderedDict((moved.get(b, b), None) for b in self._set)

    def order(self) -> Iterator[tuple[int, float]]:
        last = self.pool.fields.last_access
        return ((b, float(last[b])) for b in self._set)


class ClockPolicy(EvictionPolicy):
    """CLOCK (second chance), as OS page caches use it: the evictable blocks on a ring with a hand and a reference
    bit each. A new block enters just behind the hand with its bit clear; a read (``touched``) sets the bit. To
    evict, the hand sweeps: a block with its bit set loses the bit and is passed (its second chance), the first
    block without it is the victim, and the hand stops just after it.

    The ring is kept as an ordered dict read from the hand on (block -> bit), so passing the hand over a block is
    moving it to the end. ``order`` only reads: the blocks without a bit in ring order, then those with one (the
    sweep clears their bits and comes round to them). The pool may pass candidates over (a guard veto), so the
    hand moves when the pool names its victim (``evicting``): every block before it is passed, losing its bit.
    A failed eviction (every candidate vetoed) moves nothing. Score = position in the sweep (0 goes first).

    Cost: O(1) amortised; a sweep passes a block with its bit set once per read that set it, plus the candidates
    the pool itself passed over. Without reads of cached blocks and without vetoes the order is LRU's (a
    referenced block leaves the ring and comes back behind the hand); a read block keeps its place instead of
    moving to the end, and a vetoed one is passed: it goes behind the hand, where LRU would keep it first.
    """

    name = "clock"

    def __init__(self) -> None:
        self._ring: OrderedDict[int, bool] = OrderedDict()  # from the hand on: block -> reference bit

    def add(self, block_id: int) -> None:
        self._ring.setdefault(block_id, False)  # behind the hand, unreferenced

    def discard(self, block_id: int) -> None:
        self._ring.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._ring)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._ring

    def touched(self, block_id: int) -> None:
        """A read sets the reference bit; the block keeps its place on the ring."""
        if block_id in self._ring:
            self._ring[block_id] = True

    def referenced(self) -> int:
        """How many blocks on the ring have their reference bit set (read in place since the hand passed them)."""
        return sum(self._ring.values())

    def relabel(self, moved: dict[int, int]) -> None:
        """Moved blocks keep their place and bit."""
        self._ring = OrderedDict((moved.get(b, b), bit) for b, bit in self._ring.items())

    def order(self) -> Iterator[tuple[int, float]]:
        pos = 0
        for wanted in (False, True):  # first round: the unreferenced; second: the rest, their bits now cleared
            for b, bit in self._ring.items():
                if bit == wanted:
                    yield b, float(pos)
                    pos += 1

    def evicting(self, block_id: int) -> None:
        """The hand sweeps to ``block_id``: each block before it is passed (bit cleared, moved behind the hand).
        If ``block_id`` still has its bit, the hand went round once already and cleared every bit."""
        ring = self._ring
        if ring[block_id]:
            ring.update(dict.fromkeys(ring, False))
        while (b := next(iter(ring))) != block_id:
            ring.move_to_end(b)
            ring[b] = False


def _in_key_order(heap: list[tuple[tuple[float, ...], int]],
                  live: dict[int, tuple[float, ...]]) -> Iterator[tuple[tuple[float, ...], int]]:
    """The live entries of ``heap`` (those whose key ``live`` still holds) in key order, each block once, without
    changing the heap: a best-first walk of its tree, whose children are never smaller than their parent. The
    k-th entry costs O(log k) (plus the stale entries on the way), not the O(n) of sorting the whole heap."""
    seen: set[int] = set()
    frontier = [(heap[0], 0)] if heap else []
    while frontier:
        (key, b), i = heapq.heappop(frontier)
        if b not in seen and live.get(b) == key:
            seen.add(b)
            yield key, b
        for child in (2 * i + 1, 2 * i + 2):
            if child < len(heap):
                heapq.heappush(frontier, (heap[child], child))


class _HeapPolicy(EvictionPolicy):
    """Evictable blocks in a heap keyed by ``key(block_id)``, with lazy deletion of stale entries. A walk checks
    each entry against the live keys, so a discard does not disturb it, nor does a second walk (which leaves
    stale entries on top of the heap while another walk is under way); an add (the heap itself changes) does."""

    walk_survives_discard = True

    def __init__(self) -> None:
        self._keys: dict[int, tuple[float, ...]] = {}
        self._heap: list[tuple[tuple[float, ...], int]] = []
        self._changes = 0  # a walk of the heap is void once the heap changed under it
        self._walks = 0  # walks under way: while one is, another must not pop the heap under it

    def key(self, block_id: int) -> tuple[float, ...]:
        raise NotImplementedError

    def add(self, block_id: int) -> None:
        self._set_key(block_id, self.key(block_id))

    def _set_key(self, block_id: int, k: tuple[float, ...]) -> None:
        self._changes += 1
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
        while not self._walks and heap and keys.get(heap[0][1]) != heap[0][0]:  # stale tops go: the victim is O(1)
            heapq.heappop(heap)
            self._changes += 1
        changes = self._changes
        self._walks += 1  # (a look at the ranking while the pool evicts, from a listener, must not void its walk)
        try:
            for key, b in _in_key_order(heap, keys):
                yield b, float(key[0])
                if self._changes != changes:
                    raise RuntimeError(f"the {self.name} policy changed while its order was walked")
        finally:
            self._walks -= 1

    def _carry(self, moved: dict[int, int]) -> None:
        """Moved blocks keep their keys (the block id in a key, its tie-break, becomes the new id)."""
        for old, new in moved.items():
            self._set_key(new, (*self._keys.pop(old)[:-1], new))


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


class RandomPolicy(EvictionPolicy):
    """A uniformly random evictable block, reproducible with its seed. Eviction number ``j`` draws its victims,
    without replacement, from the blocks evictable at that moment, with a generator seeded by ``(seed, j)``: each
    of them is equally likely, whatever happened before. Walking ``order`` (or ``rank``: a view does,
    ``check_invariants`` does) replays the same draws and moves nothing; only ``evicting`` goes on to ``j + 1``.
    Score = the position in this eviction's draw (0 goes first).

    Why not one random key per block, drawn when it becomes evictable, smallest first? The survivors of earlier
    evictions are the blocks whose keys were large, so a newly cached block would go first far more often than
    its share (on a Zipf workload: 94% of evictions took the newest block, where 1 in 32 was fair)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.seed = check_seed(seed)
        self._evictions = 0
        self._blocks: list[int] = []  # the candidates, in the order swap-removal leaves them
        self._at: dict[int, int] = {}  # candidate -> its index in _blocks
        self._changes = 0  # a walk is void once the candidates changed under it

    def add(self, block_id: int) -> None:
        if block_id not in self._at:
            self._at[block_id] = len(self._blocks)
            self._blocks.append(block_id)
            self._changes += 1

    def discard(self, block_id: int) -> None:
        i = self._at.pop(block_id, None)
        if i is None:
            return
        self._changes += 1
        last = self._blocks.pop()  # the last candidate fills the hole: O(1)
        if last != block_id:
            self._blocks[i] = last
            self._at[last] = i

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._at

    def order(self) -> Iterator[tuple[int, float]]:
        """This eviction's draw: a Fisher–Yates shuffle done lazily (the swaps in a dict; nothing copied)."""
        rng = random.Random(f"{self.seed}/{self._evictions}")
        blocks, n, changes = self._blocks, len(self._blocks), self._changes
        moved: dict[int, int] = {}
        for pos in range(n):
            j = rng.randrange(pos, n)
            yield moved.get(j, blocks[j]), float(pos)
            if self._changes != changes:
                raise RuntimeError(f"the {self.name} policy changed while its order was walked")
            moved[j] = moved.get(pos, blocks[pos])

    def evicting(self, block_id: int) -> None:
        self._evictions += 1

    def touched(self, block_id: int) -> None:
        """A read changes nothing for a random choice."""

    def relabel(self, moved: dict[int, int]) -> None:
        """Moved blocks keep their places (so the same draws pick them)."""
        places = [(self._at.pop(old), new) for old, new in moved.items() if old in self._at]
        self._changes += 1
        for i, new in places:
            self._blocks[i] = new
            self._at[new] = i


class OPTPolicy(_HeapPolicy):
    """Belady's OPT (MIN), offline: evict the cached block whose next use lies farthest in the future, a block
    never used again first. No online policy gets more hits from the same capacity, which makes it the ceiling
    to race the others against. It cannot know the future itself: ``next_use(block_id)`` says when the block's
    data will next be needed (a logical time, ``math.inf`` if never; :class:`FutureUses` answers it for content
    keys, the caller maps a block to its key). Score = minus the next use (lower goes sooner, as for every
    policy; ``-inf`` for never again); ties go to the lower block id. A read changes nothing: it is no future use.

    The future moves on, so next uses are asked again, but not of every block at every eviction. The oracle's
    contract: a block's answer changes only once the time it named has passed (a use happened, the next one is
    later). Then a stored answer that has not passed yet is still right, and it suffices to check the *soonest*
    stored answer: if the oracle still gives it, it lies ahead, so every later one does too. Answers found passed
    are re-asked and re-filed; each eviction costs O(log n) plus O(log n) per answer the future overtook.
    """

    name = "opt"

    def __init__(self, next_use: Callable[[int], float]) -> None:
        if not callable(next_use):
            raise ConfigError(f"OPTPolicy needs next_use(block_id) -> time of its next use, got {next_use!r}")
        super().__init__()
        self.next_use = next_use
        self._soon: list[tuple[float, int]] = []  # (stored next use, block), soonest first: finds passed answers

    def _ask(self, block_id: int) -> float:
        """The oracle's next use of ``block_id``, checked to be a time (a real number, numpy's too; not NaN)."""
        t = self.next_use(block_id)
        if type(t) is float and t == t:  # the usual answer (not NaN), passed without building a message
            return t
        return check_real(t, f"next_use({block_id})", finite=False, note=" (a time, inf if never)")

    def key(self, block_id: int) -> tuple[float, ...]:
        return (-self._ask(block_id), block_id)

    def _set_key(self, block_id: int, k: tuple[float, ...]) -> None:
        super()._set_key(block_id, k)
        heapq.heappush(self._soon, (-k[0], block_id))
        if len(self._soon) > 2 * len(self._keys) + 64:  # as for the main heap: O(live)
            self._soon = [(-k[0], b) for b, k in self._keys.items()]
            heapq.heapify(self._soon)

    def touched(self, block_id: int) -> None:
        """A read is no future use: nothing to re-rank."""

    def relabel(self, moved: dict[int, int]) -> None:
        """Moved blocks keep their stored next uses (the pool moves blocks before its hooks tell who holds what,
        so the oracle may not know the new ids yet; a stored use is re-asked once it has passed)."""
        self._carry(moved)

    def order(self) -> Iterator[tuple[int, float]]:
        self._refresh()
        return super().order()

    def _refresh(self) -> None:
        """Re-ask the oracle, soonest stored next use first, until one is still what the oracle says."""
        while self._soon:  # (re-filing may rebuild the list: read it afresh each time)
            t, b = self._soon[0]
            k = self._keys.get(b)
            if k is None or -k[0] != t:  # a stale entry: the block left or was re-filed
                heapq.heappop(self._soon)
                continue
            now = self._ask(b)
            if now == t:
                return
            super()._set_key(b, (-now, b))  # the victim heap; this heap's top is replaced in one sift
            heapq.heapreplace(self._soon, (now, b))


class FutureUses:
    """Every future use of every content key, the oracle behind :class:`OPTPolicy`. ``keys_per_request[i]`` are
    the keys request ``i`` will look up, requests in arrival order (for prefix caching: its chained block hashes,
    see :meth:`kvlab.PrefixCache.future_uses`). Time runs over the uses one by one (request 0's keys, then
    request 1's, ...), so that within a request the earlier blocks of a prompt are needed sooner.
    ``advance(i)`` says request ``i`` is being admitted: now = its first use. ``next_use(key)`` = the time of
    the first use of ``key`` at or after now, ``math.inf`` if none; it changes only once now passes it, as
    :class:`OPTPolicy` requires.

    Example, given ``key_of(block_id)`` (the engine's map from a cached block to its hash)::

        future = PrefixCache.future_uses(prompts, block_size)
        policy = OPTPolicy(lambda b: future.next_use(key_of(b)))
        ...  # future.advance(i) before admitting request i
    """

    def __init__(self, keys_per_request: Sequence[Sequence[Hashable]]) -> None:
        check_list(keys_per_request, "keys_per_request must be a list of key lists, one per request")
        uses: dict[Hashable, list[int]] = {}  # key -> its use times, ascending
        starts = [0]  # starts[i]: the time of request i's first use; the last entry: the end of time
        t = 0
        for i, keys in enumerate(keys_per_request):
            check_list(keys, f"request {i}: its keys must be a list")
            for key in keys:
                if not isinstance(key, Hashable):
                    raise ConfigError(f"request {i}: key {key!r:.80} is not hashable")
                uses.setdefault(key, []).append(t)
                t += 1
            starts.append(t)
        self._uses, self._starts = uses, starts
        self.request = 0  # the request being admitted
        self.now = 0  # its first use

    def __len__(self) -> int:
        """The number of requests."""
        return len(self._starts) - 1

    def advance(self, request: int) -> None:
        """Request ``request`` is being admitted: now = its first use. Time only moves forward; ``len(self)``
        is the end, where every use lies in the past."""
        if not is_int(request) or not 0 <= request <= len(self):
            raise ConfigError(f"request must be an int in 0..{len(self)}, got {request!r}")
        if request < self.request:
            raise ConfigError(f"the future only moves forward: request {request} comes before request "
                              f"{self.request}, already admitted")
        self.request, self.now = int(request), self._starts[request]

    def next_use(self, key: Hashable) -> float:
        """The time of the first use of ``key`` at or after now; ``math.inf`` if it is never used again."""
        try:
            times = self._uses.get(key, ())
        except TypeError:  # unhashable
            raise ConfigError(f"next_use: key {key!r:.80} is not hashable") from None
        i = bisect_left(times, self.now)
        return float(times[i]) if i < len(times) else math.inf


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy, "fifo": FIFOPolicy, "lfu": LFUPolicy, "random": RandomPolicy, "clock": ClockPolicy,
}


def make_policy(policy: "str | EvictionPolicy", seed: int = 0,
                next_use: Callable[[int], float] | None = None) -> EvictionPolicy:
    """A policy from its name (``lru``, ``fifo``, ``lfu``, ``random``, ``clock``; ``opt`` with its
    ``next_use`` oracle) or an :class:`EvictionPolicy` instance."""
    check_seed(seed)
    if isinstance(policy, EvictionPolicy):
        return policy
    if policy == "random":
        return RandomPolicy(seed)
    if policy == "opt":
        if next_use is None:
            raise ConfigError("the 'opt' policy (Belady) must know the future: pass OPTPolicy(next_use) as the "
                              "policy, where next_use(block_id) is the time the block is needed next (inf if "
                              "never), e.g. lambda b: future.next_use(key_of(b)) with future = "
                              "FutureUses(keys_per_request) or PrefixCache.future_uses(prompts, block_size)")
        return OPTPolicy(next_use)
    try:
        return POLICIES[policy]()
    except (KeyError, TypeError):
        raise ConfigError(f"unknown eviction policy {policy!r}; choose one of {sorted([*POLICIES, 'opt'])}") \
            from None
