"""Every hook is told, even when another raises. The pool's hook lists (``evict_hooks``, ``relocation_hooks``,
``stale_hooks``) are how the block tables, the prefix index, the metrics and the views follow the pool; when one
hook raises, the others must still run, or a table names a block that is now FREE (and soon someone else's K/V).
Here a raising hook sits *first* in each list, before the sequence manager's and the prefix cache's own: the error
reaches the caller, and the tables, the index and every byte of K/V are as if no hook had failed."""
from __future__ import annotations

import pytest
import torch

from _util import small_spec
from kvlab import BlockPool, DefragmentationStrategy, FastBlockPool, PyFastBlockPool
from kvlab.perf import COMPILED
from kvlab.sequence import SequenceManager

POOLS = [BlockPool, PyFastBlockPool, *([FastBlockPool] if COMPILED else [])]


class HookFailed(Exception):
    pass


def _raiser(calls: list):
    def hook(*args):
        calls.append(args)
        raise HookFailed(args)
    return hook


def _sequences(pool_cls, num_blocks=48):
    """A pool with storage, a sequence manager with a prefix cache and four sequences of random K/V (one
    forked), grown in turn so their tables interleave; the second is freed, leaving holes."""
    spec = small_spec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    pool = pool_cls(num_blocks, spec=spec)
    mgr = SequenceManager(pool, prefix_cache=True)
    gen = torch.Generator().manual_seed(7)
    seqs = [mgr.create(list(range(100 * i, 100 * i + 8))) for i in range(4)]
    for s in seqs:
        s.append(list(range(100 * s.seq_id, 100 * s.seq_id + 8)))
    for step in range(4):
        for s in seqs:
            slots = s.append([1000 + step] * 3)
            for layer in range(spec.num_layers):
                k, v = (torch.randn(3, 2, 8, generator=gen) for _ in range(2))
                pool.storage.write_slots(layer, slots, k, v)
    seqs.append(seqs[0].fork())
    seqs.pop(1).free()
    return pool, mgr, seqs


def _kv(pool, seqs) -> list[torch.Tensor]:
    """Every sequence's K/V, read through its block table."""
    return [pool.storage.kv[:, :, torch.tensor(s.block_table)].clone() for s in seqs]


@pytest.mark.parametrize("cls", POOLS, ids=lambda c: c.__name__)
def test_a_relocation_hook_that_raises_leaves_every_table_following_its_blocks(cls):
    pool, mgr, seqs = _sequences(cls)
    before = _kv(pool, seqs)
    calls: list = []
    pool.relocation_hooks.insert(0, _raiser(calls))
    with pytest.raises(HookFailed):
        DefragmentationStrategy(pool).defragment(force=True)
    assert len(calls) == 1 and len(calls[0][0])  # told once, of the moves made
    mgr.check_invariants()  # the tables name the blocks their data moved to
    pool.storage.kv[:, :, torch.tensor(calls[0][0])] = float("nan")  # the vacated sources
    assert all(torch.equal(a, b) for a, b in zip(before, _kv(pool, seqs)))


@pytest.mark.parametrize("cls", POOLS, ids=lambda c: c.__name__)
def test_an_evict_hook_that_raises_leaves_the_prefix_index_in_step(cls):
    pool, mgr, seqs = _sequences(cls)
    for s in seqs:
        mgr.cache_full_blocks(s)
    for s in seqs[1:]:
        s.free()
    cached = pool.num_cached_blocks
    calls: list = []
    pool.evict_hooks.insert(0, _raiser(calls))
    with pytest.raises(HookFailed):
        pool.allocate(pool.num_free_blocks + 1)  # one victim: the hook raises on it
    assert len(calls) == 1 and pool.num_cached_blocks == cached - 1
    assert not mgr.prefix_cache.holds(calls[0][0])  # the cache heard of it too
    mgr.check_invariants()


@pytest.mark.parametrize("cls", POOLS, ids=lambda c: c.__name__)
def test_a_stale_hook_that_raises_still_lets_the_prefix_cache_drop_its_entries(cls):
    pool, mgr, seqs = _sequences(cls)
    mgr.cache_full_blocks(seqs[0])
    held = [b for b in seqs[0].block_table if mgr.prefix_cache.holds(b)]
    assert held
    calls: list = []
    pool.stale_hooks.insert(0, _raiser(calls))
    with pytest.raises(HookFailed):
        pool.mark_reusable(held, False)
    assert calls == [(held,)]
    assert not any(mgr.prefix_cache.holds(b) for b in held)
    mgr.check_invariants()
