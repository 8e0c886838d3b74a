"""Look inside a model's attention: record what its paged attention receives at one layer.

:meth:`kvlab.Llama.step` computes each layer's queries and hands them, with the batch's block tables and lengths,
to ``model.attention`` (:func:`kvlab.paged_attention` or its compiled twin). An :class:`AttentionProbe` stands in
for that function while it is open, keeps a copy of what one layer was given, and passes the call on unchanged,
so the model computes exactly what it would have computed without it::

    with kvlab.AttentionProbe(model, layer=3) as probe:
        model.step(manager, [seq], [prompt])
    q = probe.calls[-1].query(0)          # the last prompt token's query at layer 3, [q_heads, head_dim]

A chapter can then replay that query against the K/V in the pool (e.g. :func:`kvlab.walk_block_table`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.core.attention import pad_block_tables
from kvlab.core.checks import is_int
from kvlab.core.errors import ConfigError, IllegalTransitionError
from kvlab.serve.model import Llama


@dataclass(frozen=True)
class AttentionCall:
    """One call of a layer's attention: the packed queries ``q`` ``[tokens, q_heads, head_dim]`` (a copy), the
    block tables (one list per sequence, as many blocks as its ``seq_lens`` entry needs), the tokens of each
    sequence in the cache and its query rows (its last positions)."""
    layer: int
    q: torch.Tensor
    block_tables: tuple[tuple[int, ...], ...]
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]

    def query(self, seq: int, row: int = -1) -> torch.Tensor:
        """The query ``[q_heads, head_dim]`` of sequence ``seq``'s query row ``row`` (default its last: the
        newest position)."""
        if not is_int(seq) or not 0 <= seq < len(self.seq_lens):
            raise ConfigError(f"seq must be a sequence of this call, 0..{len(self.seq_lens) - 1}, got {seq!r}")
        m = self.query_lens[seq]
        if not is_int(row) or not -m <= row < m:
            raise ConfigError(f"sequence {seq} has {m} query rows: row must be in {-m}..{m - 1}, got {row!r}")
        first = sum(self.query_lens[:seq])
        return self.q[first + row % m]


class AttentionProbe:
    """Records ``model``'s attention calls at ``layer`` while open (``with`` block); each becomes an
    :class:`AttentionCall` in :attr:`calls`. Closing puts the model's own attention function back."""

    def __init__(self, model: Llama, layer: int) -> None:
        if not isinstance(model, Llama):
            raise ConfigError(f"an AttentionProbe watches a kvlab Llama, got {model!r:.80}")
        if not is_int(layer) or not 0 <= layer < model.cfg.num_layers:
            raise ConfigError(f"layer must be in 0..{model.cfg.num_layers - 1}, got {layer!r}")
        self.model, self.layer = model, int(layer)
        self.calls: list[AttentionCall] = []
        self._inner: Callable[..., torch.Tensor] | None = None

    def __enter__(self) -> AttentionProbe:
        if self._inner is not None:
            raise IllegalTransitionError("this probe is already open")
        self._inner = inner = self.model.attention

        def attention(q: torch.Tensor, kv: Any, layer: int, block_tables: Any, seq_lens: Any,
                      query_lens: Any = None, **kw: Any) -> torch.Tensor:
            if layer == self.layer:
                self._record(q, kv, block_tables, seq_lens, query_lens)
            return inner(q, kv, layer, block_tables, seq_lens, query_lens, **kw)

        self.model.attention = attention
        return self

    def __exit__(self, *exc: object) -> None:
        if self._inner is not None:
            self.model.attention = self._inner
            self._inner = None

    def _record(self, q: torch.Tensor, kv: Any, block_tables: Any, seq_lens: Any, query_lens: Any) -> None:
        B = kv.spec.block_size  # a KVStorage (what step passes) or a BlockPool: both carry the spec
        lens = [int(n) for n in seq_lens]
        qlens = [1] * len(lens) if query_lens is None else [int(n) for n in query_lens]
        tables = pad_block_tables(block_tables).tolist()
        self.calls.append(AttentionCall(self.layer, q.detach().clone(),
                                        tuple(tuple(t[:-(-n // B)]) for t, n in zip(tables, lens)),
                                        tuple(lens), tuple(qlens)))
