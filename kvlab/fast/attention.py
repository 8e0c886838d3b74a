"""Paged decode attention at speed: a compiled kernel on the CPU, one batched gather on a GPU (§2.2.5).

* CPU, fp32: the reference's gather is most of the cost (it reads and writes every byte of K/V once more before
  SDPA reads it). The compiled kernel (``kvlab/fast/_paged_attention.c``) instead runs an online softmax that reads
  each block where it lies, through the block table, on ``torch.get_num_threads()`` threads.
* GPU: the reference's loop launches a gather and an SDPA per sequence, so a decode step waits on kernel launches
  (5-6x one padded SDPA on an H200). The batched path gathers every sequence's blocks with one index per K and V
  and runs one masked SDPA over the batch.

:func:`paged_attention` here takes the reference's arguments (checked by :func:`kvlab.core.attention.check_paged`),
sends the decode rows to one of these and every other row to the reference's gather + SDPA;
``tests/test_attention.py`` holds each equal to the reference.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from kvlab.core.attention import AttentionWorkspace, PagedCall, TableLike, check_paged, gather_attention
from kvlab.core.checks import check_choice
from kvlab.core.errors import ConfigError
from kvlab.core.pool import BlockPool
from kvlab.core.storage import KVStorage
from kvlab.fast.compiled import load_extension

Impl = Literal["auto", "torch", "compiled", "batched"]

_decode: Callable[..., None] | None = load_extension(
    "_paged_attention", "decode", "paged_attention gathers blocks for SDPA meanwhile.")
DECODE_KERNEL_COMPILED = _decode is not None
_THREAD_FLOATS = 1 << 19  # K/V floats (2 MB, ~0.1 ms of work) per extra kernel thread: starting one costs 20-50 us


def paged_attention(q: torch.Tensor, kv: BlockPool | KVStorage, layer: int, block_tables: TableLike,
                    seq_lens: Sequence[int] | torch.Tensor, query_lens: Sequence[int] | torch.Tensor | None = None,
                    *, scale: float | None = None, workspace: AttentionWorkspace | None = None,
                    impl: Impl = "auto") -> torch.Tensor:
    """:func:`kvlab.core.attention.paged_attention`, its decode rows (one query per sequence) by a faster path.

    ``impl``: ``"auto"``: the compiled kernel where it applies (CPU, fp32), the batched gather on other devices,
    else the reference; ``"torch"``: the reference only; ``"compiled"``: the kernel, a :class:`ConfigError` where
    it does not apply (see :func:`compiled_decode_refusal`); ``"batched"``: the batched gather on any device.
    Only the reference's rows use ``workspace``."""
    check_choice(impl, "impl", ("auto", "torch", "compiled", "batched"))
    call = check_paged(q, kv, layer, block_tables, seq_lens, query_lens, scale, workspace)
    everyone = list(range(len(call.lens)))
    if impl == "torch":
        return gather_attention(q, call, everyone, workspace, torch.empty_like(q))
    refusal = compiled_decode_refusal(q, call.storage, call.qlens)
    if impl == "compiled" and refusal is not None:
        raise ConfigError(f"impl='compiled', but the compiled decode kernel does not apply: {refusal}")
    if impl != "batched" and refusal is None:
        return _compiled_decode(q, call, everyone)
    decode = [i for i, m in enumerate(call.qlens) if m == 1]
    if impl == "auto" and compiled_decode_refusal(q, call.storage, [1]) is None:  # prefill rows beside decode
        fast = _compiled_decode
    elif impl == "batched" or q.device.type != "cpu":
        fast = _batched_decode
    else:
        return gather_attention(q, call, everyone, workspace, torch.empty_like(q))
    if decode and len(decode) == len(everyone):
        return fast(q, call, decode)
    out = torch.empty_like(q)
    if decode:
        rows = torch.tensor([call.first[i] for i in decode], device=q.device)
        out[rows] = fast(q[rows], call, decode)
    return gather_attention(q, call, [i for i, m in enumerate(call.qlens) if m != 1], workspace, out)


def _batched_decode(q: torch.Tensor, call: PagedCall, seqs: list[int]) -> torch.Tensor:
    """Decode attention for the rows ``q`` (one query each) of the sequences ``seqs``: all their blocks gathered
    by one index into a ``[batch, tokens, heads, dim]`` batch, then one SDPA masking each row past its length."""
    storage, layer, s = call.storage, call.layer, call.storage.spec
    lens = [call.lens[i] for i in seqs]
    width = -(-max(lens) // s.block_size)
    tables = call.tables[seqs if len(seqs) < len(call.lens) else slice(None), :width]  # short rows: block 0
    valid = torch.arange(width * s.block_size, device=q.device) < torch.tensor(lens, device=q.device)[:, None]
    # Slots past a sequence's length hold stale bytes, NaN among them: a mask alone would still multiply them by 0.
    k, v = (storage.kv[j, layer][tables].view(len(seqs), -1, s.num_kv_heads, s.head_dim)
            .masked_fill_(~valid[:, :, None, None], 0) for j in (0, 1))
    o = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=valid[:, None, None], scale=call.scale, enable_gqa=True)
    return o[:, :, 0]


def compiled_decode_refusal(q: torch.Tensor, storage: KVStorage, query_lens: Sequence[int]) -> str | None:
    """Why the compiled decode kernel cannot serve this (already checked) call, or None when it can: it
    handles one query per sequence, fp32, on the CPU."""
    if _decode is None:
        return "it is not built (KVLAB_PURE_PYTHON is set, or kvlab was installed without a C compiler)"
    if q.device.type != "cpu":
        return f"q is on {q.device}, not the CPU"
    if q.dtype != torch.float32:
        return f"q is {q.dtype}, not torch.float32"
    if any(m != 1 for m in query_lens):
        return f"query_lens are {list(query_lens)}; it decodes one query per sequence"
    if not storage.kv.is_contiguous():
        return "the pool's K/V tensor is not contiguous"
    return None


def _compiled_decode(q: torch.Tensor, call: PagedCall, seqs: list[int]) -> torch.Tensor:
    """Decode attention by the kernel for the rows ``q`` (one query each) of the sequences ``seqs``: it reads K/V
    in place and splits the work over ``torch.get_num_threads()`` threads."""
    storage, layer, s = call.storage, call.layer, call.storage.spec
    assert _decode is not None
    q = q.contiguous()
    tables = call.tables[seqs].contiguous()
    seq_lens = torch.tensor([call.lens[i] for i in seqs], dtype=torch.long)
    out = torch.empty_like(q)
    _decode(out.data_ptr(), q.data_ptr(), storage.kv[0, layer].data_ptr(), storage.kv[1, layer].data_ptr(),
            tables.data_ptr(), tables.shape[1], seq_lens.data_ptr(), len(seqs), q.shape[1], s.num_kv_heads,
            s.head_dim, s.block_size, storage.num_blocks, s.head_dim ** -0.5 if call.scale is None else call.scale,
            torch.get_num_threads(), _THREAD_FLOATS)
    return out
