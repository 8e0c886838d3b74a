"""Live views of the pool (all of §2.2, made visible): anywidget classes, live runs, static figures, HTML replay.

``from kvlab.viz import PoolView`` needs the ``jupyter`` extra (anywidget); frames, live runs, recordings, static
figures (:class:`Picture`, colours from :mod:`kvlab.viz.palette`) and HTML export work in a plain script.
``import kvlab`` does not import this package: kvlab exposes the view classes lazily, so the core never loads
Jupyter.
"""
from __future__ import annotations

from typing import Any

from kvlab.viz import palette
from kvlab.viz.export import export_html
from kvlab.viz.fonts import use_cjk_font
from kvlab.viz.frames import CACHED, STATE_NAMES, Frame, FrameBuilder, build_frame, decode_frame, frame_of
from kvlab.viz.live import PRESETS, LiveRun, Pacer, RandomWorkload, Recording, record
from kvlab.viz.static import Picture, plot_dashboard, plot_evictions, plot_fragmentation, plot_pool
from kvlab.viz.tables import BlockTables, frame_tables, plot_block_table

_VIEWS = ("PoolView", "EvictionView", "FragmentationView", "Dashboard", "FrameView", "DASHBOARD_PRESETS")
_REMOTE = ("NEVER_SEEN", "RemoteCacheView", "plot_remote", "watch_engine")


def __getattr__(name: str) -> Any:
    if name in _VIEWS:  # anywidget is imported only when a view is asked for
        from kvlab.viz import views
        return getattr(views, name)
    if name == "ChatView":
        from kvlab.viz.chat import ChatView
        return ChatView
    if name == "BlockTableView":
        from kvlab.viz.blocktable import BlockTableView
        return BlockTableView
    if name in _REMOTE:  # the router's view of a server's cache: needs the events extra (pyzmq, msgspec)
        from kvlab.viz import remote
        return getattr(remote, name)
    raise AttributeError(f"module 'kvlab.viz' has no attribute {name!r}")


__all__ = [
    "BlockTableView", "BlockTables", "CACHED", "ChatView", "DASHBOARD_PRESETS", "Dashboard", "EvictionView", "Frame",
    "FrameBuilder", "FrameView",
    "FragmentationView", "LiveRun", "PRESETS", "Pacer", "Picture", "PoolView", "RandomWorkload", "Recording",
    "STATE_NAMES", "build_frame", "decode_frame", "export_html", "frame_of", "palette", "plot_dashboard",
    "plot_evictions", "plot_fragmentation", "plot_pool", "record", "frame_tables", "plot_block_table",
    "use_cjk_font", "NEVER_SEEN", "RemoteCacheView", "plot_remote", "watch_engine",
]
