"""The text's method names, an adapter around the pool (kvlab/textbook/pool.py): what ``get_memory_usage`` counts;
and the text's code as it behaves (kvlab/textbook/as_written.py): the flaws the errata appendix shows."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import kvlab
from kvlab import BlockPool
from kvlab.textbook.pool import TextbookPool

from _util import small_spec

POOL_CLASSES = [BlockPool, kvlab.PyFastBlockPool, kvlab.FastBlockPool]


@pytest.mark.parametrize("cls", POOL_CLASSES, ids=lambda c: c.__name__)
def test_memory_usage_counts_base_blocks_of_every_owned_state(cls):
    """A buddy pool of 8 base blocks (512 bytes each, sizes 4 and 8 tokens) holding a cached class-1 block (2 base
    blocks), a held block with 3 tokens, a PENDING block and an EVICTING block: ``cached`` is the class-1 block's 2
    base blocks (not 1 block's bytes), ``used`` counts PENDING and EVICTING too (5 base blocks), and
    ``used + free == total``."""
    spec = small_spec()  # 128 bytes a token, 4 tokens a block
    p = cls(8, spec=spec, block_sizes=[4, 8])
    assert p.bytes_per_block == 512
    (cached,) = p.allocate(1, size_class=1)
    p.mark_reusable([cached])
    p.free([cached])
    (held,) = p.allocate(1)
    p.set_token_count(held, 3)
    p.reserve(1)
    (leaving,) = p.allocate(1)
    p.begin_eviction([leaving])
    assert p.arrays.status.tolist() == [2, 2, 2, 1, 3, 0, 0, 0]  # cached x2, held, PENDING, EVICTING, 3 FREE
    # fragmentation: of the 3 free base blocks only the aligned pair 6-7 can serve a class-1 request
    assert TextbookPool(p).get_memory_usage() == {"total": 8 * 512, "used": 5 * 512, "free": 3 * 512, "cached": 2 * 512,
                                    "token_bytes": 3 * 128, "fragmentation": 33}
    p.finish_eviction([leaving])  # EVICTING -> FREE: one base block moves from used to free
    mu = TextbookPool(p).get_memory_usage()
    assert (mu["used"], mu["free"], mu["cached"]) == (4 * 512, 4 * 512, 2 * 512)
    assert mu["used"] + mu["free"] == mu["total"]


# ---------------------------------------------------------------------------- the text's code as it behaves
# kvlab.textbook.as_written is the text's §2.2.2-§2.2.4 code written again; these tests hold the behaviours the
# errata appendix shows (chapters/2_2_2_appendix_errata.ipynb), without the notebook.
W = kvlab.text_as_written


def kv(tokens: int) -> np.ndarray:
    """Data for the text's blocks: [2, tokens, 2 heads, 8 dims] of float32 (128 bytes a token)."""
    return np.zeros((2, tokens, 2, 8), np.float32)


def test_text_allocate_changes_the_block_before_it_fails_on_1d_data():
    block = W.make_block(0, np.zeros(1024, np.float32))
    with pytest.raises(IndexError):
        block.allocate(np.zeros(1024, np.float32))  # no shape[1]
    assert (block.status, block.reference_count, block.memory_usage) == (W.BlockStatus.ALLOCATED, 0, 4096)
    assert block.release()  # an ALLOCATED block nobody holds
    ok = W.make_block(1, kv(16))
    assert ok.allocate(kv(4)) and ok.token_count == 4 and ok.reference_count == 1


def test_the_block_code_run_alone_has_no_time_and_fails_half_done():
    alone_block, alone_status = W.kvblock_alone()
    block = alone_block(0, alone_status.FREE, 0, kv(16), 0, 0.0, 0.0)
    with pytest.raises(NameError, match="time"):
        block.allocate(kv(4))
    assert (block.status.name, block.reference_count, block.token_count) == ("ALLOCATED", 1, 4)
    assert W.make_block(0, kv(16)).allocate(kv(4))  # in one file (this module) it runs


def test_text_capacity_follows_the_data_and_a_released_block_takes_only_an_empty_array():
    block = W.make_block(0, kv(64))
    assert block.memory_usage == 8192 and block.allocate(kv(16)) and block.memory_usage == 2048
    assert not block.release()  # referenced once by allocate
    block.decrement_reference()
    assert block.release() and block.memory_usage == 0
    assert not block.allocate(kv(1)) and block.allocate(kv(0))


def test_the_text_pool_is_empty_and_every_call_comes_back_empty():
    pool = W.BlockPool(total_memory=1 << 20, block_sizes=[64, 128, 256])
    allocator, strategy = W.DynamicAllocator(pool), W.DefragmentationStrategy(pool)
    assert pool.get_best_block(0) is None and not pool.allocate_block(0, kv(1)) and not pool.release_block(0)
    assert [allocator.allocate_optimal_block(kv(1)) for _ in range(3)] == [None] * 3
    assert pool.evict_block() is None and not strategy.defragment() and not strategy.reallocate_active_blocks()
    assert pool.calculate_fragmentation() == 0 and pool.get_memory_usage()["free"] == 1 << 20
    assert all(v == [] for v in pool.blocks.values()) and pool.active_blocks == {}


def test_only_the_migration_adds_to_active_blocks_and_nothing_fills_the_size_lists():
    assert W.adds_to("active_blocks") == ["DefragmentationStrategy._migrate_block_data"]
    assert W.adds_to("blocks") == []
    pool = W.BlockPool(total_memory=1 << 20, block_sizes=[64])
    source = W.make_block(0, kv(4), status=W.BlockStatus.ALLOCATED, reference_count=1)
    target = W.make_block(1, kv(16))
    assert W.DefragmentationStrategy(pool).migrate_block_data(source, target)
    assert list(pool.active_blocks) == [1] and target.status is W.BlockStatus.ALLOCATED
    assert target.reference_count == 0 and source.reference_count == 1  # the data is held twice


def test_an_allocated_block_cannot_be_released_through_the_pool_or_the_allocator():
    pool = W.BlockPool(total_memory=1 << 20, block_sizes=[64])
    block = W.make_block(0, kv(16))
    pool.blocks[64].append(block)
    pool.active_blocks[0] = block
    assert pool.allocate_block(0, kv(16)) and block.reference_count == 1
    assert not pool.release_block(0) and not W.DynamicAllocator(pool).deallocate_block(0)
    assert W.mentions("decrement_reference") == [] and W.mentions("is_compatible") == []
    block.decrement_reference()  # by hand: no text code does it
    assert pool.release_block(0) and 0 not in pool.active_blocks
    assert pool.get_best_block(64) is block and block.memory_usage == 0  # handed out again, holding nothing


def test_evict_block_counts_and_drops_a_block_whose_release_fails():
    pool = W.BlockPool(total_memory=1 << 20, block_sizes=[64])
    pending = W.make_block(0, kv(16), status=W.BlockStatus.PENDING, at=0.0)
    pool.active_blocks.update({0: pending, 1: W.make_block(1, kv(16), status=W.BlockStatus.ALLOCATED, at=1.0)})
    assert pool.evict_block() is pending and pending.status is W.BlockStatus.PENDING
    assert pool.get_stats()["evictions"] == 1 and 0 not in pool.active_blocks
    assert pool.evict_block().status is W.BlockStatus.FREE and pool.active_blocks == {}
    assert all(v == [] for v in pool.blocks.values())  # neither went into a list


def test_the_text_fragmentation_formula_and_its_stats_entry():
    pool = W.BlockPool(total_memory=1 << 20, block_sizes=[64])
    pool.blocks[64] += [W.make_block(i, kv(32)) for i in range(4)]
    assert pool.calculate_fragmentation() == 75 and pool.get_stats()["fragmentation"] == 0  # never updated
    empty = W.BlockPool(total_memory=1 << 20, block_sizes=[64])
    empty.blocks[64] += [W.make_block(i) for i in range(4)]
    assert empty.calculate_fragmentation() == 0  # FREE blocks without data hold 0 bytes


def test_the_text_allocator_hands_the_same_free_block_to_every_caller_of_a_filled_pool():
    pool = W.BlockPool(total_memory=1 << 20, block_sizes=[64, 128, 256])
    for i, size in enumerate(pool.block_sizes):
        pool.blocks[size].append(W.make_block(i, kv(16)))
    allocator = W.DynamicAllocator(pool)
    handed = [allocator.allocate_optimal_block(kv(1)) for _ in range(3)]  # 128 bytes: the 128 list
    assert [b.block_id for b in handed] == [1, 1, 1] and handed[0].status is W.BlockStatus.FREE
    assert pool.get_stats()["allocations"] == 0 and allocator.allocation_history == []


@pytest.mark.parametrize("per_layer, found", [(256, 8), (768, 2), (2048, 1), (4096, 0)])
def test_get_best_block_compares_bytes_with_block_sizes_in_tokens(per_layer, found):
    pool = W.BlockPool(total_memory=1 << 30, block_sizes=[16, 64, 256, 1024, 2048])
    for i, size in enumerate(pool.block_sizes):
        pool.blocks[size].append(W.make_block(i, kv(16)))
    fits = [t for t in range(1, 20) if pool.get_best_block(t * per_layer) is not None]
    assert fits == list(range(1, found + 1))  # only data of at most 2,048 bytes finds a list


def test_is_safe_to_evict_says_true_for_ids_it_never_saw():
    refs = W.ReferenceManager()
    assert all(refs.is_safe_to_evict(b) for b in (0, 7, -1, 10**9))
    refs.add_reference(7)
    assert not refs.is_safe_to_evict(7) and refs.is_safe_to_evict(8)
    with pytest.raises(kvlab.UnknownBlockError):  # kvlab's manager reads the pool's one count
        kvlab.ReferenceManager(BlockPool(4, spec=small_spec())).is_safe_to_evict(10**9)


def test_two_threads_racing_for_one_block_through_the_text_pool_have_one_winner():
    for _ in range(20):
        pool = W.BlockPool(total_memory=1 << 20, block_sizes=[64])
        pool.active_blocks[0] = W.make_block(0, kv(16))
        results: list[bool] = []
        threads = [threading.Thread(target=lambda: results.append(pool.allocate_block(0, kv(4)))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [False, True]


def test_the_dead_state_is_only_written():
    assert W.mentions("hit_rate") == W.mentions("wait_queue") == ["BlockPool.__init__"]
    assert W.mentions("allocation_history") == ["DynamicAllocator.__init__"]
    assert W.mentions("minimum_fragmentation") == ["DefragmentationStrategy.__init__"]
    assert W.mentions("performance_metrics") == ["ChunkSizeOptimizer.__init__"]
    assert W.mentions("heapq") == [] and W.mentions("total_memory") == ["BlockPool.__init__",
                                                                         "BlockPool.get_memory_usage"]
    assert W.mentions("get_best_block")  # the finder sees real calls too


def test_total_memory_is_never_enforced():
    pool = W.BlockPool(total_memory=1024, block_sizes=[64])
    for i in range(3):
        pool.active_blocks[i] = W.make_block(i, kv(32), status=W.BlockStatus.ALLOCATED, reference_count=1)
    assert pool.get_memory_usage()["free"] == 1024 - 3 * 4096


def test_the_errata_exercises_agree_with_the_text_code():
    """The two errata exercises run a few lines of their own; their answers are what the text's code gives."""
    after_allocate, after_release, second = kvlab.exercises.ch2_2_2.text_block_story()
    block = W.make_block(0, kv(32))  # 4096 bytes, as the exercise's block
    block.allocate(kv(8))  # 1024 bytes
    story = [block.memory_usage]
    block.decrement_reference()
    block.release()
    story += [block.memory_usage, "ok" if block.allocate(np.zeros((2, 1, 2, 2), np.float32)) else "refused"]  # 16 B
    assert [after_allocate, after_release, second] == story
    pool = W.BlockPool(total_memory=1 << 20, block_sizes=[64])
    pool.blocks[64] += [W.make_block(i, kv(32)) for i in range(4)]
    assert kvlab.exercises.ch2_2_2.text_fragmentation_story()[0] == pool.calculate_fragmentation()
