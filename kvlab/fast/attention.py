"""Paged decode attention by a compiled kernel (``kvlab/fast/_paged_attention.c``), §2.2.5's speed on the CPU.

For decode on the CPU in fp32 the reference's gather is most of the cost: it reads and writes every byte of K/V
once more before SDPA reads it. The kernel instead runs an online softmax that reads each block where it lies,
through the block table, on ``torch.get_num_threads()`` threads. :func:`paged_attention` here takes the reference's
arguments (checked by :func:`kvlab.core.attention.check_paged`), sends the decode rows to the kernel where it
applies and every other row to the reference's gather + SDPA; ``tests/test_attention.py`` holds the two equal.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

from kvlab.core.attention import AttentionWorkspace, PagedCall, TableLike, check_paged, gather_attention
from kvlab.core.checks import check_choice
from kvlab.core.errors import ConfigError
from kvlab.core.pool import BlockPool
from kvlab.core.storage import KVStorage
from kvlab.fast.compiled import load_extension

Impl = Literal["auto", "torch", "compiled"]

_decode: Callable[..., None] | None = load_extension(
    "_paged_attention", "decode", "paged_attention gathers blocks for SDPA meanwhile.")
DECODE_KERNEL_COMPILED = _decode is not None
_THREAD_FLOATS = 1 << 19  # K/V floats (2 MB, ~0.1 ms of work) per extra kernel thread: starting one costs 20-50 us


def paged_attention(q: torch.Tensor, kv: BlockPool | KVStorage, layer: int, block_tables: TableLike,
                    seq_lens: Sequence[int] | torch.Tensor, query_lens: Sequence[int] | torch.Tensor | None = None,
                    *, scale: float | None = None, workspace: AttentionWorkspace | None = None,
                    impl: Impl = "auto") -> torch.Tensor:
    """:func:`kvlab.core.attention.paged_attention`, its decode rows by the compiled kernel where it applies.

    ``impl``: ``"auto"``: the kernel where it applies, else the reference; ``"torch"``: the reference only;
    ``"compiled"``: the kernel, a :class:`ConfigError` where it does not apply (see
    :func:`compiled_decode_refusal`). The kernel gathers nothing and leaves ``workspace`` alone."""
    check_choice(impl, "impl", ("auto", "torch", "compiled"))
    call = check_paged(q, kv, layer, block_tables, seq_lens, query_lens, scale, workspace)
    out = torch.empty_like(q)
    todo: Sequence[int] = range(len(call.lens))
    if impl != "torch":
        refusal = compiled_decode_refusal(q, call.storage, call.qlens)
        if refusal is None:
            return _compiled_decode(q, call, call.tables, call.lens)
        if impl == "compiled":
            raise ConfigError(f"impl='compiled', but the compiled decode kernel does not apply: {refusal}")
        decode = [i for i, m in enumerate(call.qlens) if m == 1]
        if decode and compiled_decode_refusal(q, call.storage, [1]) is None:  # a step mixing prefill and decode
            rows = torch.tensor([call.first[i] for i in decode], device=q.device)
            out[rows] = _compiled_decode(q[rows], call, call.tables[decode], [call.lens[i] for i in decode])
            todo = [i for i, m in enumerate(call.qlens) if m != 1]
    return gather_attention(q, call, todo, workspace, out)


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


def _compiled_decode(q: torch.Tensor, call: PagedCall, tables: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Decode attention by the kernel for the rows ``q`` of sequences with ``tables`` and ``lens``: it reads K/V
    in place and splits the work over ``torch.get_num_threads()`` threads."""
    storage, layer, s = call.storage, call.layer, call.storage.spec
    assert _decode is not None
    q = q.contiguous()
    tables = tables.contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.long)
    out = torch.empty_like(q)
    _decode(out.data_ptr(), q.data_ptr(), storage.kv[0, layer].data_ptr(), storage.kv[1, layer].data_ptr(),
            tables.data_ptr(), tables.shape[1], seq_lens.data_ptr(), len(lens), q.shape[1], s.num_kv_heads,
            s.head_dim, s.block_size, storage.num_blocks, s.head_dim ** -0.5 if call.scale is None else call.scale,
            torch.get_num_threads(), _THREAD_FLOATS)
    return out
