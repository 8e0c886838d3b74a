"""kvlab.distributed.watch: both pools of a disaggregated run, recorded frame by frame and shown side by side."""
from __future__ import annotations

import IPython.display
import ipywidgets as widgets

from kvlab import EventRecorder, TinyConfig
from kvlab.distributed import BlocksReceived, BlocksSent, BlocksSkipped, demo_batches, reference, watch_disagg
from kvlab.distributed.disagg import make_manager
from kvlab.viz import PoolView
from kvlab.viz.static import Picture

CFG = TinyConfig()
BATCHES = demo_batches(3, 70, 40)  # two batches; 40 shared tokens = 2 full blocks of 16 cached on the decode rank


def test_watch_records_a_frame_per_move_and_reports_the_pools(monkeypatch):
    shown: list[object] = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown.extend(objs))
    managers = (make_manager(CFG, 16, 64), make_manager(CFG, 16, 64))
    busy = managers[1].create()                       # rank 1 holds a sequence of its own: the pools must differ
    managers[1].append(busy, 40)
    moves = [EventRecorder(m.pool.events, (BlocksSent, BlocksReceived, BlocksSkipped)) for m in managers]
    watch = watch_disagg(BATCHES, 3, managers, ("prefill", "decode"), timeout=20)

    assert watch.result.compare(reference(BATCHES, 3))["tokens_equal"]
    assert watch.frames == (len(moves[0]), len(moves[1])) and min(watch.frames) > 0
    assert watch.result.received.blocks_skipped == 3 * 2
    assert watch.blocks == 64 and 0 < watch.differ <= 64
    box, *pictures = shown                             # the two live views side by side, then one picture per pool
    assert isinstance(box, widgets.HBox)
    views = [vbox.children[1] for vbox in box.children]
    assert [vbox.children[0].value for vbox in box.children] == ["prefill", "decode"]
    assert all(isinstance(v, PoolView) for v in views)
    assert [len(pictures), *(isinstance(p, Picture) for p in pictures)] == [2, True, True]
    text = str(watch)
    assert f"预填充 {watch.frames[0]}，解码 {watch.frames[1]}" in text and "跳过 6 块" in text
