"""Rendering the chapters to a site (kvlab/app/render.py), without a kernel: the notebook client is replaced by one
that executes nothing, so what is tested is the link rewriting and the environment the kernels would inherit."""
from __future__ import annotations

import os
import re

import nbformat
import nbclient
import pytest

from kvlab.app import render


class NoKernel:
    """Stands in for nbclient's NotebookClient: takes the notebook, executes nothing."""

    def __init__(self, nb, **_kw) -> None:
        self.nb = nb

    def execute(self):
        return self.nb


def test_relative_notebook_links_become_pages_and_absolute_ones_stay(tmp_path, monkeypatch):
    """Links between the course's notebooks (``x.ipynb``, ``solutions/x.ipynb#part``) point at the rendered pages
    (``.html``, the anchor kept); a link with a scheme (``https://.../x.ipynb``) points elsewhere and is kept as
    written."""
    monkeypatch.setattr(nbclient, "NotebookClient", NoKernel)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "[next](ch2.ipynb) [solution](solutions/ch2.ipynb#part-1) [elsewhere](https://example.org/book/ch2.ipynb)")])
    nbformat.write(nb, tmp_path / "ch1.ipynb")
    out = render.render_notebook(tmp_path / "ch1.ipynb", tmp_path / "site" / "ch1.html",
                                 runtime=tmp_path / "site" / render.STATIC)
    assert out == tmp_path / "site" / "ch1.html"
    assert re.findall(r'href="([^"]*)"', out.read_text(encoding="utf-8")) == [
        "ch2.html", "solutions/ch2.html#part-1", "https://example.org/book/ch2.ipynb"]


@pytest.fixture
def chapters(tmp_path, monkeypatch):
    """A chapters folder of two notebooks; rendering one only notes the ``KVLAB_FAST`` a kernel would inherit."""
    for name in ("a", "b"):
        nbformat.write(nbformat.v4.new_notebook(), tmp_path / f"{name}.ipynb")
    seen: list[str | None] = []

    def fake_render(path, dest, **_kw):
        seen.append(os.environ.get("KVLAB_FAST"))
        return dest

    monkeypatch.setattr(render, "render_notebook", fake_render)
    monkeypatch.setattr(render, "write_runtime", lambda folder: folder)
    return tmp_path, seen


@pytest.mark.parametrize("before", [None, "0"])
def test_fast_mode_sets_kvlab_fast_for_the_kernels_and_restores_it(chapters, monkeypatch, before):
    """``fast=True`` gives every kernel ``KVLAB_FAST=1``, then leaves the environment as it found it: unset if it
    was unset, its old value if it had one."""
    src, seen = chapters
    if before is None:
        monkeypatch.delenv("KVLAB_FAST", raising=False)
    else:
        monkeypatch.setenv("KVLAB_FAST", before)
    pages = render.render_chapters(src, src / "site", fast=True, solutions=False)
    assert pages == [src / "site" / "a.html", src / "site" / "b.html"]
    assert seen == ["1", "1"]
    assert os.environ.get("KVLAB_FAST") == before and ("KVLAB_FAST" in os.environ) == (before is not None)


def test_fast_mode_restores_the_environment_when_a_render_fails(chapters, monkeypatch):
    """A notebook that fails to render still leaves ``KVLAB_FAST`` unset afterwards; without ``fast`` it is
    never touched."""
    src, seen = chapters
    monkeypatch.delenv("KVLAB_FAST", raising=False)

    def failing(path, dest, **_kw):
        seen.append(os.environ.get("KVLAB_FAST"))
        raise RuntimeError("cell failed")

    monkeypatch.setattr(render, "render_notebook", failing)
    with pytest.raises(RuntimeError, match="cell failed"):
        render.render_chapters(src, src / "site", fast=True, solutions=False)
    assert seen == ["1"] and "KVLAB_FAST" not in os.environ
    monkeypatch.setenv("KVLAB_FAST", "0")
    seen.clear()
    with pytest.raises(RuntimeError, match="cell failed"):
        render.render_chapters(src, src / "site", fast=False, solutions=False)
    assert seen == ["0"] and os.environ["KVLAB_FAST"] == "0"
