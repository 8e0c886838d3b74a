"""The ``kvlab html`` site works offline: its pages load only the pinned runtime vendored in the package (checked
against its recorded sha256), every widget draws with the network cut off, each widget's PNG shows with scripts
off, and a chapter's Chinese heading is drawn with a CJK font; a browser without one is caught (negative control).
"""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
from pathlib import Path

import anywidget
import nbformat
import pytest
from conftest import CHROMIUM, CHROMIUM_FLAGS, REPO

from kvlab import ConfigError
from kvlab.viz import assets

VIEW_CELLS = [
    "from kvlab import BlockPool\n"
    "from kvlab.viz import Dashboard, EvictionView, FragmentationView, LiveRun, PoolView, RandomWorkload\n"
    "p = BlockPool(256, with_storage=False, seed=1)\n"
    "views = [PoolView(p), EvictionView(p), FragmentationView(p)]\n"
    "LiveRun(p, RandomWorkload(p, preset='defrag', seed=1, steps=200), views, fps=1e9).run()",
    "views[0]", "views[1]", "views[2]",
    "Dashboard(num_blocks=512, seed=2)",
    "import ipywidgets\nipywidgets.FloatSlider(value=0.5, description='weight')",  # a chapter's own control
    # a choice made in the page: every option rendered, the tab switches without a kernel (2.2.6's reports)
    "ipywidgets.Tab(children=[ipywidgets.HTML('report A'), ipywidgets.HTML('report B')], titles=['A', 'B'])",
]
VIEWS_PER_PAGE = 4  # kvlab views; the slider and the tabs are two more widgets
OTHER_WIDGETS = 2
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

# For each Han character of the element: its advance (in em) in the DOM; the advance of U+10FFFD, which no font
# has (the missing-glyph box, "tofu"), in the same font; and how many distinct bitmaps the characters draw as in a
# canvas with that font (a face that lacks them draws every one as the same box).
CJK_PROBE = r"""(sel) => {
  const el = document.querySelector(sel), cs = getComputedStyle(el), size = parseFloat(cs.fontSize);
  const han = (c) => /\p{Script=Han}/u.test(c);
  const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT), range = document.createRange(), widths = [];
  for (let node; (node = walker.nextNode());) {
    let off = 0;
    for (const c of node.textContent) {
      if (han(c)) {
        range.setStart(node, off); range.setEnd(node, off + c.length);
        widths.push(range.getBoundingClientRect().width / size);
      }
      off += c.length;
    }
  }
  const ref = document.createElement("span");
  ref.style.font = cs.font; ref.textContent = "\u{10FFFD}"; el.after(ref);
  const tofu = ref.getBoundingClientRect().width / size;
  ref.remove();
  const cv = document.createElement("canvas"), ctx = cv.getContext("2d", { willReadFrequently: true });
  cv.width = cv.height = Math.ceil(size * 2);
  const bitmap = (c) => {
    ctx.clearRect(0, 0, cv.width, cv.height); ctx.font = cs.font; ctx.fillText(c, 2, size * 1.5);
    return cv.toDataURL();
  };
  const chars = [...new Set([...el.textContent].filter(han))];
  return { family: cs.fontFamily, widths, tofu, chars: chars.length, bitmaps: new Set(chars.map(bitmap)).size,
           tofuBitmap: chars.some((c) => bitmap(c) === bitmap("\u{10FFFD}")) };
}"""


def cjk_problems(page, selector: str) -> list[str]:
    """Why the Han characters of ``selector`` are not drawn with a CJK face (empty when they are)."""
    r = page.evaluate(CJK_PROBE, selector)
    problems = []
    if not r["widths"]:
        problems.append(f"{selector} holds no Han character")
    if any(abs(w - r["tofu"]) < 0.02 for w in r["widths"]):
        problems.append(f"characters are as wide as the missing-glyph box ({r['tofu']:.3f} em): {r['widths']}")
    if any(abs(w - 1) > 0.05 for w in r["widths"]):
        problems.append(f"characters are not full width (1 em): {r['widths']}")
    if r["bitmaps"] < r["chars"] or r["tofuBitmap"]:
        problems.append(f"{r['chars']} distinct characters draw as {r['bitmaps']} distinct bitmaps "
                        f"(missing-glyph box among them: {r['tofuBitmap']})")
    return problems


# ------------------------------------------------------------------------------------------- the vendored runtime
def test_vendored_runtime_is_pinned_and_matches_its_recorded_hashes():
    manifest = json.loads((assets.VENDOR / "manifest.json").read_text())
    pins = json.loads((assets.VENDOR / "package.json").read_text())["dependencies"]
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in pins.values()), pins  # exact versions, no ranges
    assert {k: e["version"] for k, e in manifest.items()} == pins
    files = assets.vendored_files()
    for entry in manifest.values():
        for name, digest in entry["files"].items():
            assert hashlib.sha256(files[name].read_bytes()).hexdigest() == digest, name
    assert {"embed-amd.js", "anywidget.js", "require.js", "LICENSE-anywidget.txt", "LICENSE-html-manager.txt",
            "LICENSE-requirejs.txt"} <= set(files)
    # anywidget's front end speaks the protocol of the Python package the kernel runs
    assert manifest["anywidget"]["version"].split(".")[:2] == anywidget.__version__.split(".")[:2]
    # the refresh script copies exactly the files the manifest lists (it is the script that wrote it)
    spec = importlib.util.spec_from_file_location("kvlab_vendor_refresh", assets.VENDOR / "refresh.py")
    refresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(refresh)
    assert {k: [dest for _, dest in v] for k, v in refresh.FILES.items()} == \
        {k: list(e["files"]) for k, e in manifest.items()}


def test_a_changed_vendored_file_is_refused(tmp_path, monkeypatch):
    copy = shutil.copytree(assets.VENDOR, tmp_path / "vendor")
    monkeypatch.setattr(assets, "VENDOR", copy)
    assert assets.vendored_files()["anywidget.js"] == copy / "anywidget.js"
    (copy / "anywidget.js").write_text("// edited\n")
    with pytest.raises(ConfigError, match=r"anywidget\.js of anywidget 0\.11\.0 does not match"):
        assets.vendored_files()
    (copy / "anywidget.js").unlink()
    with pytest.raises(ConfigError, match=r"anywidget\.js of anywidget 0\.11\.0 is missing"):
        assets.vendored_files()


def test_the_wheel_carries_the_runtime_and_the_page_template(wheel):
    names = set(wheel.namelist())
    shipped = {f"kvlab/viz/vendor/{name}" for name in assets.vendored_files()}
    assert shipped | {"kvlab/viz/vendor/manifest.json", "kvlab/viz/site_template/kvlab_site/index.html.j2",
                      "kvlab/viz/site_template/kvlab_site/conf.json"} <= names


# ------------------------------------------------------------------------------------------------------ the site
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A site rendered by ``kvlab html``'s code: the chapters' index (its text, not its code) and a page with every
    view, once at the top and once in ``solutions/`` (a page one folder down)."""
    from kvlab.app.render import render_chapters

    src = tmp_path_factory.mktemp("chapters")
    index = nbformat.read(REPO / "chapters" / "index.ipynb", as_version=4)
    index.cells = [c for c in index.cells if c.cell_type == "markdown"]
    nbformat.write(index, src / "index.ipynb")
    views = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(index.cells[0].source.splitlines()[0]),
                                            *map(nbformat.v4.new_code_cell, VIEW_CELLS)])
    views.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(views, src / "views.ipynb")
    (src / "solutions").mkdir()
    nbformat.write(views, src / "solutions" / "views_solutions.ipynb")
    out = tmp_path_factory.mktemp("site")
    pages = render_chapters(src, out, timeout=120)
    return {p.relative_to(out).as_posix(): p for p in pages}


def distinct_colours(png: bytes) -> int:
    from PIL import Image

    return len(Image.open(io.BytesIO(png)).convert("RGB").getcolors(1 << 24) or [])


def offline_page(browser, **context):
    """A page in a context that is offline and aborts every request that does not read a local file."""
    ctx = browser.new_context(offline=True, viewport={"width": 1400, "height": 1000}, **context)
    page = ctx.new_page()
    page.outside, page.errors, page.failed = [], [], []
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:")
               else (page.outside.append(r.request.url), r.abort()))
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("requestfailed", lambda r: page.failed.append(r.url))
    return page



@pytest.mark.notebooks
def test_pages_name_only_files_of_the_site(site):
    for name, path in site.items():
        html = path.read_text(encoding="utf-8")
        loads = re.findall(r'<(?:script|link|img)\b[^>]*\b(?:src|href)="([^"]+)"', html)
        files = [u for u in loads if not u.startswith("data:image/png;base64,")]
        assert files and not [u for u in files if re.match(r"[a-z]+:|//", u)], (name, files)  # relative paths only
        assert not [u for u in files if not (path.parent / u).is_file()], name
        assert not re.search(r"cdn|unpkg|mathjax|mermaid", " ".join(files), re.I), name
        if "views" in name:
            assert html.count(f'<script type="{WIDGET_VIEW}">') == VIEWS_PER_PAGE + OTHER_WIDGETS


@pytest.mark.browser
@pytest.mark.notebooks
def test_every_widget_draws_with_the_network_cut_off(browser, site):
    for name in ("views.html", "solutions/views_solutions.html"):
        page = offline_page(browser)
        page.goto(site[name].as_uri())
        page.wait_for_function(f"() => document.querySelectorAll('.kv-root').length === {VIEWS_PER_PAGE}",
                               timeout=30_000)
        page.wait_for_timeout(300)  # let the last views draw their frame
        roots = page.locator(".kv-root")
        assert roots.count() == VIEWS_PER_PAGE
        for i in range(VIEWS_PER_PAGE):  # what the reader sees of each view: its pixels on the page
            box = roots.nth(i).bounding_box()
            assert box and box["height"] > 50, (name, i, box)
            assert distinct_colours(roots.nth(i).screenshot()) > 3, (name, i)
        # The picture gave way to the widget, and no control that needs a kernel is left to click: the run's
        # views hold the run saved with the page and only their players show; the one-picture dashboard, none.
        assert page.evaluate("() => [...document.querySelectorAll('img.kv-fallback')].every(i => !i.offsetHeight)")
        visible = page.evaluate("() => [...document.querySelectorAll('.kv-root')].map((r) => [...r.querySelectorAll("
                                "'button, select, input')].filter((e) => e.offsetParent).map((e) => "
                                "e.dataset.act || e.className))")
        assert visible == [["back", "toggle", "fwd", "kv-slider"]] * 3 + [[]], visible
        for i in range(3):
            got = page.evaluate("(i) => { const r = document.querySelectorAll('.kv-root')[i]; "
                                "return [r.kv.hist.length, r.kv.index, r.kv.saved && r.kv.saved.every]; }", i)
            assert got[0] == 202 and got[1:] == [201, 1], (name, i, got)  # its first frame, then 201 of the run
            assert "保存的运行 (saved run)" in roots.nth(i).locator(".kv-label").inner_text()
        pool = roots.nth(0)
        pool.locator("[data-act=toggle]").click()  # play the run from its first picture
        page.wait_for_function("() => document.querySelector('.kv-root').dataset.index !== '201'")
        pool.locator("[data-act=toggle]").click()
        assert pool.get_attribute("data-playing") == "0" and int(pool.get_attribute("data-index")) < 201
        pool.locator(".kv-slider").evaluate("(s) => { s.value = 40; s.dispatchEvent(new Event('input')); }")
        assert pool.get_attribute("data-index") == "40"
        slider = page.locator(".widget-subarea .widget-hslider")  # drawn with its value, greyed and inert
        assert slider.is_visible() and slider.evaluate("(e) => getComputedStyle(e).pointerEvents") == "none"
        assert float(slider.evaluate("(e) => getComputedStyle(e).opacity")) < 1
        tabs = page.locator(".widget-tab")  # a choice that needs no kernel: both reports are in the page
        tabs.locator(".lm-TabBar-tab", has_text="B").click()
        assert tabs.get_by_text("report B").is_visible() and not tabs.get_by_text("report A").is_visible()
        assert page.evaluate("() => document.body.innerText").count("NaN") == 0
        assert (page.outside, page.failed, page.errors) == ([], [], [])
        page.context.close()


@pytest.mark.browser
@pytest.mark.notebooks
def test_each_widget_shows_its_picture_with_scripts_off(browser, site):
    page = offline_page(browser, java_script_enabled=False)
    page.goto(site["views.html"].as_uri())
    shown = page.evaluate("""() => [...document.querySelectorAll('.jupyter-widgets')].map((area) => {
      const img = area.querySelector('img.kv-fallback');
      return img && img.complete ? [img.naturalWidth, img.getBoundingClientRect().height, img.src] : null;
    })""")
    pictures = [s for s in shown if s]
    assert len(shown) == VIEWS_PER_PAGE + OTHER_WIDGETS and len(pictures) == VIEWS_PER_PAGE, shown  # others: none
    for width, height, src in pictures:
        assert width > 100 and height > 50
        assert distinct_colours(base64.b64decode(src.split(",", 1)[1])) > 3  # a drawn figure, not a blank image
    assert (page.outside, page.failed) == ([], [])
    page.context.close()


@pytest.mark.browser
@pytest.mark.notebooks
def test_the_chapters_chinese_heading_is_drawn_with_a_cjk_font(browser, site):
    page = offline_page(browser)
    page.goto(site["index.html"].as_uri())
    assert "Noto Sans CJK SC" in page.evaluate("() => getComputedStyle(document.querySelector('h1')).fontFamily")
    assert cjk_problems(page, "h1") == []
    page.context.close()


@pytest.mark.browser
@pytest.mark.notebooks
def test_a_browser_without_a_cjk_font_is_caught(browser, site, tmp_path):
    """Negative control: the same page in a Chromium whose fontconfig knows only DejaVu and Liberation (those of
    them installed, maybe none), as on a fresh Debian machine without fonts-noto-cjk; the heading's characters
    become boxes and the check says so."""
    dirs = [d for d in ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/truetype/liberation") if Path(d).is_dir()]
    conf = tmp_path / "fonts.conf"
    conf.write_text('<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "fonts.dtd">\n<fontconfig>\n'
                    + "".join(f"  <dir>{d}</dir>\n" for d in dirs)
                    + f"  <cachedir>{tmp_path / 'cache'}</cachedir>\n</fontconfig>\n")
    bare = browser.browser_type.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True,
                                       env={**os.environ, "FONTCONFIG_FILE": str(conf)})
    try:
        page = offline_page(bare)
        page.goto(site["index.html"].as_uri())
        problems = cjk_problems(page, "h1")
        assert any("missing-glyph box" in p for p in problems), problems
    finally:
        bare.close()


# ------------------------------------------------------------------------------------------ exported replays
@pytest.mark.browser
@pytest.mark.parametrize("view", ["pool", "eviction", "fragmentation", "dashboard"])
def test_an_exported_replay_opens_on_its_last_frame_plays_and_pauses_offline(browser, tmp_path, view):
    from kvlab import BlockPool
    from kvlab.viz import RandomWorkload, export_html, record

    p = BlockPool(64, with_storage=False)
    rec = record(p, RandomWorkload(p, preset="defrag", seed=3, steps=300), 300, every=3)
    page = offline_page(browser)
    page.goto(export_html(rec, tmp_path / f"{view}.html", view=view).as_uri())
    last = len(rec) - 1
    page.wait_for_selector(f".kv-root[data-index='{last}']")  # the end of the run, not an empty first frame
    assert distinct_colours(page.locator(".kv-root").screenshot()) > 3
    # Only the player is there to click: nothing that would need a kernel (run, step, speed, settings).
    visible = page.evaluate("() => [...document.querySelectorAll('button, select, input')].filter((e) => "
                            "e.offsetParent).map((e) => e.dataset.act || e.className)")
    assert sorted(visible) == sorted(["back", "toggle", "fwd", "kv-slider"]), visible
    assert "NaN" not in page.evaluate("() => document.body.innerText")
    root = page.locator(".kv-root")
    page.click("[data-act=toggle]")  # play: from the first frame, since it stood at the last
    page.wait_for_function(f"() => document.querySelector('.kv-root').dataset.index !== '{last}'")
    assert root.get_attribute("data-playing") == "1"
    page.click("[data-act=toggle]")  # pause
    assert root.get_attribute("data-playing") == "0"
    paused = root.get_attribute("data-index")
    page.wait_for_timeout(200)
    assert root.get_attribute("data-index") == paused and int(paused) < last
    assert (page.outside, page.failed, page.errors) == ([], [], [])
    page.context.close()
