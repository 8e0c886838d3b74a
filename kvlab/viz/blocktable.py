"""BlockTableView: the picture of the PagedAttention paper, live (text §2.2.3 block tables, §2.2.6 shared prefixes).

Left, every live sequence as a row of its logical blocks (box ``i`` holds its tokens ``i*B .. i*B+B-1``); right,
the pool grid; a line from each logical block to the physical block that holds it, in that block's state colour.
Two sequences sharing a block send their lines to the same cell, and the box says ``×2``: the block's refcount.
A prefix hit (the block came from the prefix cache) is outlined in the cached colour; a block copied on write
(a fork's first write into a shared, partly filled block) is outlined in the copy colour and its line is dashed.
Hovering a row highlights its boxes, its lines and its cells.

>>> mgr = kvlab.SequenceManager(pool, prefix_cache=True)
>>> view = BlockTableView(mgr)             # every live sequence of mgr; view.update() after changes
>>> run = view.live(step)                  # or follow a LiveRun: its frames carry the tables
>>> BlockTableView(engine)                 # a paged Engine's running and swapped requests: view.live(engine.step)
>>> BlockTableView(chat_view)              # the answers of a ChatView, each frame as the chat shows it
>>> BlockTableView(recording=run.recording)   # a replay; export_html(rec, path, view="blocktable") for a page

The tables travel in the frames' tail (``tail["tables"]``, see :mod:`kvlab.viz.tables`), so the player, a replay
and an exported page show them as they were at each step. The PNG fallback is :func:`plot_block_table`.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvlab.core.errors import ConfigError
from kvlab.core.checks import show
from kvlab.viz.chat import ChatView
from kvlab.viz.frames import decode_recording, frame_of
from kvlab.viz.live import LiveRun, Recording
from kvlab.viz.static import Picture
from kvlab.viz.tables import MAX_ROWS, BlockTables, frame_tables, plot_block_table
from kvlab.viz.views import FrameView


class BlockTableView(FrameView):
    """Sequences as rows of logical blocks, lines to their physical blocks in the pool grid beside.

    ``source`` is a :class:`~kvlab.SequenceManager`, an :class:`~kvlab.Engine` with paged memory (see
    :class:`~kvlab.viz.tables.BlockTables`; the first ``max_rows`` sequences are drawn) or a
    :class:`~kvlab.viz.ChatView` (its answers' tables, each frame it shows); or give ``recording=`` frames that
    carry tables (a run this view followed, a ChatView's ``recording``). A view of a manager or an engine listens
    to its pool for copies on write until :meth:`close`."""

    view = "blocktable"

    def __init__(self, source: Any = None, *, recording: Recording | Iterable[bytes] | None = None,
                 max_rows: int = MAX_ROWS, **kwargs: Any) -> None:
        self.chat: ChatView | None = None  # set first: a refused view is closed when collected
        self.tables: BlockTables | None = None
        if (source is None) == (recording is None):
            raise ConfigError(f"a BlockTableView shows a SequenceManager, a paged Engine or a ChatView, or replays "
                              f"a recording: give one, got {show(source)} and recording={show(recording)}")
        if isinstance(source, ChatView):
            if source.session is None:
                raise ConfigError("this ChatView replays a recording: give BlockTableView(recording=chat.recording)")
            self.chat = source
            pool = source.session.pool
        elif source is not None:
            self.tables = BlockTables(source, max_rows=max_rows)
            pool = self.tables.pool
        else:
            pool = None
        try:
            super().__init__(pool, recording=recording, **kwargs)
        except BaseException:
            if self.tables is not None:  # refused: nothing is left listening
                self.tables.close()
            raise
        if self.chat is not None:
            self.chat.mirrors.append(self)

    def update(self) -> None:
        """Send the tables and the pool as they are now (a ChatView's source: the frame it showed last)."""
        if self.chat is not None:
            self.show_frame(self.chat.latest())
        elif self.tables is not None:
            self.show_frame(frame_of(self.tables.pool, **self.tables.tail()))
        else:
            super().update()  # a replay: refused, with the reason

    def follow(self, run: LiveRun) -> None:
        """Be driven by ``run`` and put this view's tables in every frame it builds (a run on another pool than
        the tables' sends frames without them)."""
        super().follow(run)
        if self.tables is not None and run.pool is self.tables.pool:
            run.builder.tail_sources.append(self.tables.tail)

    def load(self, recording: Recording | Iterable[bytes]) -> None:
        """Show a recording (see :meth:`FrameView.load`) once every frame's tables are checked: a bad one changes
        nothing."""
        frames = decode_recording(recording)
        for i, f in enumerate(frames):
            try:
                frame_tables(f)
            except ConfigError as e:
                raise ConfigError(f"frame {i} of the recording: {e}") from None
        super().load([f.data for f in frames])

    def close(self) -> None:
        """Stop listening for copies on write and following a ChatView, and close the widget."""
        if self.tables is not None:
            self.tables.close()
        if self.chat is not None and self in self.chat.mirrors:
            self.chat.mirrors.remove(self)
        super().close()

    def figure(self) -> Picture:
        return plot_block_table(self.latest())


__all__ = ["BlockTableView"]
