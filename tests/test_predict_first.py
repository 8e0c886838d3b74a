"""Predict, then see, in the chapters' own cells: the key takeaways (which answer the predictions) come after the
last reveal, and every answer cell starts as ``answer = ...`` (Run All counts no placeholder as a miss)."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
NOTEBOOKS = sorted(CHAPTERS.glob("2_2_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_takeaways_come_after_every_reveal_and_answers_start_empty(path):
    cells = nbformat.read(path, as_version=4).cells
    takeaways = [i for i, c in enumerate(cells) if c.cell_type == "markdown" and "要点 (key takeaways)" in c.source]
    reveals = [i for i, c in enumerate(cells) if c.cell_type == "code" and "exercises.reveal(" in c.source]
    assert len(takeaways) <= 1, path.name
    if takeaways:
        assert not reveals or takeaways[0] > max(reveals), f"{path.name}: takeaways before a reveal"
        assert takeaways[0] > 2, f"{path.name}: the takeaways open the chapter"
    for i, c in enumerate(cells):
        if c.cell_type == "code" and "exercises.check(" in c.source:
            m = re.search(r"^answer = (.*)$", c.source, re.M)
            assert m is None or m.group(1).startswith("..."), f"{path.name} cell {i}: {m.group(0)!r}"
