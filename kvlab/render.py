"""Render the chapters (text §2.2.1–§2.2.6) to static HTML for a course site.

Each notebook is executed top to bottom in a fresh kernel with the widget state stored in its metadata
(``store_widget_state``), then exported with nbconvert's ``lab`` template, which embeds that state and the
widget manager, so the pool grids and gauges show their final frame in a browser with no kernel. Figures come
along as PNGs. Links between notebooks (``x.ipynb``) are rewritten to the HTML pages (``x.html``).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import ConfigError

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"


def _notebooks(src: Path, solutions: bool) -> list[Path]:
    found = sorted(src.glob("*.ipynb")) + (sorted((src / "solutions").glob("*.ipynb")) if solutions else [])
    if not found:
        raise ConfigError(f"no notebooks in {src}: give the chapters folder of a kvlab checkout")
    return found


def render_notebook(path: Path, dest: Path, *, timeout: int = 600, kernel_name: str = "python3") -> Path:
    """Execute ``path`` (cwd: its folder) with widget state stored, and write it to ``dest`` as HTML."""
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, kernel_name=kernel_name, timeout=timeout, store_widget_state=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb, resources={"metadata": {"name": path.stem}})
    body = re.sub(r'href="([^":#]+)\.ipynb', r'href="\1.html', body)  # relative links only: no scheme
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(body, encoding="utf-8")
    return dest


def render_chapters(src: str | Path | None = None, out: str | Path = "site", *, fast: bool = False,
                    solutions: bool = True, timeout: int = 600) -> list[Path]:
    """Render every chapter (and, if ``solutions``, every solution notebook) of ``src`` into ``out``, keeping
    the folder layout; ``fast`` sets ``KVLAB_FAST=1`` for the kernels. Returns the HTML files written."""
    src = Path(src) if src is not None else CHAPTERS
    out = Path(out)
    old = os.environ.get("KVLAB_FAST")
    if fast:
        os.environ["KVLAB_FAST"] = "1"  # kernels inherit the environment
    try:
        from tqdm.auto import tqdm

        return [render_notebook(nb, out / nb.relative_to(src).with_suffix(".html"), timeout=timeout)
                for nb in tqdm(_notebooks(src, solutions), desc="rendering", unit="notebook")]
    finally:
        if fast:
            if old is None:
                os.environ.pop("KVLAB_FAST", None)
            else:
                os.environ["KVLAB_FAST"] = old

