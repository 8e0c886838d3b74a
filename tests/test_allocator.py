"""DynamicAllocator: each strategy, the planned eviction, the FIFO wait queue, and rejected calls."""
from __future__ import annotations

import pytest
import torch

from _util import assert_same_state, pool_state, small_spec
from kvlab import (AllocationServed, BlockPool, ConfigError, DynamicAllocator, EventRecorder, FastBlockPool,
                   IllegalTransitionError, KVDataError, OutOfBlocksError, PyFastBlockPool, TicketState)

SIZES = [4, 8, 16, 32]  # classes 0..3; a 16-block pool is two class-3 blocks


def multi(n: int = 16, **kw) -> BlockPool:
    return BlockPool(n, spec=small_spec(), block_sizes=SIZES, **kw)


def test_exact_then_split_then_merge():
    pool = multi()
    alloc = DynamicAllocator(pool)
    rec = EventRecorder(pool.events, (AllocationServed,))
    first = alloc.allocate_optimal_block(size_class=0)
    assert first.strategy == "split" and first.block.block_id == 0  # class 3 split down: buddies 1, 2, 4 free
    hold = alloc.allocate_optimal_block(size_class=3)
    second = alloc.allocate_optimal_block(size_class=0)
    assert (hold.block.block_id, second.strategy, second.block.block_id) == (8, "exact", 1)
    alloc.deallocate_block(0)
    alloc.deallocate_block(1)
    assert {0, 1} <= set(pool.free_ids(0))  # freeing does not merge: buddies 0 and 1 stay apart until asked
    big = alloc.allocate_optimal_block(size_class=3)  # needs 0..7 merged back: only merging makes room
    assert (big.strategy, big.block.block_id) == ("merge", 0)
    assert [e.strategy for e in rec.events] == ["split", "exact", "exact", "merge"]
    assert [r.strategy for r in alloc.allocation_history] == ["split", "exact", "exact", "merge"]
    assert (alloc.stats["split"], alloc.stats["exact"], alloc.stats["merge"]) == (1, 2, 1)
    pool.check_invariants()


def test_split_block_returns_the_block_and_its_buddies():
    pool = multi()
    assert DynamicAllocator(pool).split_block(8, 0) == [8, 9, 10, 12]
    assert [pool.span(b) for b in (8, 9, 10, 12)] == [1, 1, 2, 4]
    pool.check_invariants()


def _cached_layout(pool: BlockPool, alloc: DynamicAllocator, cached_in_lru_order: list[int]) -> None:
    """Fill the pool with class-0 blocks and leave ``cached_in_lru_order`` cached (least recent first)."""
    ids = [alloc.allocate_optimal_block(size_class=0).block.block_id for _ in range(pool.num_blocks)]
    assert ids == list(range(pool.num_blocks))
    pool.mark_reusable(cached_in_lru_order)
    for b in cached_in_lru_order:
        pool.free([b])


def test_eviction_is_planned_to_free_a_window_of_the_needed_class():
    pool = multi(8)
    alloc = DynamicAllocator(pool)
    evicted: list[int] = []
    pool.evict_hooks.append(evicted.append)
    _cached_layout(pool, alloc, [0, 3, 6, 4, 5])  # LRU would evict 0 then 3: neither frees an aligned pair
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1, size_class=1)  # the pool alone evicts only blocks of class >= 1: there are none
    t = alloc.allocate_optimal_block(size_class=1)
    # Windows of two: [0,1] and [2,3] hold referenced blocks; [4,5] costs two victims, [6,7] holds a referenced 7.
    assert (t.strategy, t.block.block_id, sorted(evicted)) == ("evict", 4, [4, 5])
    assert {b for b, _ in pool.policy.order()} == {0, 3, 6}  # nothing evicted beyond the need
    pool.check_invariants()


def test_eviction_prefers_less_lost_data_then_the_colder_window():
    pool = multi(8)
    alloc = DynamicAllocator(pool)
    _cached_layout(pool, alloc, [6, 7, 0, 5])  # window [6,7]: two victims; [4,5] with 4 freed: one victim
    alloc.deallocate_block(4)
    t = alloc.allocate_optimal_block(size_class=1)
    assert (t.strategy, t.block.block_id) == ("evict", 4) and {b for b, _ in pool.policy.order()} == {6, 7, 0}
    pool.check_invariants()


def test_uniform_pool_evicts_the_policys_first_victim():
    pool = BlockPool(4, spec=small_spec())
    alloc = DynamicAllocator(pool)
    ids = pool.allocate(4)
    pool.mark_reusable(ids)
    pool.free([2, 0, 3])
    t = alloc.allocate_optimal_block()
    assert (t.strategy, t.block.block_id) == ("evict", 2)


def test_evict_guard_veto_is_respected():
    pool = multi(4)
    alloc = DynamicAllocator(pool)
    _cached_layout(pool, alloc, [0, 1, 2, 3])
    pool.evict_guard = lambda b: b != 1
    t = alloc.allocate_optimal_block(size_class=1)
    assert t.block.block_id == 2 and pool.evict_guard(1) is False  # the guard is restored afterwards
    t2 = alloc.allocate_optimal_block(size_class=1)  # [0,1] holds vetoed 1: the request waits
    assert t2.state is TicketState.WAITING and 1 in pool.policy


def test_wait_queue_is_fifo_and_frees_serve_waiters():
    pool = BlockPool(2, spec=small_spec())
    alloc = DynamicAllocator(pool)
    held = [alloc.allocate_optimal_block().block.block_id for _ in range(2)]
    a, b = alloc.allocate_optimal_block(owner=7), alloc.allocate_optimal_block(owner=8)
    assert a.state is b.state is TicketState.WAITING and list(alloc.waiters) == [a, b]
    served = alloc.deallocate_block(held[1])
    assert served == [a] and a.block.block_id == held[1] and pool.arrays.owner[held[1]] == 7
    assert b.state is TicketState.WAITING
    pool.free([held[0]])  # freed through the pool directly: the waiter is served at the next queue check
    assert alloc.handle_wait_queue() == [b] and b.strategy == "exact" and alloc.stats["served_from_queue"] == 2


def test_a_waiting_large_request_is_not_overtaken():
    pool = multi(8)
    alloc = DynamicAllocator(pool)
    held = [alloc.allocate_optimal_block(size_class=0).block.block_id for _ in range(8)]
    big = alloc.allocate_optimal_block(size_class=2)
    alloc.deallocate_block(held[0])  # room for a class-0 block, not for the waiting class-2 request
    small = alloc.allocate_optimal_block(size_class=0)
    assert big.state is small.state is TicketState.WAITING
    for b in held[1:4]:
        alloc.deallocate_block(b)
    assert big.served and big.strategy == "merge" and big.block.block_id == 0 and small.state is TicketState.WAITING


def test_timeout_and_cancel():
    pool = BlockPool(1, spec=small_spec())
    alloc = DynamicAllocator(pool)
    (held,) = pool.allocate(1)
    late = alloc.allocate_optimal_block(timeout=2)
    keep = alloc.allocate_optimal_block()
    gone = alloc.allocate_optimal_block()
    pool.touch([held]), pool.touch([held]), pool.touch([held])  # three clock steps pass
    assert alloc.cancel(gone) == [] and gone.state is TicketState.CANCELLED
    with pytest.raises(IllegalTransitionError, match=f"ticket {gone.id} is CANCELLED"):
        alloc.cancel(gone)
    assert alloc.deallocate_block(held) == [keep]  # the expired head is dropped, not served
    assert late.state is TicketState.TIMED_OUT and late.block is None
    assert (alloc.stats["timed_out"], alloc.stats["cancelled"]) == (1, 1)


@pytest.mark.parametrize("cls", [BlockPool, PyFastBlockPool, FastBlockPool], ids=lambda c: c.__name__)
def test_a_waiter_times_out_only_once_the_clock_is_past_its_deadline(cls):
    """``timeout`` counts clock steps the request may wait: at its deadline it still waits; one step later it has
    timed out."""
    pool = cls(1, spec=small_spec())
    alloc = DynamicAllocator(pool)
    (held,) = pool.allocate(1)
    t = alloc.allocate_optimal_block(timeout=1)
    pool.touch([held])
    assert pool.clock.now() == t.deadline
    assert alloc.handle_wait_queue() == [] and t.state is TicketState.WAITING and list(alloc.waiters) == [t]
    pool.touch([held])
    assert alloc.handle_wait_queue() == [] and t.state is TicketState.TIMED_OUT and not alloc.waiters


def test_cancelling_the_head_lets_the_next_waiter_in():
    pool = multi(8)
    alloc = DynamicAllocator(pool)
    held = [alloc.allocate_optimal_block(size_class=0).block.block_id for _ in range(8)]
    big = alloc.allocate_optimal_block(size_class=3)
    small = alloc.allocate_optimal_block(size_class=0)
    pool.free([held[5]])
    assert alloc.cancel(big) == [small] and small.block.block_id == 5


def test_kv_data_is_written_into_the_block_it_sizes():
    pool = multi()
    alloc = DynamicAllocator(pool)
    s = pool.spec
    kv = torch.randn(2, s.num_layers, 5, s.num_kv_heads, s.head_dim, device=s.device)
    t = alloc.allocate_optimal_block(kv)
    assert t.block.size_class == 1 and t.block.token_count == 5 and t.kv_data is None
    assert torch.equal(t.block.kv_data[:, :, :5], kv)


def test_a_waiting_request_keeps_its_data_until_served():
    pool = BlockPool(1, spec=small_spec())
    alloc = DynamicAllocator(pool)
    s = pool.spec
    (held,) = pool.allocate(1)
    kv = torch.randn(2, s.num_layers, 3, s.num_kv_heads, s.head_dim, device=s.device)
    t = alloc.allocate_optimal_block(kv)
    alloc.deallocate_block(held)
    assert t.served and torch.equal(t.block.kv_data[:, :, :3], kv)


@pytest.mark.parametrize("call, error, message", [
    (lambda a: a.allocate_optimal_block(size_class=4), ConfigError, "size_class 4"),
    (lambda a: a.allocate_optimal_block(tokens=33), KVDataError, "33 tokens"),
    (lambda a: a.allocate_optimal_block(tokens=3, size_class=1), ConfigError, "at most one"),
    (lambda a: a.allocate_optimal_block(torch.zeros(2, 2, 3, 2, 5)), KVDataError, "shape"),
    (lambda a: a.allocate_optimal_block(timeout=-1), ConfigError, "timeout"),
    (lambda a: a.allocate_optimal_block(size_class=3, wait=False), OutOfBlocksError, "size class 3"),
    (lambda a: a.split_block(0, 0), IllegalTransitionError, "block 0 is ALLOCATED"),
    (lambda a: a.split_block(2, 1), IllegalTransitionError, "block 2 is FREE of size class 1"),
])
def test_rejected_calls_change_nothing(call, error, message):
    pool = multi()
    alloc = DynamicAllocator(pool)
    alloc.allocate_optimal_block(size_class=0)
    alloc.allocate_optimal_block(size_class=2, owner=1)
    blocker = alloc.allocate_optimal_block(size_class=3)
    alloc.deallocate_block(blocker.block.block_id)
    alloc.allocate_optimal_block(size_class=3)  # class 3 now taken, at block 8
    alloc.allocate_optimal_block(size_class=3)  # waits
    before, queue = pool_state(pool), list(alloc.waiters)
    with pytest.raises(error, match=message):
        call(alloc)
    assert_same_state(before, pool_state(pool))
    assert list(alloc.waiters) == queue


def test_pool_too_small_for_a_class_is_an_error_not_a_wait():
    pool = multi(4)
    with pytest.raises(OutOfBlocksError, match="needs 8 base blocks"):
        DynamicAllocator(pool).allocate_optimal_block(size_class=3)
