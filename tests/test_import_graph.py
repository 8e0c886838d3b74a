"""kvlab's modules import each other without a cycle: a student reads them bottom-up, one concept at a time.

The graph is built from the source (every ``import`` and ``from ... import`` of a kvlab module, at the top or
inside a function; those under ``if TYPE_CHECKING:`` never run and are left out), and its strongly connected
components must be single modules.
"""
from __future__ import annotations

import ast
from pathlib import Path

import kvlab

ROOT = Path(kvlab.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("kvlab", *path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvlab modules it imports (a name imported from a package counts as its submodule when one
    exists by that name, else as the package)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for n in ast.walk(node)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                edges[name] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    edges[name] |= {sub} if sub in mods else {target} if target in mods else set()
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_text_api_sits_above_the_pool():
    """The text's names are an adapter around the pool, not something the pool is built from."""
    graph = import_graph()
    assert "kvlab.core.pool" in graph["kvlab.textbook.pool"]
    assert not {"kvlab.textbook.pool", "kvlab.memory.allocator"} & graph["kvlab.core.pool"]
    assert graph["kvlab.core.block"] <= {"kvlab.core.errors"}  # the states, declared once, depend on nothing else


def test_the_cycle_finder_finds_cycles_and_reads_relative_imports():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    assert "kvlab.core.pool" in graph["kvlab.core.prefix"]  # from .pool import BlockPool
    assert "kvlab.exercises.framework" in graph["kvlab.exercises.ch2_2_1"]  # from .framework import ...
    assert "kvlab.core.pool" not in graph["kvlab.core.eviction"]  # imported only under TYPE_CHECKING
