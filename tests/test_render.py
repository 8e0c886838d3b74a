"""Rendering the chapters to a site (kvlab/app/render.py), without a kernel: the notebook client is replaced by one
that executes nothing, so what is tested is the link rewriting and the environment the kernels would inherit."""
from __future__ import annotations

import os
import re

import nbformat
import nbclient
import pytest

from kvlab.app import render
from _util import CHAPTERS


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


# ---------------------------------------------------------------- the site: built aside, swapped in whole
def _site(tmp_path):
    """A rendered site of the course's own shape, with a file of the course's own and a link out of it."""
    site = tmp_path / "site"
    (site / render.STATIC).mkdir(parents=True)
    (site / "a.html").write_text("old a")
    (site / "notes.txt").write_text("the course's own")
    outside = tmp_path / "outside.html"
    outside.write_text("not the site's")
    (site / "b.html").symlink_to(outside)
    return site, outside


def _tree(folder):
    return {str(p.relative_to(folder)): (p.is_symlink(), p.read_text() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def test_a_render_swaps_the_site_in_whole_and_never_writes_through_a_link(chapters, tmp_path, monkeypatch):
    src, _ = chapters

    def page(path, dest, **_kw):
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(f"new {path.stem}")
        return dest

    monkeypatch.setattr(render, "render_notebook", page)
    site, outside = _site(src)
    pages = render.render_chapters(src, site, solutions=False)
    assert pages == [site / "a.html", site / "b.html"]
    assert (site / "a.html").read_text() == "new a" and (site / "b.html").read_text() == "new b"
    assert not (site / "b.html").is_symlink() and outside.read_text() == "not the site's"
    assert (site / "notes.txt").read_text() == "the course's own"
    assert sorted(p.name for p in src.iterdir() if p.name.startswith(".")) == []  # nothing left aside


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_or_failed_render_leaves_the_previous_site_intact(chapters, monkeypatch, failure):
    src, _ = chapters
    calls = []

    def page(path, dest, **_kw):
        calls.append(path.stem)
        if len(calls) == 2:
            raise failure("stopped")
        dest.write_text("new")
        return dest

    monkeypatch.setattr(render, "render_notebook", page)
    site, outside = _site(src)
    before = _tree(site)
    with pytest.raises(failure):
        render.render_chapters(src, site, solutions=False)
    assert _tree(site) == before and outside.read_text() == "not the site's"
    assert [p.name for p in src.iterdir() if p.name.startswith(".")] == []


def test_kvlab_html_interrupted_exits_130_in_one_line(chapters, monkeypatch, capsys):
    from kvlab.app import cli

    src, _ = chapters

    def page(path, dest, **_kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(render, "render_notebook", page)
    site, _ = _site(src)
    before = _tree(site)
    assert cli.main(["html", "--src", str(src), "--out", str(site), "--no-solutions"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "kvlab html: interrupted" and _tree(site) == before


@pytest.mark.parametrize("text", ["not json", '{"cells": 3}', '{"nbformat": 99}', "[" * 100_000])
def test_a_malformed_notebook_is_one_line_naming_it(tmp_path, text):
    (tmp_path / "bad.ipynb").write_text(text)
    with pytest.raises(render.ConfigError, match="cannot read notebook") as got:
        render.render_notebook(tmp_path / "bad.ipynb", tmp_path / "site" / "bad.html", runtime=tmp_path / "rt")
    assert "bad.ipynb" in str(got.value) and "\n" not in str(got.value)


def test_a_failing_cell_is_one_line_naming_the_notebook_and_the_error(tmp_path, monkeypatch):
    from nbclient.exceptions import CellExecutionError

    class Failing(NoKernel):
        def execute(self):
            raise CellExecutionError("Traceback ...\nZeroDivisionError: division by zero", "ZeroDivisionError",
                                     "division by zero")

    monkeypatch.setattr(nbclient, "NotebookClient", Failing)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1/0")]), tmp_path / "ch.ipynb")
    with pytest.raises(render.ConfigError, match=r"ch.ipynb.*a cell failed with ZeroDivisionError: "):
        render.render_notebook(tmp_path / "ch.ipynb", tmp_path / "site" / "ch.html", runtime=tmp_path / "rt")


def test_copying_the_chapters_never_writes_through_a_link(tmp_path):
    from kvlab.app.resources import chapter_notebooks, copy_chapters

    dest, outside = tmp_path / "course", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    first = chapter_notebooks(False)[0]
    (outside / "victim.ipynb").write_text("mine")
    (dest / first).symlink_to(outside / "victim.ipynb")
    copy_chapters(dest, solutions=False, overwrite=True)
    assert (outside / "victim.ipynb").read_text() == "mine" and not (dest / first).is_symlink()
    (tmp_path / "course2").mkdir()
    (tmp_path / "course2" / "solutions").symlink_to(outside, target_is_directory=True)
    with pytest.raises(render.ConfigError, match="is a link"):
        copy_chapters(tmp_path / "course2", solutions=True)
    assert [p.name for p in outside.iterdir()] == ["victim.ipynb"]


def test_the_course_markdown_files_become_pages_and_links_to_them_follow(tmp_path, monkeypatch):
    """GLOSSARY.md and the like are pages of the site, so the chapters' links to them resolve there."""
    monkeypatch.setattr(nbclient, "NotebookClient", NoKernel)
    monkeypatch.setattr(render, "write_runtime", lambda folder: folder)
    src = tmp_path / "chapters"
    src.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "[words](GLOSSARY.md) [notes](TEACHING.md#times)")]), src / "ch1.ipynb")
    glossary = "# 词汇表 (Glossary)\n\n| 词 | 意思 |\n|---|---|\n| 块 | block |\n\n[back](ch1.ipynb)\n"
    (src / "GLOSSARY.md").write_text(glossary, encoding="utf-8")
    (src / "TEACHING.md").write_text("## times\n", encoding="utf-8")
    pages = render.render_chapters(src, tmp_path / "site", solutions=False)
    assert sorted(p.name for p in pages) == ["GLOSSARY.html", "TEACHING.html", "ch1.html"]
    chapter = (tmp_path / "site" / "ch1.html").read_text(encoding="utf-8")
    assert 'href="GLOSSARY.html"' in chapter and 'href="TEACHING.html#times"' in chapter
    glossary = (tmp_path / "site" / "GLOSSARY.html").read_text(encoding="utf-8")
    assert "<table>" in glossary and "词汇表" in glossary and 'href="ch1.html"' in glossary


def test_executed_copies_keep_the_layout_drop_widget_state_and_point_links_back(tmp_path, monkeypatch):
    """``kvlab html --ipynb``: chapters and solutions with their outputs, the saved widget state left out, links
    to notebooks kept (the copies sit side by side) and links to other files pointed back at the chapters."""
    monkeypatch.setattr(nbclient, "NotebookClient", NoKernel)
    src = tmp_path / "chapters"
    (src / "solutions").mkdir(parents=True)
    cell = nbformat.v4.new_markdown_cell("[g](GLOSSARY.md) [f](../docs/facts.md#F1) [s](solutions/a_solutions.ipynb) "
                                         "[all](solutions/) [web](https://example.org/x.md)")
    nb = nbformat.v4.new_notebook(cells=[cell], metadata={"widgets": {"state": "megabytes"}})
    nbformat.write(nb, src / "a.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("[back](../GLOSSARY.md)")]),
                   src / "solutions" / "a_solutions.ipynb")
    out = tmp_path / "docs" / "chapters"
    written = render.write_executed(src, out)
    assert written == [out / "a.ipynb", out / "solutions" / "a_solutions.ipynb"]
    copy = nbformat.read(out / "a.ipynb", as_version=4)
    assert "widgets" not in copy.metadata and copy.metadata["kvlab"]["mode"] == "full"
    assert copy.cells[0].source == ("[g](../../chapters/GLOSSARY.md) [f](../facts.md#F1) "
                                    "[s](solutions/a_solutions.ipynb) [all](solutions/) [web](https://example.org/x.md)")
    assert copy.cells[0].id == cell.id
    solution = nbformat.read(out / "solutions" / "a_solutions.ipynb", as_version=4)
    assert solution.cells[0].source == "[back](../../../chapters/GLOSSARY.md)"


def test_every_link_of_the_real_course_site_resolves(tmp_path, monkeypatch):
    """The site of the chapters as they are (their text: nothing executed): every relative link of every page, to
    a chapter, a solution, the glossary, the teaching notes or the facts, names a page the site has."""
    monkeypatch.setattr(nbclient, "NotebookClient", NoKernel)
    pages = render.render_chapters(CHAPTERS, tmp_path / "site")
    names = {p.name for p in pages}
    assert {"index.html", "GLOSSARY.html", "TEACHING.html", "FACTS.html"} <= names
    dead = []
    for page in pages:
        for target in re.findall(r'<a\b[^>]*\bhref="([^"#]+)', page.read_text(encoding="utf-8")):
            if not re.match(r"[a-z]+:|//", target) and not (page.parent / target).exists():
                dead.append((page.name, target))
    assert not dead
