"""Preallocator: demand learned per (owner, size class), bursts served from PENDING reserves, expiry."""
from __future__ import annotations

import pytest

from _util import assert_same_state, pool_state, small_spec
from kvlab import BlockPool, BlockStatus, ConfigError, DynamicAllocator, OutOfBlocksError, Preallocator


def idle(pool: BlockPool, steps: int) -> None:
    """Let ``steps`` clock steps pass."""
    for _ in range(steps):
        pool.clock.tick()


def test_a_learned_burst_is_served_from_the_reserve():
    pool = BlockPool(64, spec=small_spec())
    pre = Preallocator(pool, window=8, horizon=100)
    first = pre.allocate(6, owner=1)  # nothing learned yet: all from the pool
    assert pre.stats["fallback"] == 6 and pre.predict(1, 0) == 6 and pre.predict(2, 0) == 0
    pool.free(first)
    assert pre.replenish() == {(1, 0): 6}
    reserve = list(pre.reserves[(1, 0)])
    assert (pool.arrays.status[reserve] == BlockStatus.PENDING).all() and (pool.arrays.owner[reserve] == 1).all()
    idle(pool, 20)
    burst = pre.allocate(4, owner=1) + pre.allocate(3, owner=1)
    assert sorted(burst[:6]) == sorted(reserve) and pre.stats["from_reserve"] == 6 and pre.stats["fallback"] == 7
    assert (pool.arrays.status[burst] == BlockStatus.ALLOCATED).all()
    assert pre.predict(1, 0) == 7  # the peak within any 8 steps grew
    pool.check_invariants()


def test_peak_is_counted_over_a_sliding_window():
    pool = BlockPool(64, spec=small_spec())
    pre = Preallocator(pool, window=5, horizon=1000)
    for n, gap in [(2, 3), (3, 10), (1, 1), (1, 1), (1, 0)]:
        pre.observe(0, 0, n)
        idle(pool, gap)
    # steps 0:2, 3:3 (within 5 -> 5), 13:1, 14:1, 15:1 (-> 3)
    assert pre.predict(0, 0) == 5
    pre.headroom = 1.5
    assert pre.predict(0, 0) == 8


def test_unused_reserves_are_returned_after_the_horizon():
    pool = BlockPool(32, spec=small_spec())
    pre = Preallocator(pool, window=4, horizon=50)
    pool.free(pre.allocate(5, size_class=0, owner=3))
    pre.replenish()
    assert pre.reserved == 5 and pool.num_free_blocks == 27
    idle(pool, 40)
    assert pre.replenish() == {} and pre.reserved == 5
    idle(pool, 20)
    assert pre.replenish() == {(3, 0): -5} and pre.reserved == 0 and pool.num_free_blocks == 32
    assert pre.stats["returned"] == 5
    pool.check_invariants()


def test_reserving_never_evicts_and_yields_to_waiters():
    pool = BlockPool(8, spec=small_spec())
    alloc = DynamicAllocator(pool)
    pre = Preallocator(pool, allocator=alloc, window=4, horizon=100, max_reserve=6)
    ids = pre.allocate(8, owner=1)
    pool.mark_reusable(ids[:5])
    pool.free(ids)  # 5 cached (evictable) + 3 free
    assert pre.predict(1, 0) == 6 and pre.replenish() == {(1, 0): 3}
    assert pool.num_cached_blocks == 5  # a guess never evicts cached data
    pre.release_all()
    pool.allocate(8)  # evicts the cached ones
    waiting = alloc.allocate_optimal_block()
    pool.free([0, 1])
    assert pre.replenish() == {} and pre.reserved == 0  # the two free blocks belong to the waiter
    assert alloc.handle_wait_queue() == [waiting]


def test_multi_class_reserves_and_merge():
    pool = BlockPool(16, spec=small_spec(), block_sizes=[4, 8, 16])
    pre = Preallocator(pool, window=4, horizon=100)
    small = pre.allocate(8, size_class=0, owner=2)
    pool.free(small)  # eight free class-0 blocks: buddies not merged yet
    pre.observe(2, 2, 2)
    change = pre.replenish()
    assert change == {(2, 0): 8, (2, 2): 2}  # merged first, so class-2 room is found among the freed buddies
    pool.check_invariants()
    assert pre.allocate(2, size_class=2, owner=2) and pre.stats["from_reserve"] == 2


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4, spec=small_spec())
    pre = Preallocator(pool, window=4, horizon=100)
    pool.free(pre.allocate(2, owner=1))
    pre.replenish()
    pool.allocate(1)
    before, reserves = pool_state(pool), {k: list(v) for k, v in pre.reserves.items()}
    with pytest.raises(OutOfBlocksError):
        pre.allocate(4, owner=1)  # 2 from the reserve, 1 free: one short
    assert_same_state(before, pool_state(pool))
    assert pre.reserves == reserves


@pytest.mark.parametrize("kw", [dict(window=0), dict(window=10, horizon=5), dict(headroom=0), dict(max_reserve=-1)])
def test_bad_configuration(kw):
    with pytest.raises(ConfigError):
        Preallocator(BlockPool(4, spec=small_spec()), **kw)


def test_misses_go_through_the_allocator_when_given():
    pool = BlockPool(8, spec=small_spec(), block_sizes=[4, 8])
    fill = pool.allocate(8, size_class=0)
    pool.mark_reusable(fill)
    pool.free(fill)  # all cached, class 0: the pool alone cannot free a class-1 block
    with pytest.raises(OutOfBlocksError):
        Preallocator(pool).allocate(1, owner=1, size_class=1)
    pre = Preallocator(pool, allocator=DynamicAllocator(pool))
    got = pre.allocate(2, owner=1, size_class=1)  # planned evictions free two aligned pairs
    assert len(got) == 2 and pool.num_cached_blocks == 4 and pre.stats["fallback"] == 2
    with pytest.raises(OutOfBlocksError):
        pre.allocate(3, owner=1, size_class=1)  # two more fit, not three: the two taken are returned
    assert pool.num_free_blocks == 4 and pre.stats["fallback"] == 2
    pool.check_invariants()


def test_the_window_is_half_open_and_the_horizon_includes_its_last_step():
    pool = BlockPool(64, spec=small_spec())
    pre = Preallocator(pool, window=5, horizon=1000)
    pre.observe(0, 0, 2)
    for _ in range(5):
        pool.clock.tick()
    pre.observe(0, 0, 3)  # 5 steps later: outside the first one's window of steps t..t+4
    assert pre.predict(0, 0) == 3
    pool = BlockPool(64, spec=small_spec())
    pre = Preallocator(pool, window=4, horizon=50)
    pre.observe(0, 0, 4)
    for _ in range(50):
        pool.clock.tick()
    assert pre.predict(0, 0) == 4  # exactly horizon steps old: still counts
    pool.clock.tick()
    assert pre.predict(0, 0) == 0
