"""Render the chapters (text §2.2.1–§2.2.6) to static HTML for a course site.

Each notebook is executed top to bottom in a fresh kernel with the widget state stored in its metadata
(``store_widget_state``), then exported with kvlab's page template (``kvlab/viz/site_template``, nbconvert's
``lab`` page underneath), which embeds that state, so the pool grids and gauges show their final frame in a
browser with no kernel. The site works offline: the widget manager, anywidget's front end and require.js are
pinned copies (``kvlab/viz/vendor``) written once into the site's ``_kvlab/`` folder, nothing is fetched from a
CDN, and each widget's PNG figure stands in its place until the widget draws (and for good with scripts off).
Links between notebooks (``x.ipynb``) are rewritten to the HTML pages (``x.html``).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from kvlab.core.checks import show
from kvlab.core.errors import ConfigError
from kvlab.core.files import shown
from kvlab.app.resources import shipped

TEMPLATES = Path(__file__).resolve().parents[1] / "viz" / "site_template"


def _notebooks(src: Path, solutions: bool) -> list[Path]:
    found = sorted(src.glob("*.ipynb")) + (sorted((src / "solutions").glob("*.ipynb")) if solutions else [])
    if not found:
        raise ConfigError(f"no notebooks in {src}: give the chapters folder of a kvlab checkout")
    return found


STATIC = "_kvlab"  # the site's folder for the vendored runtime


def write_runtime(folder: Path) -> Path:
    """Copy the vendored browser runtime (checked against its recorded sha256) into ``folder``; returns it."""
    from kvlab.viz.assets import vendored_files

    folder.mkdir(parents=True, exist_ok=True)
    for name, src in vendored_files().items():
        shutil.copyfile(src, folder / name)
    return folder


def render_notebook(path: Path, dest: Path, *, timeout: int = 600, kernel_name: str = "python3",
                    runtime: Path | None = None) -> Path:
    """Execute ``path`` (cwd: its folder) with widget state stored, and write it to ``dest`` as HTML. The page
    loads its scripts from ``runtime`` (default: ``_kvlab/`` beside ``dest``, written there first)."""
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    from kvlab.viz.assets import FONT_STACK

    from nbclient.exceptions import CellExecutionError

    if runtime is None:
        runtime = write_runtime(dest.parent / STATIC)
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # not JSON, not a notebook, an unknown nbformat: one line, not a traceback
        raise ConfigError(f"cannot read notebook {shown(path)}: {type(e).__name__}: {show(str(e), 200)}") from None
    try:
        NotebookClient(nb, kernel_name=kernel_name, timeout=timeout, store_widget_state=True,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    except CellExecutionError as e:
        raise ConfigError(f"notebook {shown(path)}: a cell failed with {e.ename}: {show(e.evalue, 300)}") from None
    exporter = HTMLExporter(template_name="kvlab_site", extra_template_basedirs=[str(TEMPLATES)])
    static = Path(os.path.relpath(runtime, dest.parent)).as_posix()
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": path.stem}, "kvlab_static": static,
                                                          "kvlab_fonts": FONT_STACK})
    body = re.sub(r'href="([^":#]+)\.ipynb', r'href="\1.html', body)  # relative links only: no scheme
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(body, encoding="utf-8")
    return dest


def render_chapters(src: str | Path | None = None, out: str | Path = "site", *, fast: bool = False,
                    solutions: bool = True, timeout: int = 600) -> list[Path]:
    """Render every chapter (and, if ``solutions``, every solution notebook) of ``src`` into ``out``, keeping
    the folder layout; ``fast`` sets ``KVLAB_FAST=1`` for the kernels. Returns the HTML files written.

    The site is built in a new folder beside ``out`` and swapped in whole when every page is done (:func:`_swap`):
    a failure or an interrupt leaves the previous site as it was, and nothing is written through a link that
    was in ``out`` (a new folder has none)."""
    src = Path(src) if src is not None else shipped("chapters")  # the wheel's copy, or the checkout's
    out = Path(out)
    if out.is_symlink():  # a link the caller named: the site goes where it points
        out = out.resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"cannot render the site into {shown(out)}: it is a file, not a folder")
    old = os.environ.get("KVLAB_FAST")
    if fast:
        os.environ["KVLAB_FAST"] = "1"  # kernels inherit the environment
    notebooks = _notebooks(src, solutions)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
    try:
        from tqdm.auto import tqdm

        runtime = write_runtime(new / STATIC)
        pages = [render_notebook(nb, new / nb.relative_to(src).with_suffix(".html"), timeout=timeout,
                                 runtime=runtime)
                 for nb in tqdm(notebooks, desc="rendering", unit="notebook", disable=None)]  # None: off in logs
        _swap(new, out)
        return [out / p.relative_to(new) for p in pages]
    finally:
        shutil.rmtree(new, ignore_errors=True)  # gone already once swapped in
        if fast:
            if old is None:
                os.environ.pop("KVLAB_FAST", None)
            else:
                os.environ["KVLAB_FAST"] = old


def _swap(new: Path, out: Path) -> None:
    """Make folder ``new`` the site at ``out``: what else ``out`` holds (files of the course's own) is copied into
    ``new`` first, links as links; then two renames, the old site kept aside until the new one is in place and
    put back if the second rename fails."""
    if out.is_dir():
        for item in out.iterdir():
            if not os.path.lexists(new / item.name):
                if item.is_dir() and not item.is_symlink():
                    shutil.copytree(item, new / item.name, symlinks=True)
                else:
                    shutil.copy2(item, new / item.name, follow_symlinks=False)
    aside = out.with_name(f".{out.name}.old-{os.getpid()}")
    if os.path.lexists(out):
        os.rename(out, aside)
    try:
        os.rename(new, out)
    except BaseException:
        if os.path.lexists(aside):
            os.rename(aside, out)
        raise
    shutil.rmtree(aside, ignore_errors=True)

