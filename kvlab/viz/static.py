"""Static figures with matplotlib: the same views as the widgets, for print, for notebooks exported without widget
state, and as the PNG in every widget's display bundle. Colours and grid layout match ``widgets/*.js``.

Every function accepts a pool, a frame's bytes or a decoded :class:`~kvlab.viz.frames.Frame`, and returns a
``matplotlib.figure.Figure`` built without pyplot (no backend is touched, nothing is shown implicitly).
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..errors import ConfigError
from ..pool import BlockPool
from .frames import Frame, build_frame, decode_frame

# Same values as KV_RGB / KV_MAP / KV_GAUGES in widgets/*.js (a test checks they agree).
STATE_RGB = {"FREE": (232, 232, 232), "PENDING": (242, 193, 78), "ALLOC1": (74, 134, 200), "ALLOC8": (20, 52, 110),
             "EVICTING": (214, 69, 69), "CACHED": (127, 191, 127)}
MAP_RGB = {"USED": (90, 90, 90), "CACHED": (150, 150, 150), "FREE": (200, 228, 200), "RUN": (56, 160, 60)}
GAUGES = (("utilisation", "utilisation", (74, 134, 200)), ("external fragmentation", "external", (230, 140, 40)),
          ("internal waste", "internal_waste", (150, 90, 200)), ("free-space scatter", "scatter", (60, 170, 170)))
LEGEND = {"FREE": "free", "PENDING": "pending", "ALLOC1": "allocated", "ALLOC8": "shared (8+ refs)",
          "EVICTING": "evicting", "CACHED": "cached"}
VICTIM_RGB, CANDIDATE_RGB = (214, 69, 69), (160, 160, 160)

FrameLike = BlockPool | bytes | bytearray | memoryview | Frame


def as_frame(x: FrameLike) -> Frame:
    """A decoded frame from a pool (its current state), frame bytes or a frame."""
    if isinstance(x, Frame):
        return x
    if isinstance(x, BlockPool):
        return decode_frame(build_frame(x))
    if isinstance(x, (bytes, bytearray, memoryview)):
        return decode_frame(x)
    raise ConfigError(f"expected a BlockPool, frame bytes or a Frame, got {type(x).__name__}")


def _rgb(c: tuple[int, int, int]) -> tuple[float, float, float]:
    return (c[0] / 255, c[1] / 255, c[2] / 255)


def grid_shape(n: int) -> tuple[int, int]:
    """(rows, cols) of the widgets' grid: power-of-two columns >= sqrt(n)."""
    cols = 1
    while cols * cols < n:
        cols <<= 1
    return -(-n // cols), cols


def pool_colors(f: Frame) -> np.ndarray:
    """RGB uint8 ``[n, 3]`` per base block, as the PoolView paints it (without flashes)."""
    table = np.array([STATE_RGB[k] for k in ("FREE", "PENDING", "ALLOC1", "EVICTING", "CACHED")], np.float64)
    out = table[f.state]
    alloc = f.state == 2
    t = (np.clip(f.refcount[alloc].astype(np.int64), 1, 8) - 1)[:, None] / 7
    out[alloc] = np.array(STATE_RGB["ALLOC1"]) + (np.array(STATE_RGB["ALLOC8"]) - STATE_RGB["ALLOC1"]) * t
    return np.round(out).astype(np.uint8)


def map_colors(f: Frame) -> np.ndarray:
    """RGB uint8 ``[n, 3]`` of the memory map: used, cached, free, and the largest free run highlighted."""
    out = np.empty((f.num_blocks, 3), np.uint8)
    out[:] = MAP_RGB["USED"]
    out[f.state == 4] = MAP_RGB["CACHED"]
    free = f.state == 0
    out[free] = MAP_RGB["FREE"]
    edges = np.flatnonzero(np.diff(np.concatenate(([0], free.astype(np.int8), [0]))))
    if edges.size:
        starts, lens = edges[::2], edges[1::2] - edges[::2]
        k = int(np.argmax(lens))  # first of the longest, as the widget picks it
        out[starts[k]:starts[k] + lens[k]] = MAP_RGB["RUN"]
    return out


def _image(colors: np.ndarray) -> np.ndarray:
    rows, cols = grid_shape(len(colors))
    img = np.full((rows * cols, 3), 255, np.uint8)
    img[:len(colors)] = colors
    return img.reshape(rows, cols, 3)


def _draw_grid(ax: Any, colors: np.ndarray, title: str) -> None:
    ax.imshow(_image(colors), interpolation="nearest")
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def draw_pool(ax: Any, f: Frame) -> None:
    counts = np.bincount(f.state, minlength=5)
    _draw_grid(ax, pool_colors(f), f"{f.num_blocks} blocks at step {f.step:g}: {counts[2]} referenced, "
                                   f"{counts[4]} cached, {counts[0]} free")
    ax.legend(handles=[Patch(color=_rgb(STATE_RGB[k]), label=label) for k, label in LEGEND.items()],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)


def draw_evictions(ax: Any, evictions: Sequence[dict[str, Any]]) -> None:
    if not evictions:
        ax.set_title("no eviction yet", fontsize=9)
        ax.set_axis_off()
        return
    e = evictions[-1]
    ids = [c[0] for c in e["candidates"]]
    scores = np.array([c[1] for c in e["candidates"]], np.float64)
    span = (scores.max() - scores.min()) or 1.0
    colors = [_rgb(VICTIM_RGB if b == e["victim"] else CANDIDATE_RGB) for b in ids]
    ax.barh(range(len(ids)), 0.05 + (scores - scores.min()) / span, color=colors)
    ax.set_yticks(range(len(ids)), [f"block {b} ({s:g})" for b, s in zip(ids, scores)], fontsize=7)
    ax.invert_yaxis()
    ax.set_xticks([])
    ax.set_title(f"step {e['step']:g}: {e['policy']} evicted block {e['victim']} ({e['reason']})", fontsize=9)


def draw_fragmentation(map_ax: Any, gauge_ax: Any, series_ax: Any, f: Frame,
                       series: Sequence[Sequence[float]] = ()) -> None:
    _draw_grid(map_ax, map_colors(f), f"memory map: largest free run {int(f.num_blocks and _largest(f))} blocks")
    vals = [getattr(f, key) for _, key, _ in GAUGES]
    gauge_ax.barh(range(len(GAUGES)), vals, color=[_rgb(c) for *_, c in GAUGES])
    gauge_ax.set_yticks(range(len(GAUGES)), [f"{name} {100 * v:.1f}%" for (name, _, _), v in zip(GAUGES, vals)],
                        fontsize=7)
    gauge_ax.set_xlim(0, 1)
    gauge_ax.invert_yaxis()
    data = np.array(list(series) or [vals], np.float64)
    for j, (name, _, c) in enumerate(GAUGES):
        series_ax.plot(data[:, j], color=_rgb(c), label=name, lw=1.2)
    series_ax.set_ylim(0, 1)
    series_ax.set_xlabel("frame", fontsize=7)
    series_ax.tick_params(labelsize=7)


def _largest(f: Frame) -> int:
    free = np.concatenate(([0], (f.state == 0).astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(free))
    return int((edges[1::2] - edges[::2]).max()) if edges.size else 0


def plot_pool(x: FrameLike) -> Figure:
    fig = Figure(figsize=(6.4, 5))
    draw_pool(fig.add_subplot(), as_frame(x))
    fig.tight_layout()
    return fig


def plot_evictions(evictions: Sequence[dict[str, Any]]) -> Figure:
    """The latest eviction's ranked candidates (the victim red); ``evictions`` as in frame tails."""
    fig = Figure(figsize=(6, 3))
    draw_evictions(fig.add_subplot(), evictions)
    fig.tight_layout()
    return fig


def plot_fragmentation(x: FrameLike, series: Sequence[Sequence[float]] = ()) -> Figure:
    """Memory map, gauges and (given ``series`` rows of utilisation, external, waste, scatter) time series."""
    fig = Figure(figsize=(9, 4.5))
    gs = fig.add_gridspec(2, 2, width_ratios=(1.2, 1))
    draw_fragmentation(fig.add_subplot(gs[:, 0]), fig.add_subplot(gs[0, 1]), fig.add_subplot(gs[1, 1]),
                       as_frame(x), series)
    fig.tight_layout()
    return fig


def plot_dashboard(x: FrameLike, series: Sequence[Sequence[float]] = (),
                   evictions: Sequence[dict[str, Any]] = ()) -> Figure:
    f = as_frame(x)
    fig = Figure(figsize=(12, 6))
    gs = fig.add_gridspec(3, 3, width_ratios=(1.3, 1.1, 1))
    draw_pool(fig.add_subplot(gs[:, 0]), f)
    draw_fragmentation(fig.add_subplot(gs[:2, 1]), fig.add_subplot(gs[0, 2]), fig.add_subplot(gs[1, 2]), f, series)
    draw_evictions(fig.add_subplot(gs[2, 1:]), list(evictions) or f.evictions)
    fig.tight_layout()
    return fig


def figure_png(fig: Figure, dpi: int = 80) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
