"""The chapters: stored clean, importing only kvlab's public API, and executing top to bottom in fast mode.

Every chapter and solution notebook runs in a fresh ``python3`` kernel (cwd ``chapters/``, ``KVLAB_FAST=1``, CPU)
through nbclient, like a student pressing "Run all"; a cell that raises fails the test with its traceback.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import nbformat
import pytest

import kvlab
import kvlab.distributed
import kvlab.viz

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"
NOTEBOOKS = sorted(CHAPTERS.rglob("*.ipynb"))
NAMES = [str(p.relative_to(CHAPTERS)) for p in NOTEBOOKS]
CHAPTER_FILES = ("index.ipynb", "2_2_1_block_size.ipynb", "2_2_2_block_management.ipynb",
                 "2_2_3_allocation.ipynb", "2_2_4_defragmentation.ipynb", "2_2_5_performance.ipynb",
                 "2_2_6_applications.ipynb")
PUBLIC_MODULES = {"kvlab": set(kvlab.__all__), "kvlab.viz": set(getattr(kvlab.viz, "__all__", ())),
                  "kvlab.exercises": None,  # None: every name without a leading underscore
                  "kvlab.distributed": set(kvlab.distributed.__all__)}


def _code(nb: nbformat.NotebookNode) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def test_every_chapter_and_its_solutions_exist():
    names = {p.name for p in NOTEBOOKS}
    assert set(CHAPTER_FILES) <= names
    for ch in CHAPTER_FILES[1:]:
        assert (CHAPTERS / "solutions" / ch.replace(".ipynb", "_solutions.ipynb")).exists(), ch


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_stored_without_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} of {path.name} is stored with outputs"
            assert cell.execution_count is None, f"cell {i} of {path.name} is stored with an execution count"
    assert "widgets" not in nb.metadata, f"{path.name} is stored with widget state"


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                yield node.module or "", a.name, node.lineno


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_uses_only_public_api(path: Path):
    """Only ``kvlab``, ``kvlab.viz`` and ``kvlab.exercises``, only public names, no private attributes."""
    for i, src in enumerate(_code(nbformat.read(path, as_version=4))):
        assert "sys.path" not in src, f"cell {i} of {path.name} edits sys.path"
        tree = ast.parse(src)
        for module, name, line in _imports(tree):
            if module.split(".")[0] != "kvlab":
                continue
            where = f"{path.name} cell {i} line {line}"
            assert module in PUBLIC_MODULES, f"{where}: imports private module {module}"
            public = PUBLIC_MODULES[module]
            if name is not None and name != "*":
                assert not name.startswith("_"), f"{where}: imports private name {name}"
                assert public is None or name in public or f"{module}.{name}" in PUBLIC_MODULES, \
                    f"{where}: {module}.{name} is not in {module}.__all__"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                a = node.attr
                assert not (a.startswith("_") and not a.startswith("__")), \
                    f"{path.name} cell {i} line {node.lineno}: private attribute .{a}"


@pytest.mark.notebooks
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_executes_in_fast_mode(path: Path, executed):
    """Run all cells in a fresh kernel; each chapter must finish within two minutes on CPU (the run is shared with
    the chapter tests: whichever asks first runs it, so its time is checked here too)."""
    nb, seconds = executed(path)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert seconds <= 120, f"{path.name} took {seconds:.0f} s to run"


@pytest.mark.notebooks
@pytest.mark.timeout(180)
def test_render_keeps_widget_state_and_links(tmp_path: Path):
    """``kvlab html``: a chapter with live views becomes a page carrying the widgets' saved state; links to
    other notebooks point at their HTML pages."""
    from kvlab.app.render import render_chapters

    src = tmp_path / "chapters"
    src.mkdir()
    for name in ("index.ipynb", "2_2_4_defragmentation.ipynb"):
        (src / name).write_bytes((CHAPTERS / name).read_bytes())
    before = os.environ.get("KVLAB_FAST")
    pages = render_chapters(src, tmp_path / "site", fast=True, solutions=False)
    assert os.environ.get("KVLAB_FAST") == before  # the caller's environment is restored
    assert [p.name for p in pages] == ["2_2_4_defragmentation.html", "index.html"]
    chapter, index = (p.read_text(encoding="utf-8") for p in pages)
    assert "application/vnd.jupyter.widget-state+json" in chapter and "FragmentationView" not in index
    assert 'href="2_2_4_defragmentation.html"' in index and 'href="2_2_4_defragmentation.ipynb"' not in index


def test_render_rejects_a_folder_without_notebooks(tmp_path: Path):
    from kvlab import ConfigError
    from kvlab.app.render import render_chapters

    with pytest.raises(ConfigError, match=str(tmp_path)):
        render_chapters(tmp_path, tmp_path / "site")
