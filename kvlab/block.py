"""Block states and the :class:`KVBlock` view (text §2.2.2, "块结构设计").

State machine (enforced by :meth:`BlockStatus.check`; anything else raises :class:`IllegalTransitionError`)::

    FREE ──allocate──▶ ALLOCATED ──refcount→0, no reusable data──▶ FREE
      │                   │  ▲
      │ reserve           │  └─ refcount→0 with reusable data: stays ALLOCATED ("cached", evictable)
      ▼                   ▼
    PENDING ─commit─▶ ALLOCATED ─begin eviction / swap-out─▶ EVICTING ─done─▶ FREE
      └──abort──▶ FREE

PENDING is a block that is owned but whose data is still arriving (a swap-in, a prefill being written, a
pre-allocated reserve); EVICTING is a block whose data is leaving (eviction, swap-out). Neither may be chosen by
allocation, eviction or compaction.

A :class:`KVBlock` holds no state of its own: every field reads the pool's metadata arrays, and ``kv_data`` is a
view of the block's slice of the one KV tensor. Capacity is a fixed property of the block (the text's
``memory_usage`` read 0 for every FREE block, so nothing could ever be allocated).
"""
from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np
import torch

from .errors import ConfigError, IllegalTransitionError

if TYPE_CHECKING:
    from .pool import BlockPool


class BlockStatus(IntEnum):
    """One byte per block in the pool's ``status`` array."""

    FREE = 0
    PENDING = 1
    ALLOCATED = 2
    EVICTING = 3

    @staticmethod
    def check(block_id: int, old: "BlockStatus | int", new: "BlockStatus | int") -> None:
        """Raise :class:`IllegalTransitionError` unless ``old -> new`` is an edge of the state machine."""
        if new not in _ALLOWED[old]:
            raise IllegalTransitionError(
                f"block {block_id}: illegal transition {BlockStatus(old).name} -> {BlockStatus(new).name} "
                f"(allowed from {BlockStatus(old).name}: {', '.join(s.name for s in _ALLOWED[old]) or 'none'})")


_ALLOWED: dict[int, frozenset[BlockStatus]] = {
    BlockStatus.FREE: frozenset({BlockStatus.PENDING, BlockStatus.ALLOCATED}),
    BlockStatus.PENDING: frozenset({BlockStatus.ALLOCATED, BlockStatus.FREE}),
    BlockStatus.ALLOCATED: frozenset({BlockStatus.EVICTING, BlockStatus.FREE}),
    BlockStatus.EVICTING: frozenset({BlockStatus.FREE}),
}


class KVBlock:
    """A view of block ``block_id`` of ``pool``, with the text's fields and methods. Cheap to create, never stale."""

    __slots__ = ("pool", "block_id")

    def __init__(self, pool: "BlockPool", block_id: int) -> None:
        from .pool import BlockPool  # here, not at the top: the pool imports this module
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
        if not (type(required_size) is int or isinstance(required_size, np.integer)) or required_size < 0:
            raise ConfigError(f"required_size must be a byte count >= 0, got {required_size!r}")
        return self.status is BlockStatus.FREE and self.memory_usage >= required_size

    def allocate(self, kv_data: torch.Tensor | None = None) -> "KVBlock":
        """Take this FREE block (refcount 1) and, if given, write ``kv_data`` ``[2, layers, t, heads, dim]`` into
        its first ``t`` slots. Raises instead of returning False, and leaves the block FREE on any error."""
        self.pool.allocate_block(self.block_id, kv_data)
        return self

    def release(self) -> None:
        """Return an ALLOCATED block with refcount 0 (a cached block) to FREE, dropping its data."""
        self.pool.release_cached(self.block_id)

    def increment_reference(self) -> None:
        self.pool.incref([self.block_id])

    def decrement_reference(self) -> None:
        """Drop one reference; at 0 the block stays ALLOCATED and evictable (its data is kept)."""
        self.pool.decref([self.block_id])
