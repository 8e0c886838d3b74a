"""The BlockTableView's module in headless Chromium (the harness page, a fake anywidget model), for a pool where a
prompt was computed and cached, the same prompt came again (two prefix-hit blocks), was forked, and the fork's first
append copied its shared tail on write; then the first sequence ended, so the hit blocks are shared by exactly two.
From the DOM: one row per sequence, one line per logical block ending on its physical block's cell, the shared
blocks saying ×2, the copy marked and its line dashed, hits outlined, hover picking out a row; from the screen: each
box in its grid cell's colour; the player pausing a live run; and the exported page replaying offline."""
from __future__ import annotations

import os

import pytest
from PIL import Image

from kvlab import BlockPool, KVSpec, SequenceManager
from kvlab.viz import BlockTables, export_html, frame_of
from kvlab.viz.palette import COPY_RGB, HIT_RGB, STATE_RGB
from test_harness import B64, DOCS_IMG, mix, mount, root_data, screen

pytestmark = pytest.mark.browser
PROMPT = list(range(10))  # with 4-token blocks: two full blocks and two tokens


def sharing_frames() -> list[bytes]:
    """A frame (with block tables) after each step of the story in the module docstring."""
    pool = BlockPool(16, spec=KVSpec(block_size=4), with_storage=False)
    mgr = SequenceManager(pool, prefix_cache=True)
    frames = []
    with BlockTables(mgr) as tables:
        def snap() -> None:
            frames.append(frame_of(pool, **tables.tail()).data)
        snap()
        a = mgr.create(PROMPT)
        a.append(PROMPT)
        mgr.cache_full_blocks(a)
        snap()
        b = mgr.create(PROMPT)  # two blocks from the cache
        b.append(PROMPT[b.num_tokens:])
        snap()
        c = b.fork()
        snap()
        c.append([99])  # c's shared, partly filled tail is copied first
        snap()
        a.free()  # the hit blocks are now held by b and c alone: refcount 2
        snap()
    return frames


LINES_JS = """() => {
  // Each line: its row, position and block, and the block whose grid cell its end lies in (read from the page).
  const p = document.querySelector('.kv-root').kv.panels[0], g = p.layout();
  const c = p.canvas.getBoundingClientRect(), s = document.querySelector('.kv-bt-lines').getBoundingClientRect();
  const cw = c.width / g.cols, ch = c.height / g.rows;
  return [...document.querySelectorAll('line.kv-bt-line')].map(l => {
    const x = s.left + Number(l.getAttribute('x2')) - c.left, y = s.top + Number(l.getAttribute('y2')) - c.top;
    return { row: l.dataset.row, pos: Number(l.dataset.pos), block: Number(l.dataset.block),
             cell: Math.floor(y / ch) * g.cols + Math.floor(x / cw), copy: l.classList.contains('kv-copy'),
             dash: l.getAttribute('stroke-dasharray'), stroke: l.getAttribute('stroke') };
  });
}"""
CHIPS_JS = ("() => [...document.querySelectorAll('.kv-bt .kv-table')].map(r => ({row: r.dataset.row, "
            "label: r.querySelector('.kv-rowlabel').textContent, chips: [...r.querySelectorAll('.kv-chip')].map(c => "
            "({...c.dataset, text: c.querySelector('.kv-pid').textContent, "
            "border: getComputedStyle(c).borderTopColor}))}))")


def rgb(c) -> str:
    return f"rgb({c[0]}, {c[1]}, {c[2]})"


def test_rows_lines_sharing_copies_and_hits_drawn_from_the_frames(harness, tmp_path):
    frames = sharing_frames()
    mount(harness, "blocktable", frames)
    rows = harness.evaluate(CHIPS_JS)
    assert [(r["row"], r["label"]) for r in rows] == [("1", "序列 1 seq:"), ("2", "序列 2 seq:")]  # a row per sequence
    (b_tail, c_copy) = (rows[0]["chips"][2]["block"], rows[1]["chips"][2]["block"])
    assert [[c["block"] for c in r["chips"]] for r in rows] == [["0", "1", b_tail], ["0", "1", c_copy]]
    assert b_tail != c_copy
    for r in rows:  # the hits: outlined, shared by the two sequences, saying so
        assert [c["hit"] for c in r["chips"]] == ["1", "1", "0"]
        assert [c["text"] for c in r["chips"][:2]] == ["0 ×2", "1 ×2"] and {c["refs"] for c in r["chips"][:2]} == {"2"}
        assert r["chips"][0]["border"] == rgb(HIT_RGB) and r["chips"][2]["refs"] == "1"
    assert [c["copied"] for c in rows[1]["chips"]] == ["0", "0", "1"] and rows[1]["chips"][2]["border"] == rgb(COPY_RGB)
    assert [c["copied"] for c in rows[0]["chips"]] == ["0", "0", "0"]
    lines = harness.evaluate(LINES_JS)
    assert len(lines) == 6  # one per logical block
    for line in lines:
        want = rows[int(line["row"]) - 1]["chips"][line["pos"]]["block"]
        assert str(line["block"]) == want and line["cell"] == line["block"], line  # ends on its own cell
        assert line["copy"] == (line["row"] == "2" and line["pos"] == 2)
    (copy,) = [x for x in lines if x["copy"]]
    assert copy["dash"] and copy["stroke"] == rgb(COPY_RGB)
    # From the screen: a box has its grid cell's colour (away from its digits), in the grid as in the row.
    shared, private = mix(STATE_RGB["ALLOC1"], STATE_RGB["ALLOC8"], 1 / 7), list(STATE_RGB["ALLOC1"])
    for sel, want in ((".kv-table[data-row='1'] .kv-chip[data-pos='0']", shared),
                      (".kv-table[data-row='2'] .kv-chip[data-pos='2']", private)):
        box = harness.locator(sel).bounding_box()
        assert screen(harness, box["x"] + 4, box["y"] + box["height"] - 4) == want, sel
    grid = harness.locator(".kv-grid").bounding_box()
    g = harness.evaluate("() => document.querySelector('.kv-root').kv.panels[0].layout()")
    cell_px = grid["width"] / g["cols"]

    def corner(b: int) -> list[int]:  # lines come from the left and end at cell centres: none reaches here
        return screen(harness, grid["x"] + (b % g["cols"] + 1) * cell_px - 4,
                      grid["y"] + (b // g["cols"] + 1) * cell_px - 4)
    def near(got: list[int], want: list[int]) -> bool:  # a line's antialiased edge may pass 4 px from a corner
        return max(abs(x - y) for x, y in zip(got, want)) <= 3

    assert near(corner(0), shared) and near(corner(int(c_copy)), private) and near(corner(15), list(STATE_RGB["FREE"]))
    shots = DOCS_IMG if os.environ.get("KVLAB_SCREENSHOTS") == "1" else tmp_path
    harness.locator(".kv-root").screenshot(path=str(shots / "blocktable_view.png"))
    assert Image.open(shots / "blocktable_view.png").size[0] > 400


def test_hover_picks_out_a_row_and_the_player_steps_back_through_the_story(harness):
    frames = sharing_frames()
    mount(harness, "blocktable", frames)
    harness.hover(".kv-table[data-row='2'] .kv-chip[data-pos='0']")
    hot = harness.evaluate("() => [...document.querySelectorAll('line.kv-hot')].map(l => l.dataset.row)")
    assert hot == ["2", "2", "2"] and harness.locator(".kv-bt-lines.kv-hover").count() == 1
    marks = harness.evaluate("() => [...document.querySelectorAll('.kv-bt-mark')].map(r => r.dataset.block)")
    assert sorted(marks) == sorted(c["block"] for c in harness.evaluate(CHIPS_JS)[1]["chips"])
    harness.mouse.move(1, 1)
    assert harness.locator("line.kv-hot").count() == 0 and harness.locator(".kv-bt-mark").count() == 0
    harness.click("[data-act=back]")  # before the first sequence ended: three rows, the hits shared by three
    rows = harness.evaluate(CHIPS_JS)
    assert [r["row"] for r in rows] == ["0", "1", "2"] and rows[1]["chips"][0]["text"] == "0 ×3"
    assert harness.locator("line.kv-bt-line").count() == 9
    harness.locator(".kv-slider").fill("3")  # after the fork, before the copy: the tail shared by two
    rows = harness.evaluate(CHIPS_JS)
    assert rows[1]["chips"][2]["block"] == rows[2]["chips"][2]["block"] and rows[2]["chips"][2]["text"].endswith("×2")
    assert not harness.locator(".kv-chip[data-copied='1']").count()
    harness.locator(".kv-slider").fill("0")  # the empty pool
    assert harness.locator(".kv-table").count() == 0 and "no live sequence" in harness.locator(".kv-bt").inner_text()


def test_the_pause_button_pauses_the_live_run_it_follows(harness):
    mount(harness, "blocktable", sharing_frames()[-1:], '{status: "running"}')
    harness.click("[data-act=toggle]")
    harness.evaluate("() => { m.set('status', 'paused'); m.emit('change:status'); }")
    harness.click("[data-act=fwd]")  # at the newest picture of a paused run: one step of the workload
    harness.click("[data-act=toggle]")
    assert harness.evaluate("() => m.sent.filter(s => s.type === 'control').map(s => s.action)") == \
        ["pause", "step", "run"]
    assert root_data(harness)["framesReceived"] == "1"
    frame = sharing_frames()[-2]  # a new frame arrives: redrawn, lines and all
    harness.evaluate("(s) => m.push(kvt.b64(s))", B64(frame))
    assert harness.locator(".kv-table").count() == 3 and harness.locator("line.kv-bt-line").count() == 9


def test_an_exported_block_table_replays_offline(open_offline, tmp_path):
    frames = sharing_frames()
    page, outside = open_offline(export_html(frames, tmp_path / "bt.html", view="blocktable"))
    page.wait_for_selector(f".kv-root[data-index='{len(frames) - 1}']")  # opens on the last picture
    assert page.locator(".kv-table").count() == 2 and page.locator("line.kv-bt-line").count() == 6
    assert page.locator(".kv-chip[data-copied='1']").count() == 1
    page.locator(".kv-slider").fill("2")  # the prefix hit, before the fork
    assert page.locator(".kv-table").count() == 2 and page.locator(".kv-chip[data-hit='1']").count() == 2
    page.click("[data-act=toggle]")  # play to the end, in the browser
    page.wait_for_selector(f".kv-root[data-index='{len(frames) - 1}'][data-playing='0']")
    assert page.locator("line.kv-bt-line").count() == 6
    assert outside == [], outside
    page.close()


def test_text_is_readable_and_the_legend_explains_every_mark(harness):
    mount(harness, "blocktable", sharing_frames())
    keys = harness.evaluate("() => [...document.querySelectorAll('.kv-bt > .kv-col:first-child .kv-key')]"
                            ".map(k => k.dataset.key)")
    assert keys == ["HIT", "SHARED", "COPIED", "MAP", "COPYLINE", "HOST"]
    sizes = harness.evaluate("() => [...document.querySelectorAll('.kv-root *')].filter(e => [...e.childNodes]"
                             ".some(n => n.nodeType === 3 && n.textContent.trim())).map(e => "
                             "parseFloat(getComputedStyle(e).fontSize))")
    assert min(sizes) >= 14
    outline = "(k) => getComputedStyle(document.querySelector(`.kv-key[data-key=${k}] .kv-swatch`)).borderTopColor"
    assert harness.evaluate(outline, "HIT") == rgb(HIT_RGB) and harness.evaluate(outline, "COPIED") == rgb(COPY_RGB)
