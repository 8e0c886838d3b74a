"""The browser side of the views: find the ES modules in ``widgets/`` and assemble one module per view.

In a source checkout (an editable install) the files are the repository's top-level ``widgets/``; in a wheel they
are packaged as ``kvlab/_widgets``. Each view's module is ``common.js`` + the panel files it needs + one
``export default`` line, because anywidget loads a module from a string, where relative imports cannot resolve.
"""
from __future__ import annotations

from functools import cache
from pathlib import Path

from ..errors import ConfigError

_PKG = Path(__file__).resolve().parent.parent

VIEWS: dict[str, tuple[tuple[str, ...], str]] = {
    "pool": (("pool.js",), "({ model, el }) => kvMount(model, el, (b, m) => [kvPoolPanel(b, m)])"),
    "eviction": (("eviction.js",), "({ model, el }) => kvMount(model, el, (b, m) => [kvEvictionPanel(b, m)])"),
    "fragmentation": (("fragmentation.js",), "({ model, el }) => kvMount(model, el, (b, m) => [kvFragPanel(b, m)])"),
    "dashboard": (("pool.js", "fragmentation.js", "eviction.js", "dashboard.js"),
                  "({ model, el }) => kvMount(model, el, kvDashboardPanels, kvDashboardControls)"),
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
    if view not in VIEWS:
        raise ConfigError(f"unknown view {view!r}; choose one of {sorted(VIEWS)}")
    return VIEWS[view]


def script_source(view: str) -> str:
    """The view's code without an export: ``common.js`` and its panel files."""
    files, _ = _check(view)
    return "\n".join(_read(f) for f in ("common.js", *files))


def render_expr(view: str) -> str:
    """A JS expression for the view's ``render({model, el})``."""
    return _check(view)[1]


@cache
def esm_source(view: str) -> str:
    """The ES module anywidget loads for ``view``."""
    return f"{script_source(view)}\nexport default {{ render: {render_expr(view)} }};\n"


def css_source() -> str:
    return _read("kvlab.css")
