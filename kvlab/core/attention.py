"""Attention that reads K/V straight from the paged pool (the payoff of §2.2.2's fixed-size blocks).

A sequence's keys are scattered over physical blocks in any order; its block table says where. For each
sequence we gather its blocks (one ``index_select`` per K and V over the block axis of the layer) into a small
reused workspace, view the first ``seq_len`` slots as ``[heads, len, dim]`` and call
``F.scaled_dot_product_attention`` on that view. Why per sequence and not one padded batch:

* the workspace only ever holds one sequence, so it stays in cache and is never reallocated (fresh CPU
  allocations cost 5-10x a gather);
* slicing to ``seq_len`` *is* the length mask: slots past the length (stale data from earlier owners of the block)
  never reach the kernel, and no padded query ever attends over padding;
* grouped-query attention uses ``enable_gqa=True``; K/V heads are never ``.repeat``-ed.

Queries are packed: ``q`` is ``[num_tokens, q_heads, dim]`` with ``query_lens[i]`` rows for sequence ``i``, which
are its *last* ``query_lens[i]`` positions. Decode is ``query_lens == 1``; prefill is ``query_lens == seq_lens``; a
prompt that hit the prefix cache is in between (causal with an offset). :func:`contiguous_attention` is the
reference on plain tensors, written with explicit matmuls and softmax so it shares no code path with SDPA.

The speed trick lives apart, in :mod:`kvlab.fast.attention`: for decode on CPU in fp32 the gather is most of the
cost, so there a compiled kernel reads each block where it lies. It takes the same arguments, validated by
:func:`check_paged` below, and ``tests/test_attention.py`` holds it equal to :func:`paged_attention`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from kvlab.core.errors import ConfigError, KVDataError
from kvlab.core.checks import check_real
from kvlab.core.pool import BlockPool
from kvlab.core.storage import KVStorage, int_tensor

TableLike = torch.Tensor | Sequence[Sequence[int]]


class AttentionWorkspace:
    """Reused gather buffers ``[2, blocks, block_size, kv_heads, dim]``; grows (rarely) and never shrinks."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def get(self, num_blocks: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer for ``num_blocks`` blocks shaped like one layer's block ``like`` ``[B, heads, dim]``."""
        b = self.buf
        if b is not None and (b.shape[2:] != like.shape or b.dtype != like.dtype or b.device != like.device):
            b = None  # another pool: start over
        if b is None or b.shape[1] < num_blocks:
            rows = max(num_blocks, 2 * b.shape[1]) if b is not None else num_blocks  # doubling: rare regrowth
            self.buf = b = torch.empty((2, rows, *like.shape), dtype=like.dtype, device=like.device)
        return b


def pad_block_tables(tables: TableLike) -> torch.Tensor:
    """Block tables as one int64 ``[batch, max_blocks]`` tensor on the CPU, short rows padded with block 0 (never
    read: attention stops at each sequence's length)."""
    if isinstance(tables, torch.Tensor):
        if tables.dim() != 2:
            raise ConfigError(f"block_tables must be [batch, max_blocks], got shape {list(tables.shape)}")
        return int_tensor(tables, "block_tables", ConfigError, "cpu")
    if not isinstance(tables, (list, tuple, np.ndarray)):
        raise ConfigError(f"block_tables must be a [batch, max_blocks] tensor or a list of lists, got {tables!r}")
    rows = [int_tensor(t, "block_tables", ConfigError) for t in tables]
    width = max((len(t) for t in rows), default=0)
    out = torch.zeros((len(rows), width), dtype=torch.long)
    for i, t in enumerate(rows):
        if t.dim() != 1:
            raise ConfigError(f"block_tables row {i} must be a list of ids, got {tables[i]!r}")
        out[i, :len(t)] = t
    return out


def _lengths(x: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    t = int_tensor(x, name, ConfigError)
    out = t.tolist()
    if t.dim() != 1 or min(out, default=0) < 0:
        raise ConfigError(f"{name} must be a list of ints >= 0, got {x!r}")
    return out


def _scale(scale: float | None) -> float | None:
    """None (``head_dim ** -0.5``) or a finite number > 0 as a float, else :class:`ConfigError` (the kernel and
    SDPA would disagree on what a NaN or infinite scale means)."""
    return None if scale is None else check_real(scale, "scale", lo=0, lo_open=True)


def _shape(x: object) -> str:
    """A tensor as its shape and device (what an error about it needs), anything else as its repr."""
    return f"of shape {list(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else repr(x)


def _causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Query ``i`` (position ``kv_len - q_len + i``) sees keys ``0 .. kv_len - q_len + i``; None when it sees all
    (one query) or when SDPA's own ``is_causal`` says the same (as many queries as keys)."""
    if q_len == 1 or q_len == kv_len:
        return None
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


class PagedCall(NamedTuple):
    """A :func:`paged_attention` call's arguments, checked and normalised (what every implementation reads)."""
    storage: KVStorage
    layer: int
    tables: torch.Tensor  # [batch, max_blocks] int64 on the pool's device
    lens: list[int]  # tokens of each sequence in the cache
    qlens: list[int]  # query rows of each sequence, its last positions
    first: list[int]  # each sequence's first row of q
    scale: float | None


def check_paged(q: torch.Tensor, kv: BlockPool | KVStorage, layer: int, block_tables: TableLike,
                seq_lens: Sequence[int] | torch.Tensor, query_lens: Sequence[int] | torch.Tensor | None,
                scale: float | None, workspace: AttentionWorkspace | None) -> PagedCall:
    """:func:`paged_attention`'s arguments checked (a typed error naming the bad one) and normalised."""
    if workspace is not None and not isinstance(workspace, AttentionWorkspace):
        raise ConfigError(f"workspace must be an AttentionWorkspace or None, got {workspace!r}")
    scale = _scale(scale)
    storage = kv.storage_of() if isinstance(kv, BlockPool) else kv
    if not isinstance(storage, KVStorage):
        raise ConfigError(f"kv must be a BlockPool or a KVStorage, got {kv!r}")
    s = storage.spec
    layer = storage.check_layer(layer)  # a bool or float layer would hand a kernel a temporary copy
    if not isinstance(q, torch.Tensor):
        raise KVDataError(f"q must be a torch.Tensor, got {q!r}")
    if q.dim() != 3 or q.shape[2] != s.head_dim or not q.shape[1] or q.shape[1] % s.num_kv_heads:
        raise KVDataError(f"q has shape {list(q.shape)}; expected [tokens, q_heads, {s.head_dim}] with q_heads a "
                          f"positive multiple of the pool's {s.num_kv_heads} kv heads")
    if q.dtype != s.dtype or q.device != storage.kv.device:
        raise KVDataError(f"q is {q.dtype} on {q.device}; the pool stores {s.dtype} on {storage.kv.device}")
    tables = pad_block_tables(block_tables)  # checked on the CPU: on a GPU each read of a value waits for it
    lens = _lengths(seq_lens, "seq_lens")
    qlens = [1] * len(lens) if query_lens is None else _lengths(query_lens, "query_lens")
    if not len(lens) == len(qlens) == tables.shape[0]:
        raise ConfigError(f"{tables.shape[0]} block tables, {len(lens)} seq_lens, {len(qlens)} query_lens")
    if sum(qlens) != q.shape[0]:
        raise KVDataError(f"q has {q.shape[0]} rows but query_lens sum to {sum(qlens)}")
    B = s.block_size
    for i, (n, m) in enumerate(zip(lens, qlens)):
        if m > n or n > tables.shape[1] * B:
            raise ConfigError(f"sequence {i}: {m} queries over {n} tokens with a table of {tables.shape[1]} "
                              f"blocks of {B} (queries must be <= tokens <= table capacity)")
    if tables.numel() and not 0 <= int(tables.min()) <= int(tables.max()) < storage.num_blocks:
        raise ConfigError(f"block tables name blocks outside 0..{storage.num_blocks - 1}")
    return PagedCall(storage, layer, tables.to(storage.kv.device), lens, qlens, np.cumsum([0, *qlens]).tolist(), scale)


def paged_attention(q: torch.Tensor, kv: BlockPool | KVStorage, layer: int, block_tables: TableLike,
                    seq_lens: Sequence[int] | torch.Tensor, query_lens: Sequence[int] | torch.Tensor | None = None,
                    *, scale: float | None = None, workspace: AttentionWorkspace | None = None) -> torch.Tensor:
    """Causal attention of packed queries ``q`` ``[num_tokens, q_heads, dim]`` over the paged K/V of ``layer``.

    Args:
        kv: a :class:`BlockPool` with storage, or its :class:`KVStorage`.
        block_tables: ``[batch, max_blocks]`` physical block ids (or a list of lists); row ``i`` covers
            ``seq_lens[i]`` tokens whose K/V are already written (including this step's tokens).
        seq_lens: tokens of each sequence in the cache.
        query_lens: query rows per sequence (default 1 each: decode); they are the sequence's last positions.
        workspace: reuse the gather buffer across calls (the model keeps one); a fresh one otherwise.
    Returns ``[num_tokens, q_heads, dim]`` in ``q``'s dtype.
    """
    call = check_paged(q, kv, layer, block_tables, seq_lens, query_lens, scale, workspace)
    return gather_attention(q, call, range(len(call.lens)), workspace, torch.empty_like(q))


def gather_attention(q: torch.Tensor, call: PagedCall, todo: Sequence[int], workspace: AttentionWorkspace | None,
                     out: torch.Tensor) -> torch.Tensor:
    """Fill ``out``'s rows of the sequences ``todo`` of a checked call: gather each one's blocks into the
    workspace, then SDPA over them. Returns ``out``."""
    storage, layer, tables, lens, qlens, first, scale = call
    s = storage.spec
    B = s.block_size
    ws = (workspace or AttentionWorkspace()).get(-(-max(lens, default=0) // B), storage.kv[0, layer, 0])
    # Gather rows of ``sub`` tokens (a block is ``per`` rows): index_select's CPU speed depends on the row size
    # (128 KB rows, B=64 at 8 heads x 64, copied at half the speed of 32 KB ones here), so rows stay <= 16 tokens.
    sub = math.gcd(B, 16)
    per = B // sub
    k_all, v_all = (storage.kv[j, layer].view(storage.num_blocks * per, -1) for j in (0, 1))  # no copy
    offsets = torch.arange(per, device=tables.device)
    for i in todo:
        n, m, row = lens[i], qlens[i], first[i]
        if not m:
            continue
        nb = -(-n // B)
        ids = tables[i, :nb] if per == 1 else (tables[i, :nb, None] * per + offsets).view(-1)
        k = torch.index_select(k_all, 0, ids, out=ws[0, :nb].view(nb * per, -1))
        v = torch.index_select(v_all, 0, ids, out=ws[1, :nb].view(nb * per, -1))
        k, v = (x.view(nb * B, s.num_kv_heads, s.head_dim)[:n] for x in (k, v))
        # 4-D inputs: SDPA's fused CPU kernel takes these strided views as they are (3-D ones go a slow path). A
        # whole prompt (m == n) is plain causal attention, which SDPA does without a mask (1.8x faster at 2,000).
        o = F.scaled_dot_product_attention(q[None, row:row + m].transpose(1, 2), k[None].transpose(1, 2),
                                           v[None].transpose(1, 2), attn_mask=_causal_mask(m, n, q.device),
                                           is_causal=1 < m == n, scale=scale, enable_gqa=True)
        out[row:row + m] = o[0].transpose(0, 1)
    return out


def contiguous_attention(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                         query_lens: Sequence[int] | None = None, *, scale: float | None = None) -> torch.Tensor:
    """Reference: the same causal attention on plain per-sequence tensors ``keys[i]``/``values[i]``
    ``[len_i, kv_heads, dim]``, computed in float64 with explicit matmuls (GQA by grouping query heads)."""
    scale = _scale(scale)
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or 0 in q.shape[1:]:
        raise KVDataError(f"q must be a [tokens, q_heads, dim] tensor with q_heads, dim > 0, got {_shape(q)}")
    if not (isinstance(keys, (list, tuple)) and isinstance(values, (list, tuple))):
        raise ConfigError(f"keys and values must be lists of tensors, got {_shape(keys)} and {_shape(values)}")
    qlens = [1] * len(keys) if query_lens is None else _lengths(query_lens, "query_lens")
    if not len(keys) == len(values) == len(qlens) or sum(qlens) != q.shape[0]:
        raise ConfigError(f"{len(keys)} keys, {len(values)} values and query_lens {qlens} for {q.shape[0]} rows of "
                          f"q: give one of each per sequence, the query lengths summing to the rows")
    for i, (k, v, m) in enumerate(zip(keys, values, qlens)):
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)) or k.dim() != 3 or v.shape != k.shape \
                or k.shape[2] != q.shape[2] or not k.shape[1] or q.shape[1] % k.shape[1] \
                or not k.device == v.device == q.device:
            raise KVDataError(f"sequence {i}: keys {_shape(k)} and values {_shape(v)}; expected two [len, kv_heads, "
                              f"{q.shape[2]}] on {q.device}, kv_heads dividing q's {q.shape[1]} heads")
        if m > k.shape[0]:
            raise ConfigError(f"sequence {i}: {m} queries over {k.shape[0]} tokens (queries must be <= tokens)")
    out = torch.empty_like(q)
    row = 0
    for k, v, m in zip(keys, values, qlens):
        n, hkv, d = k.shape
        qi = q[row:row + m].double().reshape(m, hkv, -1, d)  # [m, kv_heads, group, dim]
        scores = torch.einsum("ihgd,jhd->hgij", qi, k.double()) * (scale if scale is not None else d ** -0.5)
        allowed = torch.ones(m, n, dtype=torch.bool, device=q.device).tril(n - m)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[row:row + m] = torch.einsum("hgij,jhd->ihgd", probs, v.double()).reshape(m, -1, d).to(q.dtype)
        row += m
    return out
