"""Watch both pools of a disaggregated run live: one pool view per rank, updated as blocks are sent and received.

:func:`watch_disagg` runs :func:`~kvlab.distributed.disagg.run_disagg` as two threads of this process on the
caller's two managers, shows one :class:`~kvlab.viz.PoolView` per rank side by side (a frame each time a rank
sends, receives or skips blocks), checks both pools' invariants when the run ends, and shows each final pool as a
picture for readers without a live kernel. The Jupyter packages are imported only when it is called: ``import
kvlab.distributed`` stays free of them.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from kvlab.core.events import Event
from kvlab.core.pool import BlockPool
from kvlab.core.sequence import SequenceManager
from kvlab.distributed.connector import BlocksReceived, BlocksSent, BlocksSkipped
from kvlab.distributed.disagg import Batches, DisaggResult, run_disagg

_MOVES = (BlocksSent, BlocksReceived, BlocksSkipped)  # the events that change what a pool view shows


@dataclass(frozen=True)
class WatchedDisagg:
    """What a watched run did. ``frames``: frames recorded per rank (prefill, decode); ``differ``: physical blocks
    whose state differs between the two pools at the end, of ``blocks`` per pool. ``str()`` is the chapter's line."""

    result: DisaggResult
    frames: tuple[int, int]
    differ: int
    blocks: int

    def __str__(self) -> str:
        got = self.result.received
        return (f"帧数 (frames)：预填充 {self.frames[0]}，解码 {self.frames[1]}；接收 {got.blocks_received} 块，"
                f"跳过 {got.blocks_skipped} 块；两个池都通过 check_invariants() (both pools pass)")


def watch_disagg(batches: Batches, max_new_tokens: int, managers: tuple[SequenceManager, SequenceManager],
                 titles: tuple[str, str], *, pace: float = 0.0, timeout: float = 30.0) -> WatchedDisagg:
    """Run prefill and decode as two threads on ``managers`` and show both pools while it runs.

    ``titles`` label the two views and pictures; ``pace`` (seconds) slows each transfer so a person can follow it;
    ``timeout`` bounds every wait as in :func:`~kvlab.distributed.disagg.run_disagg`, whose errors propagate.
    Returns what the run did; both pools have passed ``check_invariants()``.
    """
    import ipywidgets as widgets  # type: ignore[import-untyped]
    from IPython.display import display

    from kvlab.viz import PoolView, Recording, build_frame, frame_of, plot_pool

    views = [PoolView(m.pool) for m in managers]
    records = [Recording(), Recording()]

    def recorder(rec: Recording, pool: BlockPool) -> Callable[[Event], None]:
        def on_event(e: Event) -> None:
            if isinstance(e, _MOVES):
                rec.append(build_frame(pool))
        return on_event

    for rec, m in zip(records, managers):
        m.pool.events.subscribe(recorder(rec, m.pool))
    display(widgets.HBox([widgets.VBox([widgets.Label(t), v]) for t, v in zip(titles, views)]))

    done: dict[str, Any] = {}
    # The run goes on a thread so this one can feed the views while it runs (the kernel shows nothing until a
    # cell's code yields, and a view fed from the rank threads would race their event handlers).
    worker = threading.Thread(target=lambda: done.update(res=run_disagg(
        batches, max_new_tokens, threads=True, managers=managers, pace=pace, timeout=timeout)))
    worker.start()
    shown = [0, 0]
    while worker.is_alive() or any(s < len(r) for s, r in zip(shown, records)):
        for i, (v, rec) in enumerate(zip(views, records)):
            while shown[i] < len(rec):
                v.show_frame(rec[shown[i]])
                shown[i] += 1
        time.sleep(0.05)
    worker.join()
    if "res" not in done:
        raise RuntimeError("the disaggregated run ended without a result (its error was printed by its thread)")
    for v, rec, m in zip(views, records, managers):
        v.load(rec)                      # the whole run, for the player's slider
        m.check_invariants()
    states = [frame_of(m.pool).state for m in managers]
    for title, m in zip(titles, managers):
        picture = plot_pool(m.pool)      # the same state as a picture, for readers without a live kernel
        picture.suptitle(title)
        display(picture)
    return WatchedDisagg(done["res"], (len(records[0]), len(records[1])), int((states[0] != states[1]).sum()),
                         len(states[0]))
