"""Modules talk through public APIs only: no code in kvlab reads another object's private attributes.

A private name (``obj._x``) may be used on ``self``/``cls`` and through ``super()``; anything else would let one
module depend on another's internals (before this rule, 47 places in 10 modules read the pool's buffers).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvlab

ROOT = Path(kvlab.__file__).parent
# Names that protocols give a leading underscore (IPython's display hook, ipywidgets' message handler).
PROTOCOL = {"_repr_mimebundle_", "_on_msg"}


def private_reads(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of every ``obj._name`` whose ``obj`` is not ``self``, ``cls`` or ``super()``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in ("self", "cls"):
            continue
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            continue
        if node.attr in PROTOCOL:
            continue
        out.append((node.lineno, ast.unparse(node)))
    return out


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_reads_private_state(path):
    assert private_reads(path.read_text()) == []


def test_the_guard_sees_private_reads():
    found = private_reads("def f(pool, self):\n    self._ok = pool._refs[0] + self.pool._tokens[1]\n"
                          "    super()._fine()\n")
    assert [e for _, e in found] == ["pool._refs", "self.pool._tokens"]


def test_public_fields_are_read_only():
    pool = kvlab.BlockPool(4, with_storage=False)
    with pytest.raises(TypeError):
        pool.fields.refcount[0] = 5
    with pytest.raises(ValueError):
        pool.arrays.refcount[0] = 5
    assert pool.fields.refcount[0] == 0 and pool.arrays.refcount[0] == 0
