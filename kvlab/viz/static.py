"""Static figures with matplotlib: the same views as the widgets, for print, for notebooks exported without widget
state, and as the PNG in every widget's display bundle. Colours and words come from :mod:`kvlab.viz.palette`, as
the widgets' do, and the grid layout matches ``widgets/*.js``.

Every function accepts a pool, a frame's bytes or a :class:`~kvlab.viz.frames.Frame`, and returns a
:class:`Picture`: a matplotlib figure built without pyplot (no backend is touched, nothing is shown twice) that
displays as an image wherever it is the value of a cell, even in a fresh kernel where pyplot was never imported.

**A still shows states, not events.** A frame's flash (what happened to a block in the frame's interval) is for
the animation; a still draws each block in its state's colour only, cached distinct from referenced as the
frame's state byte says, and its legend lists exactly the colours it draws.

**Readable as shown.** A :class:`Picture` is saved at :data:`PNG_DPI`; one wider than a notebook's output
column (:data:`DISPLAY_WIDTH_IN`) is shown scaled down to fit, so when it is drawn every text is scaled up by the
same factor and none is below :data:`MIN_PT` points as the reader sees it.
"""
from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.text import Text

from kvlab.core.errors import ConfigError
from kvlab.core.pool import BlockPool
from kvlab.viz.fonts import use_cjk_font
from kvlab.viz.frames import CACHED, Frame, decode_frame, frame_of, free_runs
from kvlab.viz.palette import (CACHED_GAUGE, CANDIDATE_RGB, GAUGES, NO_EVICTION, OTHER_WORDS, REASON_WORDS, RUN_RGB,
                               STATE_KEYS, STATE_RGB, STATE_WORDS, VICTIM_RGB, fmt_score, rgb01, score_words,
                               shown_score)


MIN_PT = 9.0  # the smallest text a reader sees, in points
PNG_DPI = 100  # every still's PNG (a point is then at least a CSS pixel's 96 per inch: never drawn smaller)
DISPLAY_WIDTH_IN = 10.0  # a notebook's output column (JupyterLab, the course site) at PNG_DPI: ~1000 px


class Picture(Figure):
    """A matplotlib figure that shows itself as a PNG (``_repr_png_``): Jupyter shows a bare ``Figure`` as its
    text form (``<Figure size 900x450 with 3 Axes>``) unless pyplot's inline backend happens to be loaded.

    Drawn readable (:func:`readable`): a figure wider than :data:`DISPLAY_WIDTH_IN` is shown shrunk to the
    column, so its texts grow by that factor when it is first drawn, and no text is drawn below the floor.
    Chinese labels draw in a CJK face (:func:`~kvlab.viz.fonts.use_cjk_font`)."""

    _scaled = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        use_cjk_font()  # a text takes the font list when it is made: set it before the figure makes any
        super().__init__(*args, **kwargs)

    def draw(self, renderer: Any) -> None:
        readable(self, scale=not self._scaled)
        self._scaled = True  # scaled once: a second draw (savefig after display) keeps the sizes
        super().draw(renderer)

    def _repr_png_(self) -> bytes:
        return figure_png(self)


def shrink(fig: Figure) -> float:
    """How much ``fig`` is shrunk to fit a notebook's column (1 when it fits)."""
    return max(1.0, fig.get_figwidth() / DISPLAY_WIDTH_IN)


def readable(fig: Figure, *, scale: bool = True) -> Figure:
    """Make every text of ``fig`` at least :data:`MIN_PT` points as displayed: with ``scale``, every text (tick
    labels too) grows by :func:`shrink`, so the figure shown shrunk reads as designed; then none stays below
    ``MIN_PT`` times it. Returns ``fig``."""
    k = shrink(fig)
    floor = MIN_PT * k
    grow = k if scale else 1.0
    ticks: set[int] = set()  # tick labels are sized through tick_params (ticks made at draw time follow it)
    sizes: list[tuple[Any, float, float]] = []
    for ax in fig.axes:
        made = [axis.get_major_ticks(1) + axis.get_minor_ticks() for axis in (ax.xaxis, ax.yaxis)]  # >= 1 each
        ticks.update(id(t) for axis in made for tick in axis for t in (tick.label1, tick.label2))
        x, y = (max(float(axis[0].label1.get_fontsize()) * grow, floor) for axis in made)
        sizes.append((ax, x, y))
    for t in fig.findobj(Text):
        if id(t) not in ticks:
            t.set_fontsize(max(float(t.get_fontsize()) * grow, floor))
    for ax, x, y in sizes:
        ax.tick_params(axis="x", which="both", labelsize=x)
        ax.tick_params(axis="y", which="both", labelsize=y)
    return fig


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


def _ramp(refs: np.ndarray) -> np.ndarray:
    """RGB (float) of ALLOCATED blocks with ``refs`` references: one reference light, eight or more darkest."""
    t = (np.clip(refs.astype(np.int64), 1, 8) - 1)[:, None] / 7
    return np.array(STATE_RGB["ALLOC1"]) + (np.array(STATE_RGB["ALLOC8"]) - STATE_RGB["ALLOC1"]) * t


def pool_colors(f: Frame) -> np.ndarray:
    """RGB uint8 ``[n, 3]`` per base block, its state's colour: the frame's flashes are never drawn (a still shows
    what each block is, not what just happened to it)."""
    table = np.array([STATE_RGB[k] for k in STATE_KEYS], np.float64)
    out = table[f.state]
    alloc = f.state == 2
    out[alloc] = _ramp(f.refcount[alloc])
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


def _swatch(rgb: Any, words: str) -> Patch:
    r, g, b = (int(round(float(c))) for c in rgb)
    return Patch(facecolor=rgb01((r, g, b)), edgecolor="0.6", label=words)


def state_handles(f: Frame, *, free: bool = True) -> list[Patch]:
    """Legend entries for the state colours ``f``'s grid draws, and only those (``free``: whether FREE cells
    are drawn grey; the memory map paints the largest free run yellow instead)."""
    counts = np.bincount(f.state, minlength=5)
    refs = f.refcount[f.state == 2].astype(np.int64)
    top = int(refs.max()) if refs.size else 0
    out = [_swatch(STATE_RGB["FREE"], STATE_WORDS["FREE"])] if free and counts[0] else []
    if counts[1]:
        out.append(_swatch(STATE_RGB["PENDING"], STATE_WORDS["PENDING"]))
    if (refs <= 1).any():
        out.append(_swatch(STATE_RGB["ALLOC1"], STATE_WORDS["ALLOC1"]))
    if top >= 2:  # the swatch is the darkest shade drawn, and the words say which counts the shades span
        words = STATE_WORDS["ALLOC8"] if top >= 8 else "共享，2 个引用 (shared)" if top == 2 else \
            f"共享，2 到 {top} 个引用，越深越多 (shared)"
        out.append(_swatch(np.round(_ramp(np.array([top])))[0], words))
    if counts[3]:
        out.append(_swatch(STATE_RGB["EVICTING"], STATE_WORDS["EVICTING"]))
    if counts[CACHED]:
        out.append(_swatch(STATE_RGB["CACHED"], STATE_WORDS["CACHED"]))
    return out


def legend(fig: Figure, panels: Sequence[str], f: Frame | None = None,
           evictions: Sequence[dict[str, Any]] | None = None, *, below: bool = False) -> None:
    """One legend at the figure's right, in the widgets' words: given the frame ``f`` (and the ``evictions`` an
    eviction panel draws), an entry for each colour the ``panels`` draw and no other; without either, every
    colour they can draw. At the figure's right, or ``below`` it (in two columns) for a figure as wide as the
    column."""
    if f is None and evictions is None:
        handles = [_swatch(STATE_RGB[k], STATE_WORDS[k]) for k in STATE_RGB]
        if "fragmentation" in panels:
            handles.append(_swatch(RUN_RGB, OTHER_WORDS["RUN"]))
        if "pool" not in panels and "fragmentation" not in panels:
            handles = []
        if "eviction" in panels:
            handles += [Patch(color=rgb01(VICTIM_RGB), label=OTHER_WORDS["VICTIM"]),
                        Patch(color=rgb01(CANDIDATE_RGB), label=OTHER_WORDS["CANDIDATE"])]
    else:
        handles = []
        if f is not None and ("pool" in panels or "fragmentation" in panels):
            run = _largest(f)
            grey = "pool" in panels or int(np.count_nonzero(f.state == 0)) > run  # free cells outside the run
            handles = state_handles(f, free=grey)
            if "fragmentation" in panels and run:
                handles.append(_swatch(RUN_RGB, OTHER_WORDS["RUN"]))
        if "eviction" in panels and evictions:
            e = evictions[-1]  # the one the panel draws
            handles.append(Patch(color=rgb01(VICTIM_RGB), label=OTHER_WORDS["VICTIM"]))
            if any(c[0] != e["victim"] for c in e["candidates"]):
                handles.append(Patch(color=rgb01(CANDIDATE_RGB), label=OTHER_WORDS["CANDIDATE"]))
    if handles:
        fig.legend(handles=handles, loc="outside lower center" if below else "outside right upper",
                   ncols=2 if below else 1, fontsize=MIN_PT, frameon=False)


HELD, CACHED_NAME = GAUGES[0][0], CACHED_GAUGE[0]  # GLOSSARY.md's names, as the stills print them


def held_words(f: Frame) -> str:
    """What the grid's held blocks are, in GLOSSARY.md's names: blocks held (cached blocks included, and said to
    be) and how they split, in base blocks."""
    c = np.bincount(f.state, minlength=5)
    parts = [f"{c[2]} 被引用 referenced", f"{c[CACHED]} {CACHED_NAME}"] + \
        [f"{c[k]} {w}" for k, w in ((1, "待定 pending"), (3, "淘汰中 evicting")) if c[k]]
    return f"{HELD} {100 * f.blocks_held:.1f}% = " + " + ".join(parts)


def draw_pool(ax: Any, f: Frame) -> None:
    free = int(np.count_nonzero(f.state == 0))
    held, split = held_words(f).split(" = ")
    lines = [f"{f.num_blocks} 个块 (blocks)，{f.when}", f"{free} 空闲 (free)，{held} ="]  # short: a grid may be narrow
    _draw_grid(ax, pool_colors(f), "\n".join(lines + textwrap.wrap(split, 40, break_on_hyphens=False)))


def _when(e: dict[str, Any]) -> str:
    return f"第 {e['at']} 步 (step)" if e.get("at") is not None else f"池时钟 {e['step']:g} (pool tick)"


def draw_evictions(ax: Any, evictions: Sequence[dict[str, Any]]) -> None:
    """The latest eviction's candidates, bars of the quantity the policy ranks by, from the frame's ``axis``
    (:func:`~kvlab.viz.palette.bar_axis`: zero, or below the smallest score when the scores are close)."""
    if not evictions:
        ax.set_title(NO_EVICTION, fontsize=10)
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
    ax.set_yticks(range(len(ids)), [f"{'淘汰' if b == e['victim'] else f'#{r + 1}'} · 块 {b} · {fmt_score(v)}"
                                    for r, (b, v) in enumerate(zip(ids, shown))], fontsize=MIN_PT)
    ax.invert_yaxis()
    ax.set_xlim(base, base + (top - base) * 1.05)
    ax.set_xlabel(f"{words['what']}；{words['order']}" + (f"（坐标从 {fmt_score(base)} 起）" if base else ""),
                  fontsize=MIN_PT)
    ax.tick_params(labelsize=MIN_PT)
    ax.set_title(f"{_when(e)}：{e['policy'].upper()} 淘汰了块 {e['victim']} (evicted)\n原因："
                 f"{REASON_WORDS.get(e['reason'], e['reason'])}",
                 fontsize=10)


def gauge_values(f: Frame) -> tuple[float, ...]:
    """The frame's gauges, in :data:`~kvlab.viz.palette.GAUGES`' order (a row of a view's series)."""
    return tuple(getattr(f, key) for _, key, _, _ in GAUGES)


def gauge_rows(f: Frame) -> list[tuple[str, float, tuple[float, float, float]]]:
    """The still's gauge bars: (name, value, colour), the :data:`~kvlab.viz.palette.GAUGES` with the cached
    share of the pool right under blocks held, which counts cached blocks too (a pool of cached blocks reads
    100% held and can still serve every request)."""
    rows = [(name, float(v), rgb01(c)) for (name, _, c, _), v in zip(GAUGES, gauge_values(f))]
    cached = float(np.count_nonzero(f.state == CACHED)) / f.num_blocks if f.num_blocks else 0.0
    rows.insert(1, (CACHED_NAME, cached, rgb01(CACHED_GAUGE[2])))
    return rows


def draw_fragmentation(map_ax: Any, gauge_ax: Any, series_ax: Any, f: Frame,
                       series: Sequence[Sequence[float]] = ()) -> None:
    _draw_grid(map_ax, map_colors(f), f"内存布局 (memory map)，{f.when}\n最长空闲段 (largest free run) "
                                      f"{int(f.num_blocks and _largest(f))} 块")
    rows = gauge_rows(f)
    gauge_ax.barh(range(len(rows)), [v for _, v, _ in rows], color=[c for _, _, c in rows])
    gauge_ax.set_yticks(range(len(rows)), [f"{name} {100 * v:.1f}%" for name, v, _ in rows], fontsize=MIN_PT)
    gauge_ax.set_xlim(0, 1)
    gauge_ax.tick_params(labelsize=MIN_PT)
    gauge_ax.invert_yaxis()
    data = np.array(list(series) or [gauge_values(f)], np.float64)
    one = len(data) == 1  # a line through one point draws nothing: show the point
    for j, (name, _, c, dash) in enumerate(GAUGES):
        series_ax.plot(data[:, j], color=rgb01(c), label=name, lw=1.5, dashes=dash or (None, None),
                       marker="o" if one else None)
    series_ax.set_ylim(0, 1)
    if one:
        series_ax.set_xticks([0])  # one picture: no fractional picture numbers
    series_ax.set_xlabel("画面（目前一幅：静态图）(picture)" if one else "画面 (picture)", fontsize=MIN_PT)
    series_ax.tick_params(labelsize=MIN_PT)
    series_ax.legend(fontsize=MIN_PT, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncols=2,
                     frameon=False)  # under the axes: over the lines it hid them, beside them it took the map's room


def _largest(f: Frame) -> int:
    _, lens = free_runs(f.state)
    return int(lens.max()) if lens.size else 0


def plot_pool(x: FrameLike) -> Picture:
    """The pool grid of a pool or frame, with the legend of its colours."""
    f = as_frame(x)
    fig = Picture(figsize=(9, 5), layout="constrained")
    draw_pool(fig.add_subplot(), f)
    legend(fig, ["pool"], f)
    return fig


def plot_evictions(evictions: Sequence[dict[str, Any]]) -> Picture:
    """The latest eviction's ranked candidates, bars from the frame's axis (zero unless the scores are close), the
    victim black; ``evictions`` as in frame tails."""
    fig = Picture(figsize=(10, 4), layout="constrained")
    draw_evictions(fig.add_subplot(), evictions)
    legend(fig, ["eviction"], evictions=evictions)
    return fig


def _fragmentation_panel(fig: Any, f: Frame, series: Sequence[Sequence[float]]) -> None:
    """The memory map at the left, the gauges above their time series at the right, in ``fig`` (a figure or a
    subfigure)."""
    gs = fig.add_gridspec(2, 2, width_ratios=(1.3, 1))
    draw_fragmentation(fig.add_subplot(gs[:, 0]), fig.add_subplot(gs[0, 1]), fig.add_subplot(gs[1, 1]), f, series)


def plot_fragmentation(x: FrameLike, series: Sequence[Sequence[float]] = ()) -> Picture:
    """Memory map, gauges and (given ``series`` rows of the four gauges, in ``GAUGES``' order) time series."""
    f = as_frame(x)
    fig = Picture(figsize=(DISPLAY_WIDTH_IN, 6.5), layout="constrained")
    _fragmentation_panel(fig, f, series)
    legend(fig, ["fragmentation"], f, below=True)
    return fig


def plot_dashboard(x: FrameLike, series: Sequence[Sequence[float]] = (),
                   evictions: Sequence[dict[str, Any]] = (),
                   panels: Sequence[str] = ("pool", "fragmentation", "eviction")) -> Picture:
    """The dashboard's ``panels`` (``pool``, ``fragmentation``, ``eviction``) of one frame, one above the other
    (side by side they made a figure too wide to show at a readable size)."""
    unknown = set(panels) - {"pool", "fragmentation", "eviction"}
    if unknown or not panels:
        raise ConfigError(f"panels must name some of pool, fragmentation, eviction, got {list(panels)!r}")
    f = as_frame(x)
    heights = [PANEL_HEIGHT_IN[name] for name in panels]
    fig = Picture(figsize=(DISPLAY_WIDTH_IN, sum(heights) + 0.8), layout="constrained")
    subs = fig.subfigures(len(panels), 1, height_ratios=heights, squeeze=False)[:, 0]
    for sub, name in zip(subs, panels):
        if name == "pool":
            draw_pool(sub.add_subplot(), f)
        elif name == "eviction":
            draw_evictions(sub.add_subplot(), list(evictions) or f.evictions)
        else:
            _fragmentation_panel(sub, f, series)
    legend(fig, panels, f, list(evictions) or f.evictions, below=True)
    return fig


PANEL_HEIGHT_IN = {"pool": 4.5, "fragmentation": 5.5, "eviction": 3.5}  # a dashboard's rows


def figure_png(fig: Figure, dpi: int = PNG_DPI) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
