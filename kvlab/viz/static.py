"""Static figures with matplotlib: the same views as the widgets, for print, for notebooks exported without widget
state, and as the PNG in every widget's display bundle. Colours and words come from :mod:`kvlab.viz.palette`, as
the widgets' do, and the grid layout matches ``widgets/*.js``.

Every function accepts a pool, a frame's bytes or a :class:`~kvlab.viz.frames.Frame`, and returns a
:class:`Picture`: a matplotlib figure built without pyplot (no backend is touched, nothing is shown twice) that
displays as an image wherever it is the value of a cell, even in a fresh kernel where pyplot was never imported.
"""
from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from kvlab.core.errors import ConfigError
from kvlab.core.pool import BlockPool
from kvlab.viz.frames import Frame, decode_frame, frame_of, free_runs
from kvlab.viz.palette import (CANDIDATE_RGB, GAUGES, OTHER_WORDS, RUN_RGB, STATE_KEYS, STATE_RGB, STATE_WORDS,
                               VICTIM_RGB, fmt_score, rgb01, score_words, shown_score)


class Picture(Figure):
    """A matplotlib figure that shows itself as a PNG (``_repr_png_``): Jupyter shows a bare ``Figure`` as its
    text form (``<Figure size 900x450 with 3 Axes>``) unless pyplot's inline backend happens to be loaded."""

    def _repr_png_(self) -> bytes:
        return figure_png(self, dpi=100)


FrameLike = BlockPool | bytes | bytearray | memoryview | Frame


def as_frame(x: FrameLike) -> Frame:
    """A :class:`Frame` of a pool (its current state), of frame bytes (decoded and checked) or a frame itself."""
    if isinstance(x, Frame):
        return x
    if isinstance(x, BlockPool):
        return frame_of(x)
    if isinstance(x, (bytes, bytearray, memoryview)):
        return decode_frame(x)
    raise ConfigError(f"expected a BlockPool, frame bytes or a Frame, got {type(x).__name__}")


def grid_shape(n: int) -> tuple[int, int]:
    """(rows, cols) of the widgets' grid: power-of-two columns >= sqrt(n)."""
    cols = 1
    while cols * cols < n:
        cols <<= 1
    return -(-n // cols), cols


def pool_colors(f: Frame) -> np.ndarray:
    """RGB uint8 ``[n, 3]`` per base block, as the PoolView paints it (without flashes)."""
    table = np.array([STATE_RGB[k] for k in STATE_KEYS], np.float64)
    out = table[f.state]
    alloc = f.state == 2
    t = (np.clip(f.refcount[alloc].astype(np.int64), 1, 8) - 1)[:, None] / 7
    out[alloc] = np.array(STATE_RGB["ALLOC1"]) + (np.array(STATE_RGB["ALLOC8"]) - STATE_RGB["ALLOC1"]) * t
    return np.round(out).astype(np.uint8)


def map_colors(f: Frame) -> np.ndarray:
    """RGB uint8 ``[n, 3]`` of the memory map: the pool's state colours, the largest free run highlighted."""
    out = pool_colors(f)
    starts, lens = free_runs(f.state)
    if lens.size:
        k = int(np.argmax(lens))  # first of the longest, as the widget picks it
        out[starts[k]:starts[k] + lens[k]] = RUN_RGB
    return out


def _image(colors: np.ndarray) -> np.ndarray:
    rows, cols = grid_shape(len(colors))
    img = np.full((rows * cols, 3), 255, np.uint8)
    img[:len(colors)] = colors
    return img.reshape(rows, cols, 3)


def _draw_grid(ax: Any, colors: np.ndarray, title: str) -> None:
    ax.imshow(_image(colors), interpolation="nearest")
    ax.set_title(title, fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])


def legend(fig: Figure, panels: Sequence[str]) -> None:
    """One legend at the figure's right for every colour the ``panels`` draw (in the widgets' words)."""
    handles = [Patch(facecolor=rgb01(STATE_RGB[k]), edgecolor="0.6", label=STATE_WORDS[k]) for k in STATE_RGB]
    if "fragmentation" in panels:
        handles.append(Patch(facecolor=rgb01(RUN_RGB), edgecolor="0.6", label=OTHER_WORDS["RUN"]))
    if "eviction" in panels:
        handles += [Patch(color=rgb01(VICTIM_RGB), label=OTHER_WORDS["VICTIM"]),
                    Patch(color=rgb01(CANDIDATE_RGB), label=OTHER_WORDS["CANDIDATE"])]
    if "pool" not in panels and "fragmentation" not in panels:
        handles = handles[-2:]
    fig.legend(handles=handles, loc="outside right upper", fontsize=9, frameon=False)


def draw_pool(ax: Any, f: Frame) -> None:
    counts = np.bincount(f.state, minlength=5)
    _draw_grid(ax, pool_colors(f), f"{f.num_blocks} blocks, {f.when}\n{counts[2]} referenced, "
                                   f"{counts[4]} cached, {counts[0]} free")


def _when(e: dict[str, Any]) -> str:
    return f"step {e['at']}" if e.get("at") is not None else f"pool tick {e['step']:g}"


def draw_evictions(ax: Any, evictions: Sequence[dict[str, Any]]) -> None:
    """The latest eviction's candidates, bars of the quantity the policy ranks by, from the frame's ``axis``
    (:func:`~kvlab.viz.palette.bar_axis`: zero, or below the smallest score when the scores are close)."""
    if not evictions:
        ax.set_title("no eviction yet", fontsize=10)
        ax.set_axis_off()
        return
    e = evictions[-1]
    words = score_words(e["policy"])
    ids = [c[0] for c in e["candidates"]]
    shown = [shown_score(e["policy"], float(c[1])) for c in e["candidates"]]
    base = float(e.get("axis", 0.0))
    top = max((abs(v) for v in shown if math.isfinite(v)), default=0.0) or 1.0
    lengths = [top - base if not math.isfinite(v) else abs(v) - base for v in shown]  # never again: the longest
    colors = [rgb01(VICTIM_RGB if b == e["victim"] else CANDIDATE_RGB) for b in ids]
    ax.barh(range(len(ids)), lengths, left=base, color=colors)
    ax.set_yticks(range(len(ids)), [f"{'evicted' if b == e['victim'] else f'#{r + 1}'} · block {b} · {fmt_score(v)}"
                                    for r, (b, v) in enumerate(zip(ids, shown))], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(base, base + (top - base) * 1.05)
    ax.set_xlabel(f"{words['what']}; {words['order']}" + (f" (the axis starts at {fmt_score(base)})" if base else ""),
                  fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_title(f"{_when(e)}: {e['policy'].upper()} evicted block {e['victim']}\nreason: {e['reason']}",
                 fontsize=10)


def gauge_values(f: Frame) -> tuple[float, ...]:
    """The frame's gauges, in :data:`~kvlab.viz.palette.GAUGES`' order (a row of a view's series)."""
    return tuple(getattr(f, key) for _, key, _, _ in GAUGES)


def draw_fragmentation(map_ax: Any, gauge_ax: Any, series_ax: Any, f: Frame,
                       series: Sequence[Sequence[float]] = ()) -> None:
    _draw_grid(map_ax, map_colors(f), f"memory map, {f.when}\nlargest free run "
                                      f"{int(f.num_blocks and _largest(f))} blocks")
    vals = list(gauge_values(f))
    gauge_ax.barh(range(len(GAUGES)), vals, color=[rgb01(c) for _, _, c, _ in GAUGES])
    gauge_ax.set_yticks(range(len(GAUGES)), [f"{name} {100 * v:.1f}%" for (name, *_), v in zip(GAUGES, vals)],
                        fontsize=8)
    gauge_ax.set_xlim(0, 1)
    gauge_ax.invert_yaxis()
    data = np.array(list(series) or [vals], np.float64)
    one = len(data) == 1  # a line through one point draws nothing: show the point
    for j, (name, _, c, dash) in enumerate(GAUGES):
        series_ax.plot(data[:, j], color=rgb01(c), label=name, lw=1.5, dashes=dash or (None, None),
                       marker="o" if one else None)
    series_ax.set_ylim(0, 1)
    series_ax.set_xlabel("picture (one so far: a still)" if one else "picture", fontsize=8)
    series_ax.tick_params(labelsize=8)
    series_ax.legend(fontsize=7, loc="upper left", ncols=2, frameon=False)


def _largest(f: Frame) -> int:
    _, lens = free_runs(f.state)
    return int(lens.max()) if lens.size else 0


def plot_pool(x: FrameLike) -> Picture:
    """The pool grid of a pool or frame, with the legend of its colours."""
    fig = Picture(figsize=(9, 5), layout="constrained")
    draw_pool(fig.add_subplot(), as_frame(x))
    legend(fig, ["pool"])
    return fig


def plot_evictions(evictions: Sequence[dict[str, Any]]) -> Picture:
    """The latest eviction's ranked candidates, bars from the frame's axis (zero unless the scores are close), the
    victim black; ``evictions`` as in frame tails."""
    fig = Picture(figsize=(10, 4), layout="constrained")
    draw_evictions(fig.add_subplot(), evictions)
    legend(fig, ["eviction"])
    return fig


def plot_fragmentation(x: FrameLike, series: Sequence[Sequence[float]] = ()) -> Picture:
    """Memory map, gauges and (given ``series`` rows of the four gauges, in ``GAUGES``' order) time series."""
    fig = Picture(figsize=(13, 5), layout="constrained")
    gs = fig.add_gridspec(2, 2, width_ratios=(1.5, 1))
    draw_fragmentation(fig.add_subplot(gs[:, 0]), fig.add_subplot(gs[0, 1]), fig.add_subplot(gs[1, 1]),
                       as_frame(x), series)
    legend(fig, ["fragmentation"])
    return fig


def plot_dashboard(x: FrameLike, series: Sequence[Sequence[float]] = (),
                   evictions: Sequence[dict[str, Any]] = (),
                   panels: Sequence[str] = ("pool", "fragmentation", "eviction")) -> Picture:
    """The dashboard's ``panels`` (``pool``, ``fragmentation``, ``eviction``) of one frame, side by side."""
    unknown = set(panels) - {"pool", "fragmentation", "eviction"}
    if unknown or not panels:
        raise ConfigError(f"panels must name some of pool, fragmentation, eviction, got {list(panels)!r}")
    f = as_frame(x)
    fig = Picture(figsize=(5 * len(panels) + 3, 5.5), layout="constrained")
    gs = fig.add_gridspec(2, 2 * len(panels))
    for k, name in enumerate(panels):
        if name == "pool":
            draw_pool(fig.add_subplot(gs[:, 2 * k:2 * k + 2]), f)
        elif name == "eviction":
            draw_evictions(fig.add_subplot(gs[:, 2 * k:2 * k + 2]), list(evictions) or f.evictions)
        else:
            draw_fragmentation(fig.add_subplot(gs[:, 2 * k]), fig.add_subplot(gs[0, 2 * k + 1]),
                               fig.add_subplot(gs[1, 2 * k + 1]), f, series)
    legend(fig, panels)
    return fig


def figure_png(fig: Figure, dpi: int = 80) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
