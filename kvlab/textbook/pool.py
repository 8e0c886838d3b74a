"""The text's pool API (§2.2.2 ``BlockPool`` and ``KVBlock``), made real, as an adapter around kvlab's pool.

kvlab's :class:`~kvlab.core.pool.BlockPool` speaks one vocabulary (``allocate``, ``free``, ``evict``, ``stats``).
The chapters also show the text's own calls, so :class:`TextbookPool` wraps a pool and offers the text's names —
``get_best_block``, ``allocate_block``, ``release_block``, ``evict_block``, ``calculate_fragmentation``,
``get_memory_usage``, ``get_stats`` — each a few lines over the pool's API; :class:`KVBlock` is the text's
block object, a view that reads the pool's arrays. What the text got wrong is said where it matters::

    text = TextbookPool(BlockPool(total_memory=..., block_sizes=[16, 32]))
    block = text.allocate_block(kv_data=kv)     # the text's call, on kvlab's pool
    text.pool.free([block.block_id])            # the same pool, in kvlab's own words
"""
from __future__ import annotations

from typing import Any

import torch

from kvlab.core.block import ALLOCATED, BlockStatus
from kvlab.core.checks import check_kv_data, is_int
from kvlab.core.errors import ConfigError
from kvlab.memory.fragmentation import memory_usage, unusable_free_percent
from kvlab.core.pool import BlockPool


def _check_bytes(required_size: Any) -> int:
    if not is_int(required_size) or required_size < 0:
        raise ConfigError(f"required_size must be a byte count >= 0, got {required_size!r}")
    return int(required_size)


class KVBlock:
    """The text's block object: a view of block ``block_id`` of ``pool``, holding no state of its own (every field
    reads the pool's metadata arrays; ``kv_data`` is a view of the block's slice of the one KV tensor). Cheap to
    create, never stale. Capacity is a fixed property of the block: the text's ``memory_usage`` read 0 for every
    FREE block, so nothing could ever be allocated."""

    __slots__ = ("pool", "block_id")

    def __init__(self, pool: BlockPool, block_id: int) -> None:
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"a KVBlock is a view of a BlockPool's block, got pool {pool!r}")
        self.pool, self.block_id = pool, pool.check_id(block_id)

    def __repr__(self) -> str:
        return (f"KVBlock(id={self.block_id}, {self.status.name}, refs={self.reference_count}, "
                f"tokens={self.token_count}/{self.capacity_tokens})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVBlock) and other.pool is self.pool and other.block_id == self.block_id

    def __hash__(self) -> int:
        return hash((id(self.pool), self.block_id))

    # --- fields (read from the pool's arrays) ---
    @property
    def status(self) -> BlockStatus:
        return BlockStatus(self.pool.fields.status[self.block_id])

    @property
    def token_count(self) -> int:
        return self.pool.fields.tokens[self.block_id]

    @property
    def reference_count(self) -> int:
        return self.pool.fields.refcount[self.block_id]

    @property
    def last_access_time(self) -> float:
        return self.pool.fields.last_access[self.block_id]

    @property
    def creation_time(self) -> float:
        return self.pool.fields.created[self.block_id]

    @property
    def size_class(self) -> int:
        """Buddy order: the block spans ``2 ** size_class`` base blocks."""
        return self.pool.fields.size_class[self.block_id]

    @property
    def capacity_tokens(self) -> int:
        return self.pool.block_size << self.size_class

    @property
    def memory_usage(self) -> int:
        """Bytes this block occupies in the KV tensor: its fixed capacity, whatever its state."""
        return self.pool.bytes_per_block << self.size_class

    @property
    def kv_data(self) -> torch.Tensor:
        """A view ``[2, layers, capacity_tokens, kv_heads, head_dim]`` of this block's slots (writes go to the pool)."""
        return self.pool.storage_of().block_view(self.block_id, 1 << self.size_class)

    @property
    def is_cached(self) -> bool:
        """ALLOCATED with no reference: holds reusable data and may be evicted."""
        return self.status is BlockStatus.ALLOCATED and self.reference_count == 0

    # --- the text's methods, made real and made atomic under the pool lock ---
    def is_compatible(self, required_size: int) -> bool:
        """True if the block is FREE and its capacity is at least ``required_size`` bytes."""
        return self.status is BlockStatus.FREE and self.memory_usage >= _check_bytes(required_size)

    def allocate(self, kv_data: torch.Tensor | None = None) -> KVBlock:
        """Take this FREE block (refcount 1) and, if given, write ``kv_data`` ``[2, layers, t, heads, dim]`` into
        its first ``t`` slots. Raises instead of returning False, and leaves the block FREE on any error."""
        return allocate_block(self.pool, self.block_id, kv_data)

    def release(self) -> None:
        """Return an ALLOCATED block with refcount 0 (a cached block) to FREE, dropping its data."""
        self.pool.release_cached(self.block_id)

    def increment_reference(self) -> None:
        self.pool.incref([self.block_id])

    def decrement_reference(self) -> None:
        """Drop one reference; at 0 the block stays ALLOCATED and evictable (its data is kept)."""
        self.pool.decref([self.block_id])


def allocate_block(pool: BlockPool, block_id: int | None = None, kv_data: torch.Tensor | None = None,
                   owner: int = -1) -> KVBlock:
    """Allocate FREE block ``block_id`` of ``pool`` (or the smallest class that fits ``kv_data``) and write
    ``kv_data`` into its first slots. The text compared a token count with ``kv_data.nbytes`` and a block's
    capacity with the size of the data it last held; here capacity is the block's fixed size in tokens."""
    with pool.lock:
        if block_id is None:
            t = 0 if kv_data is None else check_kv_data(pool.spec, pool.storage_of().kv.device, kv_data,
                                                        pool.block_sizes[-1])
            k = next(k for k, size in enumerate(pool.block_sizes) if size >= t)
        else:
            block_id = pool.check_id(block_id)
            BlockStatus.check(block_id, pool.fields.status[block_id], ALLOCATED)
            k = pool.fields.size_class[block_id]
            t = 0 if kv_data is None else check_kv_data(pool.spec, pool.storage_of().kv.device, kv_data,
                                                        pool.block_sizes[k])
        b = pool.allocate(1, size_class=k, owner=owner, block_id=block_id)[0]
        if kv_data is not None:
            pool.storage_of().block_view(b, pool.span(b))[:, :, :t].copy_(kv_data)
            pool.set_token_count(b, t)
        return KVBlock(pool, b)


class TextbookPool:
    """The text's ``BlockPool`` methods over ``pool`` (a :class:`~kvlab.core.pool.BlockPool`), which stays reachable
    as ``.pool``: everything here changes or reads that pool, so the two never disagree."""

    __slots__ = ("pool",)

    def __init__(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"a TextbookPool wraps a BlockPool, got {pool!r}")
        self.pool = pool

    def __repr__(self) -> str:
        return f"TextbookPool({self.pool!r})"

    def block(self, block_id: int) -> KVBlock:
        """The text's block object for ``block_id``."""
        return KVBlock(self.pool, block_id)

    def get_best_block(self, required_size: int) -> KVBlock | None:
        """The smallest FREE block of at least ``required_size`` bytes, without taking it (the text's pool never
        held any block, so its version always returned None)."""
        pool, need = self.pool, _check_bytes(required_size)
        with pool.lock:
            for k in range(pool.max_order + 1):
                b = pool.free_lists.top(k)
                if pool.bytes_per_block << k >= need and b is not None:
                    return KVBlock(pool, b)
            return None

    def allocate_block(self, block_id: int | None = None, kv_data: torch.Tensor | None = None,
                       owner: int = -1) -> KVBlock:
        """See :func:`allocate_block`."""
        return allocate_block(self.pool, block_id, kv_data, owner)

    def release_block(self, block_id: int) -> None:
        """The text's name for releasing one block: the pool's ``free([block_id])``."""
        self.pool.free([block_id])

    def evict_block(self, reason: str = "explicit") -> KVBlock | None:
        """The pool's ``evict`` returning a :class:`KVBlock` view of the victim (now FREE). The text picked the LRU
        block first and checked its refcount after, so one referenced block stopped every eviction."""
        b = self.pool.evict(reason)
        return None if b is None else KVBlock(self.pool, b)

    def calculate_fragmentation(self) -> int:
        """Unusable free memory in percent (:func:`kvlab.memory.fragmentation.unusable_free_percent`). The text's
        ``(total - largest) / total`` over free blocks calls four equal free blocks "75% fragmented"."""
        return unusable_free_percent(self.pool)

    def get_memory_usage(self) -> dict[str, int]:
        """Bytes (:func:`kvlab.memory.fragmentation.memory_usage`) plus the ``fragmentation`` percent. The text
        summed the sizes of the data blocks held, so a block's size changed with what it last stored."""
        with self.pool.lock:
            return {**memory_usage(self.pool), "fragmentation": unusable_free_percent(self.pool)}

    def get_stats(self) -> dict[str, Any]:
        """The pool's ``stats()`` (counters since creation, state counts now, cached blocks, lock acquisitions)
        plus the ``fragmentation`` percent."""
        with self.pool.lock:
            return {**self.pool.stats(), "fragmentation": unusable_free_percent(self.pool)}
