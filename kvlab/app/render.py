"""Render the chapters (text §2.2.1–§2.2.6) to static HTML for a course site.

Each notebook is executed top to bottom in a fresh kernel with the widget state stored in its metadata
(``store_widget_state``), then exported with kvlab's page template (``kvlab/viz/site_template``, nbconvert's
``lab`` page underneath), which embeds that state, so the pool grids and gauges show their final frame in a
browser with no kernel. The site works offline: the widget manager, anywidget's front end and require.js are
pinned copies (``kvlab/viz/vendor``) written once into the site's ``_kvlab/`` folder, nothing is fetched from a
CDN, and each widget's PNG figure stands in its place until the widget draws (and for good with scripts off).
Links between notebooks (``x.ipynb``) are rewritten to the HTML pages (``x.html``); the course's Markdown files
(``GLOSSARY.md``, ``TEACHING.md``, ``FACTS.md``) become pages of the site too, so every link in it resolves.

:func:`write_executed` keeps the executed notebooks themselves, outputs and all, for a reader without a kernel:
a code host shows them as they ran (``docs/chapters/`` in the checkout, made by ``make executed``).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def execute(path: Path, *, timeout: int = 600, kernel_name: str = "python3") -> Any:
    """The notebook at ``path`` run top to bottom in a fresh kernel (cwd: its folder), widget state stored in its
    metadata; a cell that fails is a :class:`ConfigError` naming the notebook and the error."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # not JSON, not a notebook, an unknown nbformat: one line, not a traceback
        raise ConfigError(f"cannot read notebook {shown(path)}: {type(e).__name__}: {show(str(e), 200)}") from None
    try:
        NotebookClient(nb, kernel_name=kernel_name, timeout=timeout, store_widget_state=True,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    except CellExecutionError as e:
        raise ConfigError(f"notebook {shown(path)}: a cell failed with {e.ename}: {show(e.evalue, 300)}") from None
    return nb


def _site_links(html: str) -> str:
    """Relative links to notebooks and to the course's Markdown files, pointed at their pages in the site."""
    return re.sub(r'href="([^":#]+)\.(?:ipynb|md)', r'href="\1.html', html)  # relative links only: no scheme


def render_markdown(path: Path, dest: Path) -> Path:
    """The Markdown file ``path`` (the glossary, the teaching notes) as a page of the site at ``dest``."""
    import html

    import mistune

    body = _site_links(str(mistune.html(path.read_text(encoding="utf-8"))))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(path.stem)}</title>'
                    f'</head><body>\n{body}</body></html>\n', encoding="utf-8")
    return dest


def render_notebook(path: Path, dest: Path, *, timeout: int = 600, kernel_name: str = "python3",
                    runtime: Path | None = None) -> Path:
    """Execute ``path`` (cwd: its folder) with widget state stored, and write it to ``dest`` as HTML. The page
    loads its scripts from ``runtime`` (default: ``_kvlab/`` beside ``dest``, written there first)."""
    from nbconvert import HTMLExporter

    from kvlab.viz.assets import FONT_STACK

    if runtime is None:
        runtime = write_runtime(dest.parent / STATIC)
    nb = execute(path, timeout=timeout, kernel_name=kernel_name)
    exporter = HTMLExporter(template_name="kvlab_site", extra_template_basedirs=[str(TEMPLATES)])
    static = Path(os.path.relpath(runtime, dest.parent)).as_posix()
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": path.stem}, "kvlab_static": static,
                                                          "kvlab_fonts": FONT_STACK})
    body = _site_links(body)
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
    notebooks = _notebooks(src, solutions)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
    try:
        from tqdm.auto import tqdm

        runtime = write_runtime(new / STATIC)
        with _fast_mode(fast):
            pages = [render_notebook(nb, new / nb.relative_to(src).with_suffix(".html"), timeout=timeout,
                                     runtime=runtime)
                     for nb in tqdm(notebooks, desc="rendering", unit="notebook", disable=None)]  # None: not in logs
        pages += [render_markdown(md, new / md.with_suffix(".html").name) for md in sorted(src.glob("*.md"))]
        _swap(new, out)
        return [out / p.relative_to(new) for p in pages]
    finally:
        shutil.rmtree(new, ignore_errors=True)  # gone already once swapped in


@contextlib.contextmanager
def _fast_mode(fast: bool) -> Iterator[None]:
    """``KVLAB_FAST=1`` for the kernels started inside (they inherit the environment), if ``fast``."""
    old = os.environ.get("KVLAB_FAST")
    if fast:
        os.environ["KVLAB_FAST"] = "1"
    try:
        yield
    finally:
        if fast:
            if old is None:
                os.environ.pop("KVLAB_FAST", None)
            else:
                os.environ["KVLAB_FAST"] = old


def _relinked(nb: Any, src: Path, dest: Path) -> None:
    """Point ``nb``'s Markdown links to files that are not notebooks (``GLOSSARY.md``, ``../docs/x.md``) back at
    them in ``src`` (the folder of the original), from where the executed copy lies (``dest``)."""
    def fix(m: re.Match[str]) -> str:
        target, anchor = m[1], m[2] or ""
        if re.match(r"[a-z]+:|/", target) or target.endswith((".ipynb", "/")):
            return m[0]  # a web address, an absolute path, a notebook or folder of the copies themselves
        return f"]({Path(os.path.relpath(src / target, dest.parent)).as_posix()}{anchor})"

    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = re.sub(r"\]\(([^)#\s]+)(#[^)\s]*)?\)", fix, cell.source)


def write_executed(src: str | Path | None = None, out: str | Path = "docs/chapters", *, fast: bool = False,
                   timeout: int = 600) -> list[Path]:
    """Execute every chapter and solution notebook of ``src`` and write them, with their outputs, into ``out`` in
    the same layout: what a reader without a kernel sees (a code host renders them as they ran). The saved widget
    state is left out (megabytes no code host can run; each view's PNG still stays), and links to the course's
    other files are pointed back at ``src``. Built beside ``out`` and swapped in whole, as the site is."""
    import nbformat

    src = Path(src) if src is not None else shipped("chapters")
    out = Path(out)
    notebooks = _notebooks(src, solutions=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
    try:
        from tqdm.auto import tqdm

        written = []
        with _fast_mode(fast):
            from kvlab.exercises.framework import fast_mode

            mode = "fast" if fast_mode() else "full"
            for path in tqdm(notebooks, desc="executing", unit="notebook", disable=None):
                start = time.perf_counter()
                nb = execute(path, timeout=timeout)
                nb.metadata.pop("widgets", None)
                # the mode, which tests/test_executed.py compares with fast mode, and the run's seconds (the
                # kernel's start included), which TEACHING.md's table of run times reports
                nb.metadata["kvlab"] = {"mode": mode, "seconds": round(time.perf_counter() - start, 1)}
                dest = new / path.relative_to(src)
                _relinked(nb, path.parent.resolve(), out.resolve() / path.relative_to(src))
                dest.parent.mkdir(parents=True, exist_ok=True)
                nbformat.write(nb, dest)
                written.append(out / path.relative_to(src))
        _swap(new, out)
        return written
    finally:
        shutil.rmtree(new, ignore_errors=True)


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

