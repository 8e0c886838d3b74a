"""ReferenceManager (text §2.2.3 "引用计数管理"), as a facade over the pool's refcounts.

The text kept a second dictionary of refcounts beside ``KVBlock.reference_count``; two truths drift apart
(a block freed through the pool kept its count in the manager, and vice versa). Here the pool's refcount array
is the only truth: this class reads and writes it, under the pool's lock, and adds nothing of its own.
"""
from __future__ import annotations

from kvlab.core.errors import ConfigError
from kvlab.core.pool import BlockPool, Ids


class ReferenceManager:
    """The text's reference-count API over ``pool``."""

    def __init__(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"a ReferenceManager needs a BlockPool, got {pool!r}")
        self.pool = pool

    def add_reference(self, block_id: int) -> None:
        """One more holder of ``block_id`` (must be ALLOCATED; a cached block becomes referenced again)."""
        self.pool.incref([block_id])

    def remove_reference(self, block_id: int) -> None:
        """One holder fewer; at 0 the block keeps its data and becomes evictable. Underflow raises."""
        self.pool.decref([block_id])

    def add_references(self, ids: Ids) -> None:
        """Batch :meth:`add_reference`, one lock acquisition."""
        self.pool.incref(ids)

    def remove_references(self, ids: Ids) -> None:
        """Batch :meth:`remove_reference`, one lock acquisition."""
        self.pool.decref(ids)

    def get_reference_count(self, block_id: int) -> int:
        return self.pool.fields.refcount[self.pool.check_id(block_id)]

    def is_safe_to_evict(self, block_id: int) -> bool:
        """True for a cached block: ALLOCATED with no holder (FREE blocks hold nothing to evict)."""
        return self.pool.is_cached(block_id)

    def get_all_references(self) -> dict[int, int]:
        """``{block_id: refcount}`` for every block with at least one reference."""
        with self.pool.lock:
            refs = self.pool.arrays.refcount
            ids = refs.nonzero()[0]
            return dict(zip(ids.tolist(), refs[ids].tolist()))
