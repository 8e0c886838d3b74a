"""How a paged-attention kernel walks a block table, one block at a time (an online softmax).

A kernel never holds a sequence's K/V as one tensor. For one query it walks the block table: logical block ``i``
is physical block ``table[i]``, whose slots ``table[i] * B .. table[i] * B + B - 1`` hold positions
``i * B .. i * B + B - 1``; of the last block only the first ``seq_len - i * B`` slots are read (the rest is stale
data from an earlier owner). Block by block it scores the query against that block's keys and folds the scores
into a running softmax, so it never needs all the scores at once:

    m_new = max(m, max_j s_j)                        running max
    alpha = exp(m - m_new)                           how much the sums so far shrink under the new max
    l_new = l * alpha + sum_j exp(s_j - m_new)       running sum of the exponentials
    acc   = acc * alpha + sum_j exp(s_j - m_new) v_j

and divides ``acc`` by ``l`` at the end. That is ``softmax(s) @ V`` exactly, up to rounding (the same sums added
in another order). :func:`walk_block_table` does it in plain PyTorch for one query head and keeps every step, so a
chapter can print the walk; it is a teaching twin of :func:`kvlab.paged_attention`, not a fast path.
Like the real kernels it keeps the running max, sum and accumulator in fp32 (fp64 if the pool is fp64).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.core.attention import check_paged
from kvlab.core.checks import is_int
from kvlab.core.errors import ConfigError, KVDataError
from kvlab.core.pool import BlockPool
from kvlab.core.storage import KVStorage


@dataclass(frozen=True)
class BlockStep:
    """One block of the walk: logical block ``logical`` lives in physical block ``physical``; its positions
    ``first_pos .. last_pos`` are read from slots ``first_slot .. first_slot + last_pos - first_pos``.
    ``block_max`` and ``block_sum`` (the sum of ``exp(s - block_max)``) are what this block alone contributes;
    ``alpha`` rescales what came before, and ``running_max`` / ``running_sum`` are the softmax state after it."""
    logical: int
    physical: int
    first_pos: int
    last_pos: int
    first_slot: int
    block_max: float
    block_sum: float
    alpha: float
    running_max: float
    running_sum: float

    @property
    def tokens(self) -> int:
        """Positions this block contributes (fewer than the block size only for a partly filled last block)."""
        return self.last_pos - self.first_pos + 1


@dataclass(frozen=True)
class BlockWalk:
    """A whole walk: its ``steps`` in table order, the query head and the KV head it reads (grouped-query
    attention), every position's score (``scores`` ``[seq_len]``, already scaled) and the ``output`` ``[head_dim]``
    (``acc / l`` after the last block)."""
    steps: tuple[BlockStep, ...]
    head: int
    kv_head: int
    block_size: int
    seq_len: int
    scores: torch.Tensor
    output: torch.Tensor

    HEADER = ("逻辑块 logical", "物理块 physical", "位置 positions", "槽位 slots", "块内最大 block max",
              "块内和 block sum", "缩放 alpha", "累计最大 running max", "累计和 running sum")

    def block_weights(self) -> list[float]:
        """Each block's share of the final attention weight: ``exp(block_max - m) * block_sum / l`` with ``m`` and
        ``l`` the final running max and sum (the shares sum to 1). The same partials, combined after the walk, are
        how split-KV kernels merge segments computed in parallel."""
        m, total = self.steps[-1].running_max, self.steps[-1].running_sum
        return [math.exp(s.block_max - m) * s.block_sum / total for s in self.steps]

    def rows(self) -> list[tuple[str, ...]]:
        """The walk as text cells, one row per block (the columns of :attr:`HEADER`)."""
        return [(str(s.logical), str(s.physical), f"{s.first_pos}-{s.last_pos}",
                 f"{s.first_slot}-{s.first_slot + s.tokens - 1}", f"{s.block_max:.3f}", f"{s.block_sum:.3f}",
                 f"{s.alpha:.4f}", f"{s.running_max:.3f}", f"{s.running_sum:.3f}") for s in self.steps]

    def table(self) -> str:
        """:meth:`rows` under :attr:`HEADER`, as aligned text."""
        return text_table(self.HEADER, self.rows())

    def __str__(self) -> str:
        return self.table()

    def plot(self, layer: int) -> Any:
        """Two panels: every position's score coloured by its logical block (physical block ``b..`` marked under
        it, the running max after each block dashed), and each block's share of the weight (:meth:`block_weights`).
        ``layer`` only labels the title. Returns the Figure."""
        from matplotlib import colormaps

        from kvlab.viz.static import Picture

        colors = colormaps["tab10"].colors  # type: ignore[attr-defined]
        fig = Picture(figsize=(10, 3), layout="tight")
        ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1]})
        for s in self.steps:
            ax1.bar(range(s.first_pos, s.last_pos + 1), self.scores[s.first_pos:s.last_pos + 1].tolist(),
                    color=colors[s.logical % 10], width=1.0)
            ax1.hlines(s.running_max, s.first_pos - 0.5, s.last_pos + 0.5, colors="k", linestyles="dashed", lw=1)
            ax1.text((s.first_pos + s.last_pos) / 2, ax1.get_ylim()[0], f"b{s.physical}", ha="center", va="bottom",
                     fontsize=9)
        ax1.set_xlabel("位置 (position)；标注 b 为物理块 (physical block)")
        ax1.set_ylabel("分数 (score) q·k/√d")
        ax1.set_title(f"第 {layer} 层、query 头 {self.head}：按块着色的分数，虚线为累计最大值 (running max)",
                      fontsize=9)
        share = self.block_weights()
        ax2.bar(range(len(share)), share, color=[colors[i % 10] for i in range(len(share))])
        ax2.set_xlabel("逻辑块 (logical block)")
        ax2.set_title("注意力权重的份额 (weight share)", fontsize=9)
        return fig


def _width(text: str) -> int:
    """Columns a string takes in a terminal or notebook output (a CJK character takes two)."""
    return sum(2 if ord(ch) > 0x2E80 else 1 for ch in text)


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, free_last: bool = False) -> str:
    """``rows`` of text cells under ``header``, each column right-aligned to its widest cell as a notebook shows it
    (a bilingual header such as "块 block" is wider than its characters). With ``free_last`` the last column is
    free text (what happened, a block's tokens): left-aligned and never padded."""
    cells = [tuple(header), *(tuple(r) for r in rows)]
    aligned = len(header) - free_last
    widths = [max(_width(r[i]) for r in cells) for i in range(aligned)]
    return "\n".join("  ".join([*(" " * (w - _width(c)) + c for c, w in zip(r, widths)), *r[aligned:]]).rstrip()
                     for r in cells)


def walk_block_table(q: torch.Tensor, kv: BlockPool | KVStorage, layer: int, block_table: Sequence[int],
                     seq_len: int, head: int, *, scale: float | None = None) -> BlockWalk:
    """Attention of one query (``q`` ``[q_heads, head_dim]``, the last position of a sequence of ``seq_len``
    tokens) for query head ``head``, computed as a paged kernel does: block by block along ``block_table``, with an
    online softmax. ``scale`` defaults to ``head_dim ** -0.5``. Arguments are checked as
    :func:`kvlab.paged_attention` checks them (typed errors naming the bad one)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        raise KVDataError(f"q must be one token's query [q_heads, head_dim], got "
                          f"{list(q.shape) if isinstance(q, torch.Tensor) else q!r}")
    if not is_int(seq_len) or seq_len < 1:
        raise ConfigError(f"seq_len must be an int >= 1 (a query sees at least itself), got {seq_len!r}")
    call = check_paged(q[None], kv, layer, [block_table], [seq_len], [1], scale, None)
    storage, B = call.storage, call.storage.spec.block_size
    q_heads, kv_heads = q.shape[0], storage.spec.num_kv_heads
    if not is_int(head) or not 0 <= head < q_heads:
        raise ConfigError(f"head must be a query head in 0..{q_heads - 1}, got {head!r}")
    kv_head = int(head) // (q_heads // kv_heads)  # grouped-query attention: a group of query heads shares a KV head
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh = q[head].to(acc_dtype)
    sc = call.scale if call.scale is not None else 1 / math.sqrt(q.shape[1])
    table = call.tables[0].tolist()
    m = torch.tensor(float("-inf"), dtype=acc_dtype)
    total = torch.zeros((), dtype=acc_dtype)  # the running sum, "l" in the formulas above
    acc = torch.zeros_like(qh)
    steps, scores = [], []
    for i in range(-(-seq_len // B)):
        first, last = i * B, min(seq_len, (i + 1) * B) - 1
        slots = torch.arange(table[i] * B, table[i] * B + last - first + 1)
        k, v = storage.read_slots(call.layer, slots)  # only the filled slots: the tail's stale data is never read
        k, v = k[:, kv_head].to(acc_dtype), v[:, kv_head].to(acc_dtype)
        s = (k @ qh) * sc
        block_max = s.max()
        m_new = torch.maximum(m, block_max)
        alpha = torch.exp(m - m_new)  # exp(-inf) = 0 on the first block: nothing to rescale yet
        p = torch.exp(s - m_new)
        total = total * alpha + p.sum()
        acc = acc * alpha + p @ v
        m = m_new
        steps.append(BlockStep(i, table[i], first, last, int(slots[0]), float(block_max),
                               float(torch.exp(s - block_max).sum()), float(alpha), float(m), float(total)))
        scores.append(s)
    return BlockWalk(tuple(steps), int(head), kv_head, B, int(seq_len), torch.cat(scores), (acc / total).to(q.dtype))
