"""What the chapters say about vLLM is cited: every box that names vLLM links ``chapters/FACTS.md`` and the rows it
uses, and every row of ``chapters/FACTS.md`` names the version and a ``file:line`` whose line holds the row's quote.

The quotes are checked against vLLM's source where ``.venv-bench/vllm`` holds it (the benchmark-only install of
vLLM 0.34.0); elsewhere the same test checks the table's form and the citations, and says it did not read the
source (no skip: CI refuses skipped tests).
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
FACTS = ROOT / "chapters" / "FACTS.md"
CHAPTERS = ROOT / "chapters"
VLLM_SRC = ROOT / ".venv-bench" / "vllm"
VERSION = "vLLM 0.34.0"
LINK = "FACTS.md"

# the names the "where" column uses, and the file each one stands for
WHERE = {
    "2.2.1": CHAPTERS / "2_2_1_block_size.ipynb",
    "2.2.2": CHAPTERS / "2_2_2_block_management.ipynb",
    "2.2.2-appendix": CHAPTERS / "2_2_2_appendix_errata.ipynb",
    "2.2.3": CHAPTERS / "2_2_3_allocation.ipynb",
    "2.2.4": CHAPTERS / "2_2_4_defragmentation.ipynb",
    "2.2.5": CHAPTERS / "2_2_5_performance.ipynb",
    "2.2.6": CHAPTERS / "2_2_6_applications.ipynb",
    "2.2.7": CHAPTERS / "2_2_7_beyond_one_machine.ipynb",
    "2.2.8": CHAPTERS / "2_2_8_inside_a_real_model.ipynb",
    "GLOSSARY": CHAPTERS / "GLOSSARY.md",
    "TEACHING": CHAPTERS / "TEACHING.md",
    "docs/benchmarks.md": ROOT / "docs" / "benchmarks.md",
    "docs/distributed.md": ROOT / "docs" / "distributed.md",
    "docs/traces.md": ROOT / "docs" / "traces.md",
}
SOURCE = re.compile(r"^`vllm/((?:[\w.-]+/)*[\w.-]+\.py):(\d+)`$")
QUOTE = re.compile(r"^`([^`]+)`$")
FACT_ID = re.compile(r"\bF(\d+)\b")


def _rows() -> list[dict[str, str]]:
    """The rows of the table under ``## Facts``."""
    text = FACTS.read_text(encoding="utf-8")
    section = text.split("\n## Facts\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["id", "fact", "system", "source", "quote", "where"], header
    rows = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        assert len(cells) == len(header), f"a row of chapters/FACTS.md has {len(cells)} cells: {ln}"
        rows.append(dict(zip(header, cells)))
    return rows


def _boxes(path: Path) -> list[str]:
    """The boxes of a chapter that mention vLLM: its markdown cells that are block quotes (instructor boxes and
    "在 vLLM 里" boxes), or, for a Markdown file, the whole file."""
    if path.suffix == ".md":
        text = path.read_text(encoding="utf-8")
        return [text] if "vLLM" in text else []
    nb = nbformat.read(path, as_version=4)
    return [c.source for c in nb.cells
            if c.cell_type == "markdown" and c.source.lstrip().startswith(">") and "vLLM" in c.source]


def _markdown(path: Path) -> str:
    """The prose of a chapter (its markdown cells) or of a Markdown file."""
    if path.suffix == ".md":
        return path.read_text(encoding="utf-8")
    return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")


def test_facts_rows_are_cited_and_checked():
    rows = _rows()
    assert len(rows) >= 50
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids), "a fact id is used twice"
    checked = 0
    for r in rows:
        where = f"chapters/FACTS.md row {r['id']}"
        assert re.fullmatch(r"F\d+", r["id"]), where
        assert r["fact"], where
        assert r["system"] == VERSION, f"{where}: system {r['system']!r}, not {VERSION!r}"
        src = SOURCE.match(r["source"])
        assert src, f"{where}: source {r['source']!r} is not `vllm/path.py:line`"
        quote = QUOTE.match(r["quote"])
        assert quote and len(quote.group(1).strip()) >= 3, f"{where}: quote {r['quote']!r}"
        names = [n.strip() for n in r["where"].split(",")]
        assert names and all(n in WHERE for n in names), f"{where}: where {r['where']!r}"
        for n in names:  # each document that states the fact cites the row
            text = _markdown(WHERE[n])
            assert r["id"] in set(f"F{m}" for m in FACT_ID.findall(text)), f"{where}: {n} does not cite {r['id']}"
        if VLLM_SRC.is_dir():  # vLLM's source is here: the cited line must hold the quote
            path = VLLM_SRC / src.group(1)
            assert path.is_file(), f"{where}: {path} does not exist"
            lines = path.read_text(encoding="utf-8").splitlines()
            line = int(src.group(2))
            assert 1 <= line <= len(lines), f"{where}: {src.group(1)} has {len(lines)} lines"
            assert quote.group(1) in lines[line - 1], \
                f"{where}: line {line} of {src.group(1)} is {lines[line - 1].strip()!r}, without {quote.group(1)!r}"
            checked += 1
    if VLLM_SRC.is_dir():
        version = (VLLM_SRC / "_version.py").read_text(encoding="utf-8")
        assert "__version__ = version = '0.34.0'" in version, "the installed vLLM is not 0.34.0"
        assert checked == len(rows)
    else:
        print(f"vLLM's source is not at {VLLM_SRC}: checked the form of {len(rows)} rows, not their quotes")


def test_facts_every_vllm_box_cites_facts():
    known = {r["id"] for r in _rows()}
    for name, path in WHERE.items():
        if not path.parent == CHAPTERS:
            continue
        for box in _boxes(path):
            first = box.strip().splitlines()[0][:60]
            assert LINK in box, f"{name}: a box that mentions vLLM does not link {LINK}: {first!r}"
            cited = {f"F{m}" for m in FACT_ID.findall(box)}
            assert cited, f"{name}: a box that mentions vLLM cites no row of chapters/FACTS.md: {first!r}"
            assert cited <= known, f"{name}: cites rows chapters/FACTS.md lacks: {sorted(cited - known)}"
            assert "在 vLLM 里" not in box or "0.34.0" in box, f"{name}: the In vLLM box names no version"
    for nb in sorted(CHAPTERS.glob("2_2_*.ipynb")):  # every chapter is in WHERE, so none escapes the check
        assert nb in WHERE.values(), nb.name
