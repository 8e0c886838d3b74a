"""The browser side of the views: find the ES modules in ``widgets/`` and assemble one module per view.

In a source checkout (an editable install) the files are the repository's top-level ``widgets/``; in a wheel they
are packaged as ``kvlab/_widgets``. Each view's module is three generated constants (the palette,
``KV_PALETTE_DATA``, the frame layout, ``KV_FRAME``, and the saved run's, ``KV_REPLAY``), ``common.js``, the panel
files it needs and one ``export default`` line, because anywidget loads a module from a string, where relative
imports cannot resolve.
"""
from __future__ import annotations

from functools import cache
from pathlib import Path

from kvlab.core.checks import show
from kvlab.core.errors import ConfigError
from kvlab.viz.frames import layout_js
from kvlab.viz.palette import palette_js
from kvlab.viz.saved import layout_js as replay_layout_js

_PKG = Path(__file__).resolve().parent.parent

VIEWS: dict[str, tuple[tuple[str, ...], str]] = {
    "pool": (("pool.js",), "({ model, el }) => kvMount(model, el, (b, m) => [kvPoolPanel(b, m)])"),
    "eviction": (("eviction.js",), "({ model, el }) => kvMount(model, el, (b, m) => [kvEvictionPanel(b, m)])"),
    "fragmentation": (("fragmentation.js",), "({ model, el }) => kvMount(model, el, (b, m) => [kvFragPanel(b, m)])"),
    "dashboard": (("pool.js", "fragmentation.js", "eviction.js", "dashboard.js"),
                  "({ model, el }) => kvMount(model, el, kvDashboardPanels, kvDashboardControls)"),
    "chat": (("pool.js", "blocktable.js", "chat.js"),
             "({ model, el }) => kvMount(model, el, kvChatPanels, kvChatControls)"),
    "blocktable": (("pool.js", "blocktable.js"),
                   "({ model, el }) => kvMount(model, el, (b, m) => [kvBlockTablePanel(b, m)])"),
}


def widget_dir() -> Path:
    """The folder holding the widget modules: ``kvlab/_widgets`` when installed from a wheel, else the
    repository's ``widgets/``."""
    for d in (_PKG / "_widgets", _PKG.parent / "widgets"):
        if (d / "common.js").is_file():
            return d
    raise ConfigError(f"kvlab's widget modules are missing: neither {_PKG / '_widgets'} nor "
                      f"{_PKG.parent / 'widgets'} holds common.js")


def _read(name: str) -> str:
    return (widget_dir() / name).read_text(encoding="utf-8")


def _check(view: str) -> tuple[tuple[str, ...], str]:
    if not isinstance(view, str) or view not in VIEWS:
        raise ConfigError(f"unknown view {show(view)}; choose one of {sorted(VIEWS)}")
    return VIEWS[view]


def script_source(view: str) -> str:
    """The view's code without an export: the palette (:func:`~kvlab.viz.palette.palette_js`), the frame layout
    (:func:`~kvlab.viz.frames.layout_js`), the saved run's layout (:func:`~kvlab.viz.saved.layout_js`),
    ``common.js`` and its panel files."""
    files, _ = _check(view)
    return "\n".join([palette_js(), layout_js(), replay_layout_js(), *(_read(f) for f in ("common.js", *files))])


def render_expr(view: str) -> str:
    """A JS expression for the view's ``render({model, el})``."""
    return _check(view)[1]


@cache
def esm_source(view: str) -> str:
    """The ES module anywidget loads for ``view``."""
    return f"{script_source(view)}\nexport default {{ render: {render_expr(view)} }};\n"


def css_source() -> str:
    """The views' stylesheet (``kvlab.css``)."""
    return _read("kvlab.css")


def replay_source() -> str:
    """The replay model (``replay.js``) that stands in for a kernel in an exported replay."""
    return _read("replay.js")


# Latin faces first, then faces with the chapters' Chinese (Debian's fonts-noto-cjk, then macOS and Windows):
# without a CJK face named, a browser may draw every Chinese character as a box.
FONT_STACK = ('system-ui, -apple-system, "Segoe UI", Roboto, "Noto Sans", "DejaVu Sans", "Noto Sans CJK SC", '
              '"Source Han Sans SC", "PingFang SC", "Hiragino Sans GB", "Microsoft YaHei", "WenQuanYi Micro Hei", '
              'sans-serif')

VENDOR = Path(__file__).resolve().parent / "vendor"


def vendored_files() -> dict[str, Path]:
    """The pinned browser runtime a static page needs (the widget manager, anywidget's front end, require.js)
    and its licences, by file name. Each file fetched from npm must match the sha256 that ``vendor/manifest.json``
    recorded when ``vendor/refresh.py`` fetched it."""
    import hashlib
    import json

    manifest = json.loads((VENDOR / "manifest.json").read_text(encoding="utf-8"))
    files = {p.name: p for p in sorted(VENDOR.glob("LICENSE-*.txt"))}
    for package, entry in manifest.items():
        for name, digest in entry["files"].items():
            path = VENDOR / name
            if not path.is_file():
                raise ConfigError(f"the vendored file {path} of {package} {entry['version']} is missing")
            if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
                raise ConfigError(f"the vendored file {path} of {package} {entry['version']} does not match its "
                                  f"recorded sha256 {digest}: run kvlab/viz/vendor/refresh.py")
            files[name] = path
    return files
