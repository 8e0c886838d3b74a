"""The text's method names on the pool (§2.2.2 ``BlockPool``), made real, kept apart from the reference code.

The text's pool has ``get_best_block``, ``allocate_block``, ``release_block``, ``evict_block``,
``get_memory_usage``, ``calculate_fragmentation`` and ``get_stats``. :class:`kvlab.pool.BlockPool` inherits
them from :class:`TextbookNames`, so a student can call what the text calls; each is a few lines over the
pool's own API (``allocate``, ``free``, ``evict``, ``arrays``), and what the text got wrong is said where it
matters.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from .block import BlockStatus, KVBlock
from .errors import ConfigError, KVDataError

if TYPE_CHECKING:
    from .pool import BlockPool

FREE, ALLOCATED = int(BlockStatus.FREE), int(BlockStatus.ALLOCATED)


def check_kv_data(pool: "BlockPool", kv: Any, capacity_tokens: int | None = None) -> int:
    """The token count of ``kv`` ``[2, layers, tokens, kv_heads, head_dim]`` if the pool can store it (right
    shape, dtype and device; at most ``capacity_tokens``), else :class:`KVDataError`."""
    s = pool.spec
    if not isinstance(kv, torch.Tensor):
        raise KVDataError(f"kv_data must be a torch.Tensor, got {type(kv).__name__}")
    want = (2, s.num_layers, s.num_kv_heads, s.head_dim)
    if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
        raise KVDataError(f"kv_data has shape {list(kv.shape)}, expected [2, {s.num_layers}, tokens, "
                          f"{s.num_kv_heads}, {s.head_dim}]")
    if kv.dtype != s.dtype or kv.device != pool.storage_of().kv.device:
        raise KVDataError(f"kv_data is {kv.dtype} on {kv.device}; the pool stores {s.dtype} on {s.device}")
    if capacity_tokens is not None and kv.shape[2] > capacity_tokens:
        raise KVDataError(f"kv_data holds {kv.shape[2]} tokens; the block holds {capacity_tokens}")
    return int(kv.shape[2])


class TextbookNames:
    """The text's ``BlockPool`` methods, for :class:`kvlab.pool.BlockPool`."""

    def get_best_block(self, required_size: int) -> KVBlock | None:
        """The smallest FREE block of at least ``required_size`` bytes, without taking it (the text's pool never
        held any block, so its version always returned None)."""
        pool = cast("BlockPool", self)  # only ever mixed into BlockPool
        if isinstance(required_size, bool) or not isinstance(required_size, (int, np.integer)) or required_size < 0:
            raise ConfigError(f"required_size must be a byte count >= 0, got {required_size!r}")
        with pool.lock:
            for k in range(pool.max_order + 1):
                b = pool.free_lists.top(k)
                if pool.bytes_per_block << k >= required_size and b is not None:
                    return KVBlock(pool, b)
            return None

    def allocate_block(self, block_id: int | None = None, kv_data: torch.Tensor | None = None,
                       owner: int = -1) -> KVBlock:
        """Allocate FREE block ``block_id`` (or the smallest class that fits ``kv_data``) and write ``kv_data``
        into its first slots. The text compared a token count with ``kv_data.nbytes`` and a block's capacity
        with the size of the data it last held; here capacity is the block's fixed size in tokens."""
        pool = cast("BlockPool", self)  # only ever mixed into BlockPool
        with pool.lock:
            if block_id is None:
                t = 0 if kv_data is None else check_kv_data(pool, kv_data, pool.block_sizes[-1])
                k = next(k for k, size in enumerate(pool.block_sizes) if size >= t)
            else:
                block_id = pool.check_id(block_id)
                BlockStatus.check(block_id, pool.fields.status[block_id], ALLOCATED)
                k = pool.fields.size_class[block_id]
                t = 0 if kv_data is None else check_kv_data(pool, kv_data, pool.block_sizes[k])
            b = pool.allocate(1, size_class=k, owner=owner, block_id=block_id)[0]
            if kv_data is not None:
                pool.storage_of().block_view(b, pool.meta.span(b))[:, :, :t].copy_(kv_data)
                pool.set_token_count(b, t)
            return KVBlock(pool, b)

    def release_block(self, block_id: int) -> None:
        """The text's name for releasing one block: :meth:`free` of ``[block_id]``."""
        pool = cast("BlockPool", self)  # only ever mixed into BlockPool
        pool.free([block_id])

    def evict_block(self, reason: str = "explicit") -> KVBlock | None:
        """:meth:`evict` returning a :class:`KVBlock` view of the victim (now FREE). The text picked the LRU block
        first and checked its refcount after, so one referenced block stopped every eviction."""
        pool = cast("BlockPool", self)  # only ever mixed into BlockPool
        b = pool.evict(reason)
        return None if b is None else KVBlock(pool, b)

    def calculate_fragmentation(self) -> int:
        """External fragmentation in percent: the share of free memory that the largest request cannot use. A
        request asks for one block of at most the largest class, so only free space that forms whole aligned
        blocks of that class counts as usable. With one size class every free block serves every request: 0 by
        construction, whatever the layout. (The text's ``(total - largest) / total`` over free blocks calls
        four equal free blocks "75% fragmented".)"""
        pool = cast("BlockPool", self)  # only ever mixed into BlockPool
        with pool.lock:
            total = pool.num_free_blocks
            if not total or not pool.max_order:  # one class: every free block is usable, no scan needed
                return 0
            top = 1 << pool.max_order
            aligned = pool.arrays.status[:pool.num_blocks // top * top].reshape(-1, top)
            usable = top * int((aligned == FREE).all(axis=1).sum())
            return int(round(100 * (1 - usable / total)))

    def get_memory_usage(self) -> dict[str, int]:
        """Bytes: ``total``, ``used`` (PENDING/ALLOCATED/EVICTING), ``free``, ``cached`` (inside ``used``),
        ``token_bytes`` (bytes holding real tokens) and the ``fragmentation`` percent. The text summed the
        sizes of the data blocks held, so a block's size changed with what it last stored."""
        pool = cast("BlockPool", self)  # only ever mixed into BlockPool
        with pool.lock:
            c = pool.status_counts()
            cached = sum(1 << pool.fields.size_class[b] for b, _ in pool.policy.order())
            return {"total": pool.num_blocks * pool.bytes_per_block,
                    "used": (pool.num_blocks - c["FREE"]) * pool.bytes_per_block,
                    "free": c["FREE"] * pool.bytes_per_block, "cached": cached * pool.bytes_per_block,
                    "token_bytes": int(pool.arrays.tokens.sum()) * pool.spec.bytes_per_token,
                    "fragmentation": pool.calculate_fragmentation()}

    def get_stats(self) -> dict[str, Any]:
        """Counters since creation (allocations, frees, evictions, splits, merges, migrations, how allocations
        were served) plus the state counts now, cached blocks, lock acquisitions and ``fragmentation``."""
        pool = cast("BlockPool", self)  # only ever mixed into BlockPool
        with pool.lock:
            return {**pool.counts, **pool.status_counts(), "cached": len(pool.policy),
                    "lock_acquisitions": pool.lock_acquisitions, "fragmentation": pool.calculate_fragmentation()}
