"""Figures that do not mislead: what a student saw in the stills, the chapters' figures and the exercise marks.

A still draws states, never the last frame's flashes, and its legend lists exactly the colours it draws; the
pool's title and gauges say what they count in GLOSSARY.md's names (blocks held counts cached blocks, and
cached (reusable) is printed beside it) with the values ``memory_usage`` prints; every text of every kvlab figure
is at least 9 pt as displayed; the policy race's y axis starts at zero and holds every value; the chapters' tables
display as tables; 2.2.7's two pools differ where the receiving side's own free list puts the blocks; the
exercises' marks are glyphs the README's fonts draw.
"""
from __future__ import annotations

import re
import struct
from pathlib import Path

import nbformat
import numpy as np
import pytest
from matplotlib.image import AxesImage
from matplotlib.text import Text

import kvlab
from kvlab import BlockPool
from kvlab.exercises import framework as fw
from kvlab.memory.fragmentation import memory_usage
from kvlab.viz import FrameBuilder, RandomWorkload, decode_frame, frame_of, plot_dashboard, plot_evictions
from kvlab.viz import plot_fragmentation, plot_pool, record
from kvlab.viz import palette
from kvlab.viz.static import figure_png
from kvlab.workloads.race import PolicyRace

REPO = Path(__file__).resolve().parent.parent
CHAPTERS = REPO / "chapters"
GLOSSARY = (CHAPTERS / "GLOSSARY.md").read_text(encoding="utf-8")


def mixed_pool() -> BlockPool:
    """64 blocks in every state: referenced (1 and 3 references), cached, pending, evicting, free."""
    p = BlockPool(64, with_storage=False)
    a = p.allocate(20)
    p.incref([a[0], a[0], a[1]])
    p.mark_reusable(a[10:16])
    p.free(a[10:16])  # six cached
    p.reserve(4)  # pending
    p.begin_eviction(a[16:18])  # evicting
    return p


def grid_colors(fig) -> set[tuple[int, int, int]]:
    """Every colour the figure's block grids (its images) draw."""
    out: set[tuple[int, int, int]] = set()
    for im in fig.findobj(AxesImage):
        out |= {tuple(int(c) for c in px) for px in np.asarray(im.get_array()).reshape(-1, 3)}
    return out


# The shades of a block with 2..7 references: between "allocated, 1 reference" and the darkest shade listed.
SHADES = {tuple(int(round(a + (b - a) * (r - 1) / 7)) for a, b in zip(palette.STATE_RGB["ALLOC1"],
                                                                       palette.STATE_RGB["ALLOC8"]))
          for r in range(2, 8)}


def legend_colors(fig) -> set[tuple[int, int, int]]:
    (leg,) = fig.legends
    return {tuple(int(round(255 * c)) for c in h.get_facecolor()[:3]) for h in leg.legend_handles}


# ---------------------------------------------------------------------------------------------- a. states
def test_a_still_draws_each_blocks_state_not_the_last_frames_flash():
    """2.2.5's reserved blocks flashed "just allocated" in the run's last frame; the still must draw them as
    pending, as a frame without flashes of the same pool does."""
    p = mixed_pool()
    with FrameBuilder(p) as b:
        b.frame()
        more = p.allocate(3)
        p.free(more[:1])
        p.reserve(2)
        p.evict()
        flashed = b.frame()
    plain = frame_of(p)
    assert flashed.flash.any() and not plain.flash.any()
    assert (flashed.state == plain.state).all()
    drawn = [np.asarray(plot_pool(f).axes[0].images[0].get_array()) for f in (flashed, plain)]
    assert np.array_equal(drawn[0], drawn[1])
    flash_colors = {c for c in palette.FLASH_RGB if c is not None} - {palette.GAP_RGB}
    assert not grid_colors(plot_pool(flashed)) & flash_colors
    pending = np.asarray(drawn[0]).reshape(-1, 3)[flashed.state == 1]
    assert {tuple(px) for px in pending.tolist()} == {palette.STATE_RGB["PENDING"]}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_legend_lists_exactly_the_colours_the_grids_draw(seed):
    """The legend listed all six state colours whatever was drawn, so orange pending beside a listed vermillion
    "evicting" read as evicting; now each entry is a colour on the grid and each grid colour has an entry."""
    from kvlab.viz.chat import plot_chat

    p = BlockPool(64, block_sizes=[16, 32, 64], with_storage=False, seed=seed)
    rec = record(p, RandomWorkload(p, seed=seed, steps=120), 120, every=30)
    frames = [decode_frame(d) for d in rec] + [frame_of(mixed_pool()), frame_of(BlockPool(16, with_storage=False))]
    for f in frames:
        for fig in (plot_pool(f), plot_fragmentation(f), plot_dashboard(f, panels=["pool", "fragmentation"]),
                    plot_chat(f)):
            listed, drawn = legend_colors(fig), grid_colors(fig)
            assert listed <= drawn, f.when  # nothing listed that is not drawn
            assert drawn - listed <= SHADES, f.when  # and only the shades between "1 reference" and the darkest
    words = [t.get_text() for t in plot_pool(frame_of(mixed_pool())).legends[0].get_texts()]
    assert words == [palette.STATE_WORDS[k] for k in ("FREE", "PENDING", "ALLOC1")] + \
        ["共享，2 到 3 个引用，越深越多 (shared)"] + [palette.STATE_WORDS[k] for k in ("EVICTING", "CACHED")]


def test_the_eviction_legend_shows_runners_up_only_when_there_are_some():
    e = {"step": 5, "at": 3, "victim": 1, "policy": "lru", "reason": "allocation pressure",
         "candidates": [[1, 1109.0]], "axis": 0.0}
    assert [t.get_text() for t in plot_evictions([e]).legends[0].get_texts()] == [palette.OTHER_WORDS["VICTIM"]]
    e["candidates"].append([2, 1113.0])
    assert len(plot_evictions([e]).legends[0].get_texts()) == 2
    assert not plot_evictions([]).legends


# ---------------------------------------------------------------------------------------------- b. what is counted
def _pool_title(fig) -> str:
    return fig.axes[0].get_title()


def test_the_pool_title_and_the_gauges_print_what_memory_usage_prints_in_glossary_names():
    """A pool full of cached blocks read "100%" with no word that cached blocks count: the still now prints
    blocks held with its split (cached (reusable) named), and the gauges put cached (reusable) under blocks held;
    each name is GLOSSARY.md's and each value is the one ``memory_usage`` prints."""
    p = mixed_pool()
    usage = memory_usage(p)
    printed = {palette.GAUGES[0][0]: 100 * usage["used"] / usage["total"],
               palette.CACHED_GAUGE[0]: 100 * usage["cached"] / usage["total"]}
    title = _pool_title(plot_pool(p)).replace("\n", " ")
    m = re.search(r"占用块 blocks held (\d+\.\d)% = (\d+) 被引用 referenced \+ (\d+) 可复用缓存块 cached \(reusable\) "
                  r"\+ (\d+) 待定 pending \+ (\d+) 淘汰中 evicting", title)
    assert m, title
    counts = p.status_counts()
    assert float(m[1]) == pytest.approx(printed[palette.GAUGES[0][0]], abs=0.051)
    assert int(m[3]) == p.num_cached_blocks == usage["cached"] // p.bytes_per_block
    assert int(m[2]) + int(m[3]) == counts["ALLOCATED"]
    assert (int(m[4]), int(m[5])) == (counts["PENDING"], counts["EVICTING"])
    assert f"{counts['FREE']} 空闲 (free)" in title
    for fig in (plot_fragmentation(p), plot_dashboard(p, panels=["fragmentation"])):
        labels = [t.get_text() for t in fig.axes[1].get_yticklabels()]
        shown = {m[1]: float(m[2]) for m in (re.fullmatch(r"(.+) (\d+\.\d)%", s) for s in labels)}
        assert list(shown)[:2] == ["占用块 blocks held", "可复用缓存块 cached (reusable)"]
        for name, value in printed.items():
            assert f"**{name}**" in GLOSSARY, name
            assert shown[name] == pytest.approx(value, abs=0.051), name


def test_an_engine_pool_of_cached_blocks_says_so():
    """2.2.6's engine at the end of its run: every block cached, none referenced. The still says 100% held *and*
    that all of it is cached (reusable), so no one reads it as a full pool."""
    engine = kvlab.Engine(kvlab.make_workload("chat", 30, seed=5, rate=100.0, tenants=4),
                          kvlab.EngineConfig(num_blocks=64))
    engine.run()
    pool = engine.memory.pool
    usage = memory_usage(pool)
    title = _pool_title(plot_pool(pool)).replace("\n", " ")
    held = usage["used"] // pool.bytes_per_block
    assert usage["cached"] == usage["used"] > 0  # nothing referenced once every request finished
    assert f"blocks held {100 * held / pool.num_blocks:.1f}% = 0 被引用 referenced + {held} " \
        "可复用缓存块 cached (reusable)" in title


def test_the_glossary_tells_utilisation_from_blocks_held():
    row = next(line for line in GLOSSARY.splitlines() if line.startswith("| **利用率 utilisation**"))
    assert "Not a gauge of the views" in row and "blocks held" in row
    assert "| **可复用缓存块 cached (reusable)** |" in GLOSSARY
    assert "cached (reusable)" in palette.GAUGE_WORDS["blocks_held"]


# ---------------------------------------------------------------------------------------------- c. text sizes
COLUMN_PX = 1000  # a notebook's output column (JupyterLab, the course site): a wider PNG is shown shrunk to it


def png_width(png: bytes) -> int:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", png[16:20])[0]


def displayed_pt(fig, size: float, png: bytes) -> float:
    """A text of ``size`` points in ``fig`` as the reader sees it: drawn at the PNG's dpi, the PNG shown one
    pixel per CSS pixel (96 per inch) and shrunk to the column if wider."""
    px = png_width(png)
    dpi = px / fig.get_figwidth()
    return size * dpi / 96 * min(1.0, COLUMN_PX / px)


def block_table_figure():
    """A still of block tables with a prefix hit, sharing and a copy on write."""
    from kvlab.viz import BlockTables, plot_block_table

    pool = BlockPool(16, spec=kvlab.KVSpec(block_size=4), with_storage=False)
    mgr = kvlab.SequenceManager(pool, prefix_cache=True)
    a = mgr.create(list(range(10)))
    a.append(list(range(10)))
    mgr.cache_full_blocks(a)
    b = mgr.create(list(range(10)))
    b.append(list(range(b.num_tokens, 10)))
    b.fork().append([99])
    with BlockTables(mgr) as tables:
        return plot_block_table(frame_of(pool, **tables.tail()))


def kvlab_figures():
    from kvlab.viz.chat import plot_chat

    p = BlockPool(128, block_sizes=[16, 32, 64], with_storage=False, seed=1)
    rec = record(p, RandomWorkload(p, seed=3, steps=200), 200, every=20)
    f = decode_frame(rec[len(rec) - 1])
    evictions = [e for d in rec for e in decode_frame(d).evictions]
    assert evictions
    race = PolicyRace("chat", 300, 16, (150, 200, 400), {"lru": (0.41, 0.44, 0.47), "opt": (0.45, 0.47, 0.49)},
                      0.5, {"lru": (0, 0, 0), "opt": (0, 0, 0)})
    sweep = kvlab.sweep(kvlab.make_workload("chat", 40, seed=0), [16, 64, 256], attention=False, progress=False)
    return {"pool": plot_pool(f), "evictions": plot_evictions(evictions), "no evictions": plot_evictions([]),
            "fragmentation": plot_fragmentation(f, [(0.5, 0.1, 0.2, 0.3)] * 5),
            "dashboard": plot_dashboard(f, evictions=evictions),
            "dashboard pool": plot_dashboard(f, panels=["pool"]), "race": race.plot(),
            "sweep": kvlab.plot_sweep(sweep, "balanced"), "chat": plot_chat(f),
            "block tables": block_table_figure()}


def test_every_text_of_every_kvlab_figure_is_at_least_9_points_as_displayed():
    """Every Text artist (titles, labels, ticks, legends, the chat's transcript) of each kvlab figure, in both of
    its PNGs (a view's display bundle and the figure as a cell's value), after drawing: at least 9 pt as seen."""
    for name, fig in kvlab_figures().items():
        for png in (figure_png(fig), fig._repr_png_()):
            small = [(t.get_text()[:40], round(displayed_pt(fig, t.get_fontsize(), png), 2))
                     for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()
                     and displayed_pt(fig, t.get_fontsize(), png) < 9]
            assert not small, (name, small)


def english_first(text: str) -> bool:
    """Whether ``text`` has two English words in a row before any Chinese (a lone word such as a policy's name,
    LRU, or token, is the field's word and may come first)."""
    words = re.search(r"[A-Za-z]{2,}[ -][A-Za-z]{2,}", text)
    han = re.search(r"[\u4e00-\u9fff]", text)
    return words is not None and (han is None or han.start() > words.start())


def test_every_text_of_every_kvlab_figure_is_chinese_first():
    """Titles, axis labels, legends and tick labels of each kvlab figure read Chinese first, the English after it
    (as GLOSSARY.md names things): a student reads the figure in the language of the chapters."""
    for name, fig in kvlab_figures().items():
        figure_png(fig)  # drawn: ticks and legends exist
        english = [t.get_text() for t in fig.findobj(Text) if t.get_visible() and english_first(t.get_text())]
        assert not english, (name, english)
    assert english_first("blocks held 3%") and not english_first("占用块 blocks held 3%")
    assert not english_first("LRU 淘汰了块 7") and not english_first("lru")


ALL_CHAPTERS = sorted(p.relative_to(CHAPTERS).as_posix() for p in CHAPTERS.rglob("*.ipynb"))


@pytest.mark.parametrize("name", ALL_CHAPTERS)
def test_the_chapters_own_figures_ask_for_readable_text(name):
    """The chapters' matplotlib cells (shown by the inline backend at 100 dpi, never shrunk when at most 10 in
    wide) ask for no text under 9 pt and no figure wider than the column."""
    for i, cell in enumerate(nbformat.read(CHAPTERS / name, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        for size in re.findall(r"(?:fontsize|labelsize)=(\d+(?:\.\d+)?)", cell.source):
            assert float(size) >= 9, f"{name} cell {i}: fontsize {size}"
        for width in re.findall(r"figsize=\((\d+(?:\.\d+)?),", cell.source):
            assert float(width) <= 10, f"{name} cell {i}: figure {width} in wide"


# ---------------------------------------------------------------------------------------------- d. race axis
def test_the_race_figures_y_axis_runs_from_zero_and_holds_every_value():
    """Hit rates of 41-49% drew an axis from ~40%: small gaps between policies looked large."""
    race = PolicyRace("chat", 300, 16, (150, 200, 400), {"lru": (0.41, 0.44, 0.47), "fifo": (0.40, 0.42, 0.46),
                                                         "opt": (0.45, 0.47, 0.49)},
                      0.52, {p: (0, 0, 0) for p in ("lru", "fifo", "opt")})
    fig = race.plot()
    figure_png(fig)
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    values = [y for line in ax.get_lines() for y in np.atleast_1d(line.get_ydata())]
    assert lo == 0 and hi > max(values) and min(values) >= lo
    assert max(values) == pytest.approx(52.0) and hi <= 100


def test_a_race_with_no_hits_still_draws_an_axis():
    race = PolicyRace("w", 1, 16, (8,), {"lru": (0.0,)}, 0.0, {"lru": (0,)})
    assert race.plot().axes[0].get_ylim() == (0.0, 1.0)


# ---------------------------------------------------------------------------------------------- e. tables
TABLE_CELLS = {"2_2_1_block_size.ipynb": ".to_markdown(", "2_2_2_block_management.ipynb": "race.to_markdown("}


@pytest.mark.parametrize("name", TABLE_CELLS)
def test_no_chapter_prints_a_markdown_table(name):
    cells = [c.source for c in nbformat.read(CHAPTERS / name, as_version=4).cells if c.cell_type == "code"]
    assert any("Markdown(" in s and TABLE_CELLS[name] in s for s in cells)
    assert not any(re.search(r"print\([^\n]*\.to_markdown\(", s) for s in cells), name


def test_a_displayed_markdown_table_is_a_table_on_the_course_site():
    """What the chapters now display (``Markdown(result.to_markdown())``) becomes an HTML table in kvlab's site
    template (nbconvert), one row per block size."""
    from nbconvert import HTMLExporter
    from kvlab.app.render import TEMPLATES

    res = kvlab.sweep(kvlab.make_workload("chat", 40, seed=0), [16, 64, 256], attention=False, progress=False)
    shown = nbformat.v4.new_output("display_data", data={"text/markdown": res.to_markdown(),
                                                         "text/plain": "<IPython.core.display.Markdown object>"})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("display(Markdown(res.to_markdown()))",
                                                                   outputs=[shown])])
    body, _ = HTMLExporter(template_name="kvlab_site", extra_template_basedirs=[str(TEMPLATES)]).from_notebook_node(
        nb, resources={"kvlab_static": "_kvlab", "kvlab_fonts": "sans-serif"})
    table = re.search(r"<table>(.*?)</table>", body, re.S)
    assert table and len(re.findall(r"<tr>", table[1])) == 1 + len(res.rows)
    assert "|---:|" not in body


@pytest.mark.notebooks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", TABLE_CELLS)
def test_the_executed_chapter_displays_its_table_as_markdown(name, executed):
    nb, _ = executed(CHAPTERS / name)
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("|---:|" in o.get("data", {}).get("text/markdown", "") for o in outs)
    assert not any("|---:|" in o.get("text", "") for o in outs if o.output_type == "stream")


# ---------------------------------------------------------------------------------------------- f. two pools
def _disagg_states(busy_tokens: int) -> list[np.ndarray]:
    import kvlab.distributed as kd

    cfg = kvlab.TinyConfig()
    managers = (kd.make_manager(cfg, 16, 128), kd.make_manager(cfg, 16, 128))
    if busy_tokens:
        managers[1].append(managers[1].create(), busy_tokens)
    kd.run_disagg(kd.demo_batches(4, 100, 64), 4, threads=True, managers=managers, pace=0.0, timeout=30)
    for m in managers:
        m.check_invariants()
    return [frame_of(m.pool).state for m in managers]


def test_the_receiving_pool_places_blocks_by_its_own_free_list():
    """Why 2.2.7's two pictures were identical: two empty pools allocate alike. With the decode rank already
    holding another conversation, the same transfer lands on other physical blocks."""
    same = _disagg_states(0)
    assert np.array_equal(same[0], same[1])
    busy = _disagg_states(40)
    assert (busy[0] != busy[1]).sum() > 3  # more than the busy conversation's own 3 blocks


@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_chapter_2_2_7_shows_two_different_pools(executed):
    nb, _ = executed(CHAPTERS / "2_2_7_beyond_one_machine.ipynb")
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    m = re.search(r"physical blocks whose state differs between the two pools: (\d+) of 128", text)
    assert m and int(m[1]) > 3, text[-2000:]


# ---------------------------------------------------------------------------------------------- g. glyphs
def _cmap(path: str) -> set[int]:
    from fontTools.ttLib import TTCollection, TTFont

    font = TTCollection(path).fonts[0] if path.lower().endswith(".ttc") else TTFont(path)
    return set(font.getBestCmap())


def _readme_fonts() -> set[int]:
    """Code points both DejaVu Sans (matplotlib's copy) and Noto Sans CJK SC (fonts-noto-cjk, as fontconfig finds
    it) draw."""
    import subprocess

    import matplotlib

    noto = subprocess.run(["fc-match", "-f", "%{file}", "Noto Sans CJK SC"], capture_output=True, text=True).stdout
    assert "NotoSansCJK" in noto, f"fonts-noto-cjk is not installed (README), fc-match gave {noto!r}"
    return _cmap(str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf")) & _cmap(noto)


def _cjk(ch: str) -> bool:
    o = ord(ch)
    return 0x3000 <= o <= 0x303F or 0x4E00 <= o <= 0x9FFF or 0xFF00 <= o <= 0xFFEF


def test_every_mark_an_exercise_prints_is_in_the_readmes_fonts():
    """❌ ✅ 💡 were boxes in the fonts the README installs (fonts-noto-cjk, and DejaVu Sans beside it); ✗ is
    missing from Noto Sans CJK. Every character the exercises can print (their modules' text, a verdict, a
    summary) is ASCII, CJK, or drawn by both fonts."""
    both = _readme_fonts()
    r_ok = fw.Result("2.2.2-lru", True, "fine", details=("a",))
    r_no = fw.Result("2.2.2-lru", False, "no", "a hint", 1, (f"{fw.RIGHT} a", f"{fw.WRONG} b"))
    texts = [str(r_ok), str(r_no), r_ok._repr_markdown_(), r_no._repr_markdown_()]
    texts += [p.read_text(encoding="utf-8") for p in sorted((REPO / "kvlab" / "exercises").glob("*.py"))]
    bad = {ch for s in texts for ch in s if ord(ch) > 127 and not _cjk(ch) and ord(ch) not in both}
    assert not bad, sorted(f"{c} U+{ord(c):04X}" for c in bad)
    assert fw.RIGHT in str(r_ok) and fw.WRONG in str(r_no) and fw.WRONG in r_no._repr_markdown_()
    assert "提示" in r_no._repr_markdown_()
