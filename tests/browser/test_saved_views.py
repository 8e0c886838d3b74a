"""A notebook saved and reopened keeps its views, in JupyterLab and in Notebook 7: run in Chromium, saved (kvlab's
install turns widget state saving on), its kernel shut down, opened again with a fresh kernel that has none of
the views. No output says "model not found"; each view draws its last picture, holds the whole run saved with it
(frame for frame) and replays it; a click that needs the old kernel is noticed and its controls go; a chapter's
own slider is drawn with its value."""
from __future__ import annotations

import base64
import re
import time

import nbformat
import pytest
from conftest import page_errors, wait_until

from kvlab.viz import saved
from kvlab.viz.browser import open_notebook, run_cell, write_notebook

pytestmark = pytest.mark.browser

CELLS = [
    "from kvlab import BlockPool\nfrom kvlab.viz import Dashboard, EvictionView, LiveRun, PoolView, RandomWorkload\n"
    "p = BlockPool(128, with_storage=False, seed=1)\nviews = [PoolView(p), EvictionView(p)]\ndisplay(*views)",
    "run = LiveRun(p, RandomWorkload(p, preset='defrag', seed=1, steps=150), views, fps=1e9)\nrun.run()\n"
    "print('FRAMES', len(views[0].history), run.state)",
    "d = Dashboard(num_blocks=256, seed=2)\nfor _ in range(5):\n    d.step()\nd",
    "import ipywidgets\nipywidgets.IntSlider(value=7, description='weight')",
]
STATE = "application/vnd.jupyter.widget-state+json"






def roots(page):
    return page.locator(".jp-OutputArea-output .kv-root")


def pictures(page) -> list[str]:
    """What the two views of the ended run show: the pool grid's pixels (a PNG data URL), the eviction panel's
    words and bar widths. (The dashboard's last step still flashes in the live notebook, where more may come;
    its saved run ends settled.)"""
    return page.evaluate("""() => [...document.querySelectorAll('.jp-OutputArea-output .kv-root')].slice(0, 2).map(
      (r, i) => i === 1 ? r.querySelector('.kv-evictions').innerText + [...r.querySelectorAll('.kv-bar')].map(
        (b) => b.style.width).join() : r.kv.panels[0].canvas.toDataURL())""")


def saved_replays(path) -> list[bytes]:
    """The ``replay`` of every kvlab view in the widget state saved in the notebook file."""
    state = nbformat.read(path, as_version=4).metadata.get("widgets", {}).get(STATE, {}).get("state", {})
    out = []
    for model in state.values():
        for buf in model.get("buffers", []):
            if buf["path"] == ["replay"]:
                out.append(base64.b64decode(buf["data"]))
    return out


def test_a_saved_notebook_reopens_with_every_view_and_its_run(browser, front_end):
    server = front_end
    app, path = server["app"], server["work"] / "saved.ipynb"
    write_notebook(path, CELLS)
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    errors = page_errors(page)
    open_notebook(page, server["url"], "saved.ipynb", app=app)
    for i in range(len(CELLS)):
        run_cell(page, i)
    out = page.locator(".jp-OutputArea-output pre", has_text="FRAMES")
    out.wait_for(timeout=120_000)
    frames = int(re.search(r"FRAMES (\d+) done", out.inner_text()).group(1))
    assert frames > 100  # every step's frame (fps unlimited)
    wait_until(lambda: roots(page).count() == 3, 60, "three views")
    wait_until(lambda: page.locator(".widget-hslider").count() == 1, 60, "the slider")
    time.sleep(1)  # the last cell's post-cell packing reaches the browser
    live_pictures = pictures(page)
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    replays = wait_until(lambda: len(saved_replays(path)) == 3 and saved_replays(path), 30, "the saved state")
    runs = sorted((saved.unpack_frames(r) for r in replays), key=lambda r: -r[2])
    assert [r[2] for r in runs] == [frames, frames, 6]  # pool and eviction views: the run; the dashboard: 6 pictures
    page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:shutdown')")
    time.sleep(1)
    page.close()

    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    errors2 = page_errors(page)
    open_notebook(page, server["url"], "saved.ipynb", app=app)  # a fresh kernel, which knows none of the views
    wait_until(lambda: roots(page).count() == 3, 60, "the views drawn from the saved state")
    assert "model not found" not in page.locator("body").inner_text()
    assert page.locator(".widget-hslider .widget-readout").inner_text() == "7"
    for i, n in ((0, frames), (1, frames), (2, 6)):  # the whole run, ending on the last picture
        wait_until(lambda i=i, n=n: page.evaluate(
            "(i) => document.querySelectorAll('.jp-OutputArea-output .kv-root')[i].kv.hist.length", i) == n,
            20, f"the saved run of view {i}")
        label = roots(page).nth(i).locator(".kv-label").inner_text()
        assert label.startswith("第 ") and "保存的运行 (saved run)" in label and "earlier" not in label, label
    assert pictures(page) == live_pictures  # pixel for pixel (and word for word) the picture the run ended on
    pool = roots(page).nth(0)
    assert pool.get_attribute("data-index") == str(frames - 1)
    pool.locator("[data-act=toggle]").click()  # play the saved run from its start
    wait_until(lambda: pool.get_attribute("data-index") not in (None, str(frames - 1)), 10, "the replay")
    assert pool.get_attribute("data-playing") == "1"
    pool.locator("[data-act=toggle]").click()
    # The dashboard's kernel is gone: a click on "one step" goes unanswered, and its controls go.
    dash = roots(page).nth(2)
    assert dash.locator(".kv-controls").is_visible()
    dash.locator("[data-ctl=step]").click()
    wait_until(lambda: "kv-no-kernel" in (dash.get_attribute("class") or ""), 10, "no kernel noticed")
    assert not dash.locator(".kv-controls").is_visible()
    assert "没有内核应答" in dash.locator(".kv-label").inner_text()
    assert not errors and not errors2, (errors, errors2)
    page.close()
