"""Exact eviction orders: every policy on scenarios whose creation, last-access and hit stamps all differ, so each
policy's victim list is unique to its key (LRU: last access; FIFO: creation; LFU: hits, then last access; CLOCK:
ring order with second chances; OPT: the farthest next use).
Also: touch re-ranks under LRU and LFU but not FIFO, random replays with its seed, sequences release tail first,
CLOCK against a textbook ring with a hand, OPT against a brute-force Belady and every other policy."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _util import assert_same_state, pool_state, small_spec
from kvlab import (BlockPool, ConfigError, EventRecorder, Evicted, FastBlockPool, OutOfBlocksError, PrefixCache,
                   PyFastBlockPool)
from kvlab.core.eviction import ClockPolicy, FutureUses, OPTPolicy, make_policy
from kvlab.core.sequence import SequenceManager
from kvlab.textbook.pool import TextbookPool

SPEC = small_spec()
POOLS = {"reference": BlockPool, "fast": FastBlockPool}
if PyFastBlockPool is not FastBlockPool:  # compiled: test its Python paths too
    POOLS["fast-python"] = PyFastBlockPool
each_pool = pytest.mark.parametrize("cls", list(POOLS.values()), ids=list(POOLS))
INF = math.inf
FAR = {2: 5.0, 0: INF, 4: 1.0, 1: 3.0, 3: INF}  # the scenario's next uses, for OPT: 0 and 3 are never used again


def named(policy: str):
    """The pool's eviction_policy argument for ``policy``: OPT needs its oracle (here the fixed ``FAR``)."""
    return OPTPolicy(FAR.__getitem__) if policy == "opt" else policy


def scenario(policy: str, cls=BlockPool, touch: bool = False, seed: int = 0) -> BlockPool:
    """Five cached blocks with distinct stamps (step: what), one block FREE:

    ====== ======= =========== ====
    block  created last access hits
    ====== ======= =========== ====
    2      1       13          1
    0      2       11          3
    4      3       12          1
    1      4       9           2
    3      5       10          2
    ====== ======= =========== ====

    ``touch`` then reads block 1 three times at step 14 (last access 14, hits 5). CLOCK's ring is the order
    they were cached in: 1, 3, 0, 4, 2."""
    pool = cls(6, spec=SPEC, eviction_policy=named(policy), seed=seed)
    for b in (2, 0, 4, 1, 3):  # steps 1..5
        pool.allocate(1, block_id=b)
    pool.incref([0, 0])  # 6
    pool.touch([1])  # 7
    pool.incref([3])  # 8
    for ids in ([1], [3, 3], [0, 0, 0], [4], [2]):  # 9..13
        pool.decref(ids)
    assert pool.clock.now() == 13 and pool.num_cached_blocks == 5
    if touch:
        pool.touch([1, 1, 1])  # 14
    return pool


EXPECTED = {  # (policy, touched) -> victims
    ("lru", False): [1, 3, 0, 4, 2],
    ("lru", True): [3, 0, 4, 2, 1],  # the read makes 1 the most recently used
    ("fifo", False): [2, 0, 4, 1, 3],
    ("fifo", True): [2, 0, 4, 1, 3],  # reading does not make a block younger
    ("lfu", False): [4, 2, 1, 3, 0],
    ("lfu", True): [4, 2, 3, 0, 1],  # three reads: 1 is now the most used
    ("clock", False): [1, 3, 0, 4, 2],  # the ring from the hand
    ("clock", True): [3, 0, 4, 2, 1],  # 1 is read: the hand passes it once (second chance), then it is last
    ("opt", False): [0, 3, 2, 1, 4],  # never used again (ties: lower id), then the farthest next use
    ("opt", True): [0, 3, 2, 1, 4],  # a read is no future use
}


@each_pool
@pytest.mark.parametrize("policy, touch", list(EXPECTED))
def test_explicit_evictions_in_exact_order(cls, policy, touch):
    pool = scenario(policy, cls, touch)
    assert [b for b, _ in pool.policy.rank(10)] == EXPECTED[policy, touch]
    victims = [pool.evict() for _ in range(5)]
    assert victims == EXPECTED[policy, touch]
    assert pool.evict() is None
    pool.check_invariants()


@each_pool
@pytest.mark.parametrize("policy, touch", list(EXPECTED))
def test_allocation_pressure_evicts_in_exact_order(cls, policy, touch):
    pool = scenario(policy, cls, touch)
    rec = EventRecorder(pool.events)
    got = pool.allocate(6)  # the FREE block first, then the five victims in the policy's order
    assert got == [5, *EXPECTED[policy, touch]]
    assert [e.block_id for e in rec.of(Evicted)] == EXPECTED[policy, touch]
    assert all(e.reason == "allocation pressure" and e.policy == policy for e in rec.of(Evicted))
    pool.check_invariants()


@pytest.mark.parametrize("policy, scores", [
    ("lru", [9.0, 10.0, 11.0, 12.0, 13.0]),  # last access
    ("fifo", [1.0, 2.0, 3.0, 4.0, 5.0]),  # creation
    ("lfu", [1.0, 1.0, 2.0, 2.0, 3.0]),  # hits
    ("clock", [0.0, 1.0, 2.0, 3.0, 4.0]),  # place in the sweep
    ("opt", [-INF, -INF, -5.0, -3.0, -1.0]),  # minus the next use
])
def test_rank_scores_are_the_policy_keys(policy, scores):
    pool = scenario(policy)
    assert [s for _, s in pool.policy.rank(10)] == scores


def test_fifo_is_by_creation_even_when_access_order_is_the_reverse():
    pool = BlockPool(8, spec=SPEC, eviction_policy="fifo")
    made = [4, 1, 6, 0, 3]
    for b in made:  # created at steps 1..5
        pool.allocate(1, block_id=b)
    for b in made[::-1]:  # released (accessed) newest first: LRU would evict 3, 0, 6, 1, 4
        pool.incref([b])
        pool.decref([b, b])
    pool.touch([4])  # the oldest is read last
    assert [pool.evict() for _ in range(5)] == made


def test_fifo_counts_a_reallocated_block_as_new():
    pool = BlockPool(4, spec=SPEC, eviction_policy="fifo")
    (a,), (b,), (c,) = (pool.allocate(1) for _ in range(3))  # created at steps 1, 2, 3
    pool.free([a])
    assert pool.allocate(1) == [a]  # the same block, a new allocation: now the youngest
    pool.decref([a, c, b])
    assert [pool.evict() for _ in range(3)] == [b, c, a]


def test_lfu_orders_by_hits_then_least_recent():
    pool = BlockPool(8, spec=SPEC, eviction_policy="lfu")
    pool.allocate(5)  # blocks 0..4 at step 1, one hit each
    pool.incref([2, 2, 2])  # 2: 4 hits
    pool.incref([0])  # 0: 2 hits
    pool.incref([4, 4])  # 4: 3 hits
    for ids in ([2] * 4, [0] * 2, [4] * 3, [3], [1]):  # cached at steps 5..9
        pool.decref(ids)
    assert [b for b, _ in pool.policy.rank(10)] == [3, 1, 0, 4, 2]  # 3 and 1 tie on hits: 3 is older
    pool.touch([3, 3, 3])  # 3: 4 hits, newest: after 2 (4 hits, older)
    assert [b for b, _ in pool.policy.rank(10)] == [1, 0, 4, 2, 3]
    pool.touch([1])  # 1: 2 hits, ties 0 (2 hits) but is newer
    assert [pool.evict() for _ in range(5)] == [0, 1, 4, 2, 3]


def test_lru_touch_and_re_reference_move_a_block_last():
    pool = BlockPool(8, spec=SPEC)
    ids = [pool.allocate(1)[0] for _ in range(6)]  # 0..5, created 1..6
    for b in (3, 0, 5, 1, 4, 2):
        pool.decref([b])
    pool.incref([5])
    pool.decref([5])  # cached again, now the newest
    pool.touch([1])  # read while cached: the newest
    assert [pool.evict() for _ in range(6)] == [3, 0, 4, 2, 5, 1]
    assert ids == list(range(6))


def drawn_victims(seed: int, n: int = 16, k: int = 8) -> list[int]:
    """What the random policy must evict, derived here: the candidates sit in a list (cached in order 0..n-1, a
    victim's place taken by the last one), and eviction j takes the place random.Random(f"{seed}/{j}") draws."""
    blocks, out = list(range(n)), []
    for j in range(k):
        i = random.Random(f"{seed}/{j}").randrange(len(blocks))
        out.append(blocks[i])
        last = blocks.pop()
        if i < len(blocks):
            blocks[i] = last
    return out


RANDOM_VICTIMS = {seed: drawn_victims(seed) for seed in (0, 7)}


def random_victims(seed: int, between=None) -> list[int]:
    """Eight victims of the random policy over 16 cached blocks; ``between(pool)`` runs before each eviction."""
    pool = BlockPool(16, spec=SPEC, eviction_policy="random", seed=seed)
    pool.decref(pool.allocate(16))
    out = []
    for _ in range(8):
        if between is not None:
            between(pool)
        out.append(pool.evict())
    return out


@pytest.mark.parametrize("seed", sorted(RANDOM_VICTIMS))
def test_random_replays_with_its_seed(seed):
    assert random_victims(seed) == random_victims(seed) == RANDOM_VICTIMS[seed]
    cached = lambda p: [b for b in range(16) if p.is_cached(b)]  # noqa: E731
    assert random_victims(seed, lambda p: p.touch(cached(p)[:3])) == RANDOM_VICTIMS[seed]  # reads change nothing
    assert random_victims(seed, lambda p: EventRecorder(p.events)) == RANDOM_VICTIMS[seed]  # nor does listening


@pytest.mark.parametrize("look", [lambda p: p.policy.rank(16), lambda p: TextbookPool(p).get_memory_usage(),
                                  lambda p: p.check_invariants()], ids=["rank", "memory_usage", "invariants"])
def test_random_victims_do_not_depend_on_who_looked(look):
    assert random_victims(0, look) == RANDOM_VICTIMS[0]


def test_random_seeds_differ():
    assert RANDOM_VICTIMS[0] != RANDOM_VICTIMS[7]


def test_random_is_fair_to_a_newly_cached_block():
    """32 cached blocks; each step evicts one and caches a fresh block in its place. A uniform choice takes the
    newest block 1 time in 32; one key drawn per block when cached (smallest first) took it most of the time,
    because the blocks that survived evictions are those whose keys were large."""
    pool = BlockPool(32, spec=SPEC, eviction_policy="random", seed=3)
    pool.decref(pool.allocate(32))
    newest, hits, steps = None, 0, 2000
    for _ in range(steps):
        victim = pool.evict()
        hits += victim == newest
        newest = pool.allocate(1)[0]
        pool.decref([newest])
    assert 0.5 / 32 < hits / steps < 2 / 32, hits


@each_pool
def test_a_finished_sequence_is_evicted_tail_first(cls):
    pool = cls(8, spec=SPEC)
    mgr = SequenceManager(pool)
    s = mgr.create()
    s.append(4 * 4 - 1)  # 4 blocks, one call: one creation and access stamp
    table = list(s.block_table)
    pool.mark_reusable(table)
    s.free()
    assert [b for b, _ in pool.policy.order()] == table[::-1]
    other = mgr.create()
    other.append(4 * 6)  # 4 FREE blocks, then 2 evicted: the sequence's tail first
    assert other.block_table[4:] == table[::-1][:2]
    assert [pool.evict() for _ in range(2)] == table[::-1][2:]
    mgr.check_invariants()


def test_migration_keeps_lru_order():
    pool = BlockPool(8, spec=SPEC)
    ids = pool.allocate(3)
    for b in ids:  # cached at steps 2, 3, 4
        pool.decref([b])
    pool.migrate([ids[0]], [7])
    assert pool.fields.last_access[7] == 2
    assert [pool.evict() for _ in range(3)] == [7, ids[1], ids[2]]


@each_pool
def test_allocation_refused_by_the_guard_changes_nothing(cls):
    """The capacity check counts only what the guard lets go, so a refused allocation evicts nothing, takes no
    block and leaves the clock, stacks, policy and counters as they were; what the guard allows still works."""
    pool = cls(4, spec=SPEC)
    ids = pool.allocate(4)
    pool.decref(ids)
    pool.evict_guard = lambda b: b != ids[0]  # ids[0] may never be evicted
    before, seen = pool_state(pool), EventRecorder(pool.events)
    with pytest.raises(OutOfBlocksError, match="the guard lets 3 go"):
        pool.allocate(4)
    assert_same_state(before, pool_state(pool))
    assert not seen.events
    assert sorted(pool.allocate(3)) == sorted(ids[1:])
    pool.check_invariants()


def test_a_guard_that_changes_its_verdict_midway_leaks_no_block():
    """A guard that breaks the promise the capacity check relies on (it vetoes everything once one block is
    evicted) ends the reference's allocation mid-way: the blocks taken go back FREE, none is left without a
    holder. (The fast pools rely on the same promise to take several victims per walk of the policy.)"""
    pool = BlockPool(4, spec=SPEC)
    ids = pool.allocate(4)
    pool.decref(ids)
    evicted: list[int] = []
    pool.evict_hooks.append(evicted.append)
    pool.evict_guard = lambda b: not evicted
    with pytest.raises(OutOfBlocksError):
        pool.allocate(4)
    pool.check_invariants()
    assert len(evicted) == 1 and pool.num_free_blocks == 1  # the one eviction made stays; its block is FREE
    assert pool.status_counts()["ALLOCATED"] == pool.num_cached_blocks == 3
    pool.evict_guard = None
    assert sorted(pool.allocate(4)) == sorted(ids)


def cached_chain(cls, n: int = 6, length: int = 4) -> tuple[BlockPool, PrefixCache, list[int]]:
    """A pool of ``n`` blocks with one registered chain of ``length`` blocks, all cached (refcount 0)."""
    pool = cls(n, spec=SPEC)
    cache = PrefixCache(pool)
    chain = pool.allocate(length)
    cache.store_blocks(chain, list(range(length * SPEC.block_size)))
    pool.free(chain)
    return pool, cache, chain


@each_pool
def test_a_cached_chain_can_be_evicted_whole_tail_first(cls):
    """Only the tail passes the prefix guard now, yet the whole chain counts: evicting each tail frees its
    parent. An allocation needing all of it succeeds, taking the chain from its tail."""
    pool, cache, chain = cached_chain(cls)
    assert [b for b in chain if pool.evict_guard(b)] == [chain[-1]]
    got = EventRecorder(pool.events, (Evicted,))
    assert len(pool.allocate(6)) == 6
    assert [e.block_id for e in got] == chain[::-1] and len(cache) == 0
    pool.check_invariants()
    cache.check_invariants()


@each_pool
def test_a_chain_held_back_by_a_stale_entry_is_refused_before_any_eviction(cls):
    """A tail swapped out behind the cache's back stays registered (stale) and keeps its parent: the chain
    below it cannot go, so an allocation that needs it is refused with nothing changed."""
    pool, cache, chain = cached_chain(cls)
    pool.begin_eviction([chain[-1]])
    pool.finish_eviction([chain[-1]])  # FREE, but still registered: a stale entry
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 3
    before = pool_state(pool)
    with pytest.raises(OutOfBlocksError, match="the guard lets 0 go"):
        pool.allocate(4)
    assert_same_state(before, pool_state(pool))
    assert len(pool.allocate(3)) == 3  # the free blocks still serve


@each_pool
def test_a_chain_held_back_by_a_block_unmarked_while_held_is_refused_before_any_eviction(cls):
    """Unmarking a held block leaves its entry stale; once freed the block goes FREE and its parent can never
    go, nor the chain below: the allocation that needs them is refused with nothing changed."""
    pool = cls(6, spec=SPEC)
    cache = PrefixCache(pool)
    chain = pool.allocate(4)
    cache.store_blocks(chain, list(range(4 * SPEC.block_size)))
    pool.mark_reusable([chain[-1]], False)
    pool.free(chain)
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 3
    before = pool_state(pool)
    with pytest.raises(OutOfBlocksError, match="the guard lets 0 go"):
        pool.allocate(4)
    assert_same_state(before, pool_state(pool))
    cache.check_invariants()


@each_pool
def test_stale_hooks_hear_of_reusable_data_leaving_without_an_eviction(cls):
    """Told of each block that stops keeping reusable data outside an eviction: swapped out, or unmarked while
    held. Not told of a block that never was reusable, nor of a cached block unmarked (that one is released,
    which the evict hooks hear)."""
    pool = cls(8, spec=SPEC)
    told: list[list[int]] = []
    evicted: list[int] = []
    pool.stale_hooks.append(told.append)
    pool.evict_hooks.append(evicted.append)
    a, b, c, d = pool.allocate(4)
    pool.mark_reusable([a, b, d])
    pool.begin_eviction([a, c])  # a kept reusable data, c never did
    pool.mark_reusable([b], False)  # held: it stays, without reusable data
    pool.decref([d])
    pool.mark_reusable([d], False)  # cached: released
    assert told == [[a], [b]] and evicted == [d]


# ---------------------------------------------------------------------------------------------------- CLOCK
def clock_pool(cached: list[int], referenced: tuple[int, ...] = (), n: int = 8, cls=BlockPool) -> BlockPool:
    """``cached`` go onto CLOCK's ring in that order (the hand at the first); ``referenced`` are then read."""
    pool = cls(n, spec=SPEC, eviction_policy="clock")
    pool.allocate(n)
    for b in cached:
        pool.decref([b])
    if referenced:
        pool.touch(list(referenced))
    return pool


def ranked(pool: BlockPool) -> list[int]:
    return [b for b, _ in pool.policy.rank(pool.num_blocks)]


@each_pool
def test_clock_gives_a_read_block_a_second_chance_in_its_place(cls):
    pool = clock_pool([0, 1, 2], referenced=(0,), cls=cls)
    pool.decref([3])  # enters behind the hand, after 2: ring 0* 1 2 3
    assert ranked(pool) == [1, 2, 3, 0]
    assert pool.evict() == 1  # the hand passes 0 (clearing its bit) and stops after 1: ring 2 3 0
    assert ranked(pool) == [2, 3, 0]
    assert [pool.evict() for _ in range(3)] == [2, 3, 0]
    lru = BlockPool(8, spec=SPEC)  # LRU moves the read block to the end instead: 3 outlives it
    lru.allocate(8)
    for b in (0, 1, 2):
        lru.decref([b])
    lru.touch([0])
    lru.decref([3])
    assert [lru.evict() for _ in range(4)] == [1, 2, 0, 3]


def test_clock_hand_clears_bits_only_on_its_way():
    pool = clock_pool([0, 1, 2, 3], referenced=(0, 2))  # ring 0* 1 2* 3
    assert pool.evict() == 1  # 0 passed (bit cleared); 2 keeps its bit: ring 2* 3 0
    assert pool.evict() == 3  # 2 passed: ring 0 2
    pool.touch([0])  # ring 0* 2
    assert [pool.evict() for _ in range(2)] == [2, 0]


def test_clock_goes_round_once_when_every_block_was_read():
    pool = clock_pool([0, 1, 2], referenced=(0, 1, 2))
    assert [s for _, s in pool.policy.rank(8)] == [0.0, 1.0, 2.0]
    assert pool.evict() == 0  # one full round clears every bit, then the hand is back at 0
    pool.touch([1])  # ring 1* 2
    assert [pool.evict() for _ in range(2)] == [2, 1]


@each_pool
def test_clock_hand_passes_vetoed_blocks(cls):
    pool = clock_pool([0, 1, 2, 3], cls=cls)
    rec = EventRecorder(pool.events)
    pool.evict_guard = lambda b: b != 0
    assert pool.evict() == 1
    assert rec.of(Evicted)[0].candidates == ((1, 1.0), (0, 0.0), (2, 2.0), (3, 3.0))  # victim, passed over, next
    pool.evict_guard = None
    assert [pool.evict() for _ in range(3)] == [2, 3, 0]  # the hand went past 0: it is last now (LRU: 0, 2, 3)
    pool.check_invariants()


@each_pool
@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "random", "clock", "opt"])
def test_an_eviction_that_finds_no_victim_changes_nothing(cls, policy):
    """Every candidate vetoed: evict() returns None as on an empty pool, and the clock does not tick either."""
    pool = scenario(policy, cls, False)
    rec = EventRecorder(pool.events)
    pool.evict_guard = lambda b: False
    before = pool_state(pool)
    assert pool.evict() is None
    assert_same_state(before, pool_state(pool))
    assert not len(rec)
    pool.evict_guard = None
    assert pool.evict() == scenario(policy, cls, False).evict()  # the same victim as a pool never asked
    assert pool.clock.now() == before[3]["clock"] + 1


def test_clock_failed_eviction_moves_nothing():
    pool = clock_pool([0, 1, 2], referenced=(0,))
    pool.evict_guard = lambda b: False
    assert pool.evict() is None
    pool.evict_guard = None
    assert ranked(pool) == [1, 2, 0]
    assert [pool.evict() for _ in range(3)] == [1, 2, 0]


def test_clock_migration_keeps_place_and_bit():
    pool = clock_pool([0, 1, 2], referenced=(0,), n=8)
    pool.free([7])
    pool.migrate([0], [7])  # 0 moves to the block just freed: same place on the ring, bit still set
    assert ranked(pool) == [1, 2, 7]
    assert [pool.evict() for _ in range(3)] == [1, 2, 7]


def test_clock_under_allocation_pressure_evicts_in_sweep_order():
    pool = clock_pool([0, 1, 2, 3], referenced=(1,), n=4)
    assert pool.allocate(3) == [0, 2, 3]
    assert ranked(pool) == [1]


class TextbookClock:
    """CLOCK as a textbook draws it: a ring (a list), a hand (an index), one reference bit per block."""

    def __init__(self) -> None:
        self.ring: list[int] = []
        self.hand = 0
        self.bit: dict[int, bool] = {}

    def insert(self, b: int) -> None:
        """Just behind the hand, bit clear."""
        self.ring.insert(self.hand, b)
        self.bit[b] = False
        self.hand = self.hand + 1 if len(self.ring) > 1 else 0

    def remove(self, b: int) -> None:
        j = self.ring.index(b)
        del self.ring[j], self.bit[b]
        if j < self.hand:
            self.hand -= 1
        if self.hand == len(self.ring):
            self.hand = 0

    def evict(self, allowed=lambda b: True) -> int | None:
        """The hand clears set bits on its way and stops at the first allowed block without one. Two rounds
        without a victim: nothing is evicted and nothing moves."""
        bit, h = dict(self.bit), self.hand
        for _ in range(2 * len(self.ring)):
            b = self.ring[h]
            if bit[b]:
                bit[b] = False
            elif allowed(b):
                self.bit, self.hand = bit, h
                self.remove(b)
                return b
            h = (h + 1) % len(self.ring)
        return None

    def sweep(self) -> list[int | None]:
        """The victims of evicting everything from here, each allowed."""
        copy = TextbookClock()
        copy.ring, copy.hand, copy.bit = list(self.ring), self.hand, dict(self.bit)
        return [copy.evict() for _ in self.ring]


OPS = st.lists(st.tuples(st.sampled_from(["cache", "use", "touch", "evict", "release"]), st.integers(0, 2**16)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, listen=st.booleans())
def test_clock_matches_a_textbook_ring_with_a_hand(ops, listen):
    n = 8
    pool = BlockPool(n, spec=SPEC, eviction_policy="clock")
    if listen:  # the pool then walks past its victim for the event's candidates
        EventRecorder(pool.events)
    held = pool.allocate(n)
    model = TextbookClock()
    for op, x in ops:
        cached = list(model.ring)
        if op == "cache" and held:
            b = held.pop(x % len(held))
            pool.decref([b])
            model.insert(b)
        elif op in ("use", "touch", "release") and cached:
            b = sorted(cached)[x % len(cached)]
            if op == "use":
                pool.incref([b])
                model.remove(b)
                held.append(b)
            elif op == "touch":
                pool.touch([b])
                model.bit[b] = True
            else:
                pool.release_cached(b)
                model.remove(b)
        elif op == "evict":
            veto = {b for b in range(n) if x >> b & 1}
            pool.evict_guard = lambda b: b not in veto
            assert pool.evict() == model.evict(lambda b: b not in veto)
            pool.evict_guard = None
        assert ranked(pool) == model.sweep()
        assert [s for _, s in pool.policy.rank(n)] == [float(i) for i in range(len(model.ring))]
    pool.check_invariants()


# ---------------------------------------------------------------------------------------------------- OPT
def test_opt_re_asks_next_uses_the_future_has_passed():
    uses = {0: [20], 1: [8, 30], 2: [12], 3: []}
    pool = BlockPool(5, spec=SPEC)
    pool.policy = OPTPolicy(lambda b: min((t for t in uses[b] if t >= pool.clock.now()), default=INF)).bind(pool)
    pool.allocate(5)
    pool.decref([0, 1, 2, 3])  # step 2; block 4 stays held, and reading it moves the clock
    assert pool.policy.rank(4) == [(3, -INF), (0, -20.0), (2, -12.0), (1, -8.0)]
    while pool.clock.now() < 9:
        pool.touch([4])
    assert pool.policy.rank(4) == [(3, -INF), (1, -30.0), (0, -20.0), (2, -12.0)]  # 1 was used at 8: next at 30
    while pool.clock.now() < 13:
        pool.touch([4])
    assert pool.policy.rank(4) == [(2, -INF), (3, -INF), (1, -30.0), (0, -20.0)]  # 2's last use has passed
    assert [pool.evict() for _ in range(4)] == [2, 3, 1, 0]


def test_opt_evicts_dead_chains_tail_first_under_the_prefix_guard():
    a, b = list(range(13)), list(range(100, 109))  # 3 and 2 full blocks looked up ((len - 1) // 4)
    future = PrefixCache.future_uses([a, b, b], SPEC.block_size)  # a is never asked for again, b once more
    digest: dict[int, bytes] = {}
    pool = BlockPool(8, spec=SPEC, eviction_policy=OPTPolicy(lambda blk: future.next_use(digest[blk])))
    cache = PrefixCache(pool)
    for prompt in (a, b):
        ids, parent = pool.allocate(len(prompt) // 4), None
        for i, blk in enumerate(ids):
            parent = digest[blk] = cache.store(blk, prompt[4 * i:4 * i + 4], parent)
        pool.free(ids)
    future.advance(2)  # now = 5: b's blocks are used at 5 and 6
    assert pool.policy.rank(8) == [(0, -INF), (1, -INF), (2, -INF), (4, -6.0), (3, -5.0)]
    rec = EventRecorder(pool.events)
    assert [pool.evict() for _ in range(5)] == [2, 1, 0, 4, 3]  # a vetoed head waits for its tail
    assert rec.of(Evicted)[0].candidates == ((2, -INF), (0, -INF), (1, -INF), (4, -6.0), (3, -5.0))


def test_opt_migration_keeps_the_next_use():
    uses = {0: np.int64(5), 1: INF, 2: np.float32(3)}  # any real number is a time
    pool = BlockPool(8, spec=SPEC, eviction_policy=OPTPolicy(uses.__getitem__))
    pool.allocate(3)
    pool.decref([0, 1, 2])
    pool.migrate([1], [7])  # the oracle knows nothing of block 7: the stored next use moves with the block
    assert pool.policy.rank(8) == [(7, -INF), (0, -5.0), (2, -3.0)]


def paging_hits(accesses: list[int], capacity: int, policy: str) -> int:
    """Hits of ``policy`` on a cache of ``capacity`` blocks over the access string: a hit reads the cached block
    (``touch``), a miss allocates one (evicting the victim once the pool is full) and caches it."""
    future = FutureUses([[k] for k in accesses])
    key_of: dict[int, int] = {}
    block_of: dict[int, int] = {}
    chosen = OPTPolicy(lambda b: future.next_use(key_of[b])) if policy == "opt" else policy
    pool = BlockPool(capacity, spec=SPEC, eviction_policy=chosen, seed=5, with_storage=False)

    def forget(b: int) -> None:
        del block_of[key_of.pop(b)]

    pool.evict_hooks.append(forget)
    hits = 0
    for t, k in enumerate(accesses):
        future.advance(t)
        if k in block_of:
            hits += 1
            pool.touch([block_of[k]])
        else:
            (b,) = pool.allocate(1)
            key_of[b], block_of[k] = k, b
            pool.mark_reusable([b])
            pool.free([b])
    return hits


def belady_hits(accesses: list[int], capacity: int) -> int:
    """Belady's MIN by brute force: on a miss with a full cache, drop the key whose next access is farthest."""
    cache: set[int] = set()
    hits = 0
    for t, k in enumerate(accesses):
        if k in cache:
            hits += 1
            continue
        if len(cache) == capacity:
            rest = accesses[t + 1:]
            cache.remove(max(cache, key=lambda c: rest.index(c) if c in rest else len(rest)))
        cache.add(k)
    return hits


@settings(max_examples=200, deadline=None)
@given(accesses=st.lists(st.integers(0, 9), max_size=80), capacity=st.integers(1, 6))
def test_opt_is_belady_and_no_policy_beats_it(accesses, capacity):
    best = paging_hits(accesses, capacity, "opt")
    assert best == belady_hits(accesses, capacity)
    for policy in ("lru", "fifo", "lfu", "clock", "random"):
        assert paging_hits(accesses, capacity, policy) <= best, policy


def test_opt_beats_lru_on_a_loop_one_block_too_long():
    loop = list(range(5)) * 6  # LRU always evicts the block needed next: no hit at all
    assert paging_hits(loop, 4, "lru") == 0
    assert paging_hits(loop, 4, "opt") == belady_hits(loop, 4) > 0


def test_future_uses_time_runs_over_uses_and_only_forward():
    future = FutureUses([["a", "b"], [], ["b", "c"], ["a"]])  # times: a 0, b 1, b 2, c 3, a 4
    assert len(future) == 4
    assert [future.next_use(k) for k in "abcz"] == [0.0, 1.0, 3.0, INF]
    future.advance(2)
    assert [future.next_use(k) for k in "abc"] == [4.0, 2.0, 3.0]
    future.advance(np.int64(2))  # again (any integer type): no move
    future.advance(4)  # the end: every use is past
    assert [future.next_use(k) for k in "abc"] == [INF] * 3
    for bad in (3, 5, -1, True, 2.0, "1"):
        with pytest.raises(ConfigError, match="request"):
            future.advance(bad)
    assert future.request == 4


@pytest.mark.parametrize("bad, what", [("abc", "list of key lists"), (5, "list of key lists"),
                                       ([["a"], "bc"], "request 1"), ([[["unhashable"]]], "not hashable")])
def test_future_uses_rejects_what_is_not_keys_per_request(bad, what):
    with pytest.raises(ConfigError, match=what):
        FutureUses(bad)


def test_the_future_uses_of_prompts_are_the_chains_the_cache_looks_up():
    h0 = PrefixCache.block_hash(None, [0, 1, 2, 3])
    h1 = PrefixCache.block_hash(h0, [4, 5, 6, 7])
    t0 = PrefixCache.block_hash(None, [0, 1, 2, 3], "t")
    future = PrefixCache.future_uses([list(range(8)), list(range(9)), list(range(9))], 4, tenants=[None, None, "t"])
    assert [future.next_use(h) for h in (h0, h1, t0)] == [0.0, 2.0, 3.0]  # 8 tokens: one block looked up
    with pytest.raises(ConfigError, match="tenants"):
        PrefixCache.future_uses([[1, 2]], 4, tenants=[])
    with pytest.raises(ConfigError, match="block_size"):
        PrefixCache.future_uses([[1, 2]], 0)


def test_opt_needs_its_oracle():
    with pytest.raises(ConfigError, match=r"OPTPolicy\(next_use\).*FutureUses"):
        make_policy("opt")
    with pytest.raises(ConfigError, match="OPTPolicy"):
        BlockPool(4, spec=SPEC, eviction_policy="opt")
    with pytest.raises(ConfigError, match="next_use"):
        OPTPolicy(5)  # type: ignore[arg-type]
    assert isinstance(make_policy("opt", next_use=lambda b: 0.0), OPTPolicy)
    assert isinstance(make_policy("clock"), ClockPolicy)
    with pytest.raises(ConfigError, match="'clock'.*'opt'"):
        make_policy("belady")


@pytest.mark.parametrize("answer", ["soon", float("nan"), None, True, np.bool_(True), 1j])
def test_opt_rejects_an_oracle_that_gives_no_time(answer):
    pool = BlockPool(4, spec=SPEC, eviction_policy=OPTPolicy(lambda b: answer))
    (b,) = pool.allocate(1)
    with pytest.raises(ConfigError, match=rf"next_use\({b}\)"):
        pool.decref([b])


# ---------------------------------------------------------------------------------------------------- all of them
ALL = ("lru", "fifo", "lfu", "random", "clock", "opt")


def churn(policy: str, look=None, seed: int = 0) -> list[int | None]:
    """The victims of a seeded mix of caching, reuse, reads, vetoed evictions and allocation pressure;
    ``look(pool)`` runs before every step. OPT's oracle: block b is next used at the first t >= now with
    t = 7b (mod 11)."""
    rng = random.Random(seed)
    box: list[BlockPool] = []
    chosen = OPTPolicy(lambda b: (now := box[0].clock.now()) + (7 * b - now) % 11) if policy == "opt" else policy
    pool = BlockPool(12, spec=SPEC, eviction_policy=chosen, seed=3)
    box.append(pool)
    held = pool.allocate(12)
    pool.mark_reusable(held)
    victims: list[int | None] = []
    for _ in range(300):
        if look is not None:
            look(pool)
        cached = [b for b in range(12) if pool.is_cached(b)]
        r = rng.random()
        if r < 0.35 and held:
            pool.free([held.pop(rng.randrange(len(held)))])
        elif r < 0.5 and cached:
            b = rng.choice(cached)
            pool.incref([b])
            held.append(b)
        elif r < 0.65 and cached:
            pool.touch(rng.sample(cached, min(2, len(cached))))
        elif r < 0.85:
            veto = set(rng.sample(range(12), 3))
            pool.evict_guard = lambda b: b not in veto
            victims.append(pool.evict())
            pool.evict_guard = None
        elif pool.num_free_blocks + len(cached):
            got = pool.allocate(1)
            victims.append(got[0])
            pool.mark_reusable(got)
            held += got
    return victims


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("look", [lambda p: p.policy.rank(12), lambda p: TextbookPool(p).get_memory_usage(),
                                  lambda p: p.check_invariants(), lambda p: p.events.subscribe(lambda e: None)],
                         ids=["rank", "memory_usage", "invariants", "listening"])
def test_looking_never_changes_a_victim(policy, look):
    assert churn(policy, look) == churn(policy)


@pytest.mark.parametrize("policy", ALL)
def test_rank_then_evict_takes_the_first_ranked(policy):
    def check(pool):
        first = pool.policy.rank(1)
        if first and pool.evict_guard is None:
            assert pool.evict() == first[0][0]
    churn(policy, check)


@pytest.mark.parametrize("policy", ALL)
def test_walking_a_changed_heap_or_ring_is_refused(policy):
    """A walk that an eviction overtook: a heap policy's goes on with the rest in order (the pool evicts as it
    walks), any other policy's is refused; a block cached meanwhile refuses every walk."""
    pool = scenario(policy)
    walk, rest = pool.policy.order(), [b for b, _ in pool.policy.order()]
    next(walk)
    victim = pool.evict()
    if pool.policy.walk_survives_discard:
        assert [b for b, _ in walk] == [b for b in rest[1:] if b != victim]
    else:
        with pytest.raises(RuntimeError):
            list(walk)
    walk = pool.policy.order()
    next(walk)
    b = pool.allocate(1)[0]  # off the free stack: nothing evicted
    pool.mark_reusable([b])
    pool.free([b])  # cached now: the policy added it
    with pytest.raises(RuntimeError):
        list(walk)
