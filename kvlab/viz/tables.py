"""Block tables in frames: which physical block holds each logical block of every live sequence (text §2.2.3, the
picture of the PagedAttention paper), for the :class:`~kvlab.viz.BlockTableView` and the ChatView.

A sequence owns no memory, only a *block table*: its logical block ``i`` (tokens ``i*B .. i*B+B-1``) lives in the
physical block ``table[i]`` of the pool (:mod:`kvlab.core.sequence`). :class:`BlockTables` reads the tables of a
source's live sequences when a frame is made and puts them in the frame's tail, ``tail["tables"]`` (the layout is
written down in :mod:`kvlab.viz.frames`), with two facts a table alone does not hold:

* **prefix hits**: how many leading blocks the sequence got from the prefix cache (not recomputed);
* **copies on write**: which of its blocks are private copies a fork made when it first wrote into a shared,
  partly filled block. The pool says so only as it happens (a ``CopiedOnWrite`` event), so a
  :class:`BlockTables` listens to its pool from when it is made until :meth:`~BlockTables.close`. A copy stays
  marked where it landed while that entry still names it.

Who shares a block needs nothing new: the frame's body carries every block's refcount.

The sources of tables:

* a :class:`~kvlab.SequenceManager`: every live sequence, as ``seq 3``;
* an :class:`~kvlab.Engine` with paged memory: its running requests, then the swapped ones, as ``request 17``;
* a function returning rows ``(id, label, blocks, hits)``, with ``pool=`` the pool they live in (the ChatView
  passes its answers' tables this way).

:func:`frame_tables` reads the tables back from a frame (checked), and :func:`plot_block_table` draws them as a
still: the rows beside the pool grid, a line from each logical block to its physical block.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import ConnectionPatch, Patch, Rectangle

from kvlab.core.checks import check_positive, is_int, is_text, show
from kvlab.core.errors import ConfigError
from kvlab.core.events import Event, Listener
from kvlab.core.pool import BlockPool
from kvlab.core.sequence import CopiedOnWrite, SequenceManager
from kvlab.serve.engine import Engine
from kvlab.serve.memory import PagedMemory
from kvlab.viz.palette import COPY_DASH, COPY_RGB, HIT_RGB, OTHER_WORDS, rgb01
from kvlab.viz.static import MIN_PT, FrameLike, Picture, as_frame, draw_pool, grid_shape, pool_colors, state_handles

MAX_ROWS = 16  # sequences a frame lists: more would not fit a view beside the grid
MAX_ROW_BLOCKS = 64  # logical blocks a row lists; ``more`` counts the rest
STILL_BLOCKS = 10  # logical blocks a still draws per row: at 9 pt, ten fit a notebook's column beside the grid

#: One sequence's table as a source gives it: (id, label, physical block of each logical block (-1: swapped out
#: to host memory), leading blocks that were prefix-cache hits).
Row = tuple[int, str, Sequence[int], int]


class TableRow(NamedTuple):
    """One row of ``tail["tables"]`` as :func:`frame_tables` reads it back (see :mod:`kvlab.viz.frames`)."""
    id: int
    label: str
    blocks: list[int]
    hits: int
    copied: list[int]
    more: int


class BlockTables(Listener):
    """The block tables of ``source``'s live sequences, for frames (see the module docstring for the sources).

    :meth:`tail` returns ``{"tables": ...}``, the entry a frame's tail carries: the first ``max_rows`` sequences,
    each with at most :data:`MAX_ROW_BLOCKS` blocks. Put :meth:`tail` in a
    :attr:`FrameBuilder.tail_sources <kvlab.viz.FrameBuilder.tail_sources>` (a BlockTableView does, for the run it
    follows) or pass its entries to ``frame_of(pool, **tables.tail())``. :meth:`close` stops listening to the
    pool (a listening pool builds an event object for every change); use it as a context manager to close it."""

    def __init__(self, source: Any, *, pool: BlockPool | None = None, max_rows: int = MAX_ROWS) -> None:
        self.max_rows = check_positive(max_rows, "max_rows")
        self.pool, self._read = _reader(source, pool)  # refused here, before anything listens
        self.copied: list[tuple[int, int, int]] = []  # (row id, position, block): copies still where they landed
        self._new: list[int] = []  # blocks copied on write since the last tail
        super().__init__(self.pool.events)  # closed, tables mark only the copies on write seen until then

    def _on_event(self, e: Event) -> None:
        if isinstance(e, CopiedOnWrite):
            self._new.append(e.dst)

    def rows(self) -> list[Row]:
        """Every live sequence's row as the source gives it, unbounded, in the source's order."""
        return self._read()

    def tail(self) -> dict[str, Any]:
        """``{"tables": {"rows": [...], "left_out": k}}``, the tables now (the layout is in
        :mod:`kvlab.viz.frames`); the copies made since the previous call are marked where they landed."""
        rows = self._read()
        self._mark(rows)
        copied: dict[int, list[int]] = {}
        for rid, pos, _ in self.copied:
            copied.setdefault(rid, []).append(pos)
        shown = rows[:self.max_rows]
        return {"tables": {"rows": [{"id": rid, "label": label, "blocks": [int(b) for b in blocks[:MAX_ROW_BLOCKS]],
                                     "hits": int(hits),
                                     "copied": sorted(p for p in copied.get(rid, ()) if p < MAX_ROW_BLOCKS),
                                     "more": max(0, len(blocks) - MAX_ROW_BLOCKS)}
                                    for rid, label, blocks, hits in shown],
                           "left_out": len(rows) - len(shown)}}

    def _mark(self, rows: list[Row]) -> None:
        """Mark each new copy where a table names it, and forget the marks no table names any more: a block that
        fills up may be swapped for an equal cached one, and the copy's id be reused elsewhere."""
        new, self._new = self._new, []
        for b in new:
            self.copied += [(rid, p, b) for rid, _, blocks, _ in rows for p, x in enumerate(blocks) if x == b]
        live = {rid: blocks for rid, _, blocks, _ in rows}
        self.copied = [(r, p, b) for r, p, b in self.copied if r in live and p < len(live[r]) and live[r][p] == b]


def _reader(source: Any, pool: Any) -> tuple[BlockPool, Callable[[], list[Row]]]:
    """The pool ``source``'s sequences live in and a function reading their rows; :class:`ConfigError` for
    anything else."""
    if isinstance(source, (SequenceManager, Engine)):
        if pool is not None:
            raise ConfigError(f"pool= goes with a function of rows; a {type(source).__name__} brings its own pool, "
                              f"got pool={show(pool)}")
        if isinstance(source, SequenceManager):
            manager = source
            return manager.pool, lambda: [(s.seq_id, f"序列 {s.seq_id} seq", s.block_table,
                                           s.num_cached_tokens // manager.block_size) for s in manager.seqs.values()]
        memory = source.memory
        if not isinstance(memory, PagedMemory):
            raise ConfigError(f"an Engine with memory={source.config.memory!r} keeps no block tables (each request "
                              "holds one contiguous region); use memory='paged'")
        return memory.pool, lambda: _engine_rows(source, memory)
    if callable(source):
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"block tables from a function need pool=, the BlockPool they live in, got "
                              f"{show(pool)}")
        checked_pool = pool
        return pool, lambda: _checked_rows(source(), checked_pool)
    raise ConfigError(f"block tables come from a SequenceManager, an Engine with paged memory, or a function of "
                      f"rows (with pool=), not {show(source)}")


def _engine_rows(engine: Engine, memory: PagedMemory) -> list[Row]:
    """The engine's running requests, then its swapped ones: each one's sequence (its ``kv``)."""
    seqs = [(job.req.id, memory.sequence(job)) for job in (*engine.running, *engine.swapped)]
    return [(rid, f"请求 {rid} request", s.block_table, s.num_cached_tokens // memory.bs) for rid, s in seqs]


def _checked_rows(rows: Any, pool: BlockPool) -> list[Row]:
    """Rows from a function, each checked: ``(id, label, blocks, hits)`` with blocks ids of ``pool`` or -1."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise ConfigError(f"a function of block-table rows must return a list of rows, got {show(rows)}")
    out: list[Row] = []
    for i, row in enumerate(rows):
        if not _row_ok(row, pool.num_blocks):
            raise ConfigError(f"block-table row {i} must be (id, label, blocks, hits): an int, a str, ids of the "
                              f"pool's {pool.num_blocks} blocks (-1: on the host) and an int >= 0; got {show(row)}")
        rid, label, blocks, hits = row
        out.append((int(rid), label, [int(b) for b in blocks], int(hits)))
    return out


def _row_ok(row: Any, n: int) -> bool:
    if not (isinstance(row, (tuple, list)) and len(row) == 4):
        return False
    rid, label, blocks, hits = row
    return is_int(rid) and is_text(label) and isinstance(blocks, (list, tuple)) and is_int(hits) and hits >= 0 \
        and all(is_int(b) and -1 <= b < n for b in blocks)


# ---------------------------------------------------------------------------- reading them back
def frame_tables(x: FrameLike) -> tuple[list[TableRow], int]:
    """The block tables ``x`` (a frame, its bytes, or a pool: none) carries, as ``(rows, left_out)``; ``([], 0)``
    when it carries none. :class:`ConfigError` naming what is wrong when ``tail["tables"]`` is not laid out as
    :mod:`kvlab.viz.frames` says (a recording from elsewhere)."""
    f = as_frame(x)
    t = f.tail.get("tables")
    if t is None:
        return [], 0
    if not (isinstance(t, dict) and isinstance(t.get("rows"), list) and is_int(t.get("left_out"))
            and t["left_out"] >= 0):
        raise ConfigError(f"frame {f.seq}: tail['tables'] must be {{'rows': [...], 'left_out': n}}, got {show(t)}")
    rows = []
    for i, r in enumerate(t["rows"]):
        try:
            row = TableRow(**r) if isinstance(r, dict) else None
        except TypeError:  # keys missing or unknown
            row = None
        if row is None or not _valid(row, f.num_blocks):
            raise ConfigError(f"frame {f.seq}: block-table row {i} is not a row of ids, hits, copies and a count "
                              f"for {f.num_blocks} blocks: {show(r)}")
        rows.append(row)
    return rows, int(t["left_out"])


def _valid(r: TableRow, n: int) -> bool:
    def ints(xs: Any, lo: int, hi: int) -> bool:
        return isinstance(xs, list) and all(is_int(x) and lo <= x < hi for x in xs)
    return (is_int(r.id) and is_text(r.label) and ints(r.blocks, -1, n) and is_int(r.hits) and r.hits >= 0
            and ints(r.copied, 0, len(r.blocks)) and is_int(r.more) and r.more >= 0)


# ---------------------------------------------------------------------------- the still
def plot_block_table(x: FrameLike) -> Picture:
    """The block tables of a frame (or its bytes) as a figure: each sequence a row of its logical blocks (the
    first :data:`STILL_BLOCKS`, each labelled with its physical block and, when shared, ``×`` its references),
    in the colour of its block's grid cell; prefix hits and copies on write outlined; a line from every logical
    block to its cell in the pool grid beside, dashed to a copy. A frame without tables shows the grid alone."""
    f = as_frame(x)
    rows, left_out = frame_tables(f)
    if not rows:
        fig = Picture(figsize=(9, 5), layout="constrained")
        ax = fig.add_subplot()
        draw_pool(ax, f)
        ax.set_title(ax.get_title() + "\n这幅画面不带块表 (no block tables)", fontsize=10)
        fig.legend(handles=state_handles(f), loc="outside right upper", fontsize=MIN_PT, frameon=False)
        return fig
    cols = min(STILL_BLOCKS, max(len(r.blocks) for r in rows))
    left = 1.4 + 0.55 * max(cols, 4)
    fig = Picture(figsize=(left + 5, max(5.0, 2.4 + 0.55 * len(rows))), layout="constrained")
    tab, grid = fig.subplots(1, 2, width_ratios=(left, 5))
    draw_pool(grid, f)
    colors = pool_colors(f) / 255
    height, width = grid_shape(f.num_blocks)
    if width <= 32:  # cells large enough to tell apart: white lines between them, as the widget's gaps
        grid.set_xticks(np.arange(width + 1) - 0.5, minor=True)
        grid.set_yticks(np.arange(height + 1) - 0.5, minor=True)
        grid.grid(which="minor", color="white", linewidth=1)
        grid.tick_params(which="minor", length=0)
    tab.set_zorder(grid.get_zorder() + 1)  # the boxes over the lines, which start under them
    tab.patch.set_visible(False)
    marks: set[str] = set()
    for y, r in enumerate(rows):
        copied = set(r.copied)
        for p, b in enumerate(r.blocks[:cols]):
            hit, copy = p < r.hits, p in copied
            marks |= {"HIT"} if hit and not copy else {"COPIED"} if copy else set()
            edge = rgb01(COPY_RGB) if copy else rgb01(HIT_RGB) if hit else (0.5, 0.5, 0.5)
            face = colors[b] if b >= 0 else (1.0, 1.0, 1.0)
            tab.add_patch(Rectangle((p - 0.42, y - 0.36), 0.84, 0.72, facecolor=face, edgecolor=edge,
                                    linewidth=2.5 if hit or copy else 0.6, hatch=None if b >= 0 else "//"))
            refs = int(f.refcount[b]) if b >= 0 else 0
            dark = b >= 0 and float(np.dot(colors[b], (0.299, 0.587, 0.114))) < 0.45
            tab.text(p, y, "主机\nhost" if b < 0 else f"{b}\n×{refs}" if refs >= 2 else str(b), ha="center",
                     va="center", fontsize=MIN_PT, color="white" if dark else "black", linespacing=0.95)
            if b >= 0:  # the line, drawn by the grid's axes so that it passes under the boxes to its right
                line = ConnectionPatch((p, y), (b % width, b // width), coordsA=tab.transData,
                                       coordsB=grid.transData, color=rgb01(COPY_RGB) if copy else colors[b],
                                       linewidth=1.6 if copy else 1.0, alpha=0.85,
                                       linestyle=(0, COPY_DASH) if copy else "-")
                line.set_clip_on(False)
                line.set_in_layout(False)
                grid.add_artist(line)
        if len(r.blocks) + r.more > cols:
            tab.text(cols - 0.4, y, f" 另 {len(r.blocks) + r.more - cols} 块", ha="left", va="center", fontsize=MIN_PT)
    tab.set_xlim(-0.6, max(cols, 4) - 0.4)
    tab.set_ylim(len(rows) - 0.5, -0.5)
    tab.set_aspect("equal")  # square boxes, however few the rows
    tab.set_xticks(range(cols), [str(p) for p in range(cols)], fontsize=MIN_PT)
    tab.set_yticks(range(len(rows)), [r.label for r in rows], fontsize=MIN_PT)
    tab.set_xlabel("逻辑块 (logical block)；格里是它的物理块，共享时 ×引用数", fontsize=MIN_PT)
    tab.tick_params(length=0)
    for spine in tab.spines.values():
        spine.set_visible(False)
    more = f"\n（另有 {left_out} 个未显示）" if left_out else ""
    tab.set_title(f"{len(rows) + left_out} 个序列的块表 (block tables){more}", fontsize=10)
    handles = state_handles(f) + [Line2D([], [], color="0.4", label=OTHER_WORDS["MAP"])]
    if "HIT" in marks:
        handles.append(Patch(facecolor="white", edgecolor=rgb01(HIT_RGB), linewidth=2.5, label=OTHER_WORDS["HIT"]))
    if "COPIED" in marks:
        handles += [Patch(facecolor="white", edgecolor=rgb01(COPY_RGB), linewidth=2.5, label=OTHER_WORDS["COPIED"]),
                    Line2D([], [], color=rgb01(COPY_RGB), linestyle=(0, COPY_DASH), label=OTHER_WORDS["COPYLINE"])]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=MIN_PT, frameon=False)
    return fig


__all__ = ["BlockTables", "MAX_ROWS", "MAX_ROW_BLOCKS", "Row", "TableRow", "frame_tables", "plot_block_table"]
