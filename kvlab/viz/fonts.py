"""Chinese in matplotlib figures: kvlab labels its figures in Chinese first.

Matplotlib draws with DejaVu Sans, which has no CJK glyphs: a Chinese label comes out as boxes, with a "Glyph
missing" warning. :func:`use_cjk_font` appends a CJK face (Noto Sans CJK, which the README installs as
``fonts-noto-cjk``; the faces macOS and Windows ship otherwise) to ``font.family`` *after* the default family:
matplotlib (3.6 and later) falls back glyph by glyph along that list, so Latin text keeps its look and only the
Chinese characters come from the CJK face. Matplotlib's font cache may predate the font's installation, so a
missing face is looked up through fontconfig (``fc-match``) or among the system's font files, and added by path.
"""
from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import matplotlib
from matplotlib import font_manager

CJK_FAMILIES = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Source Han Sans SC", "WenQuanYi Zen Hei", "PingFang SC",
                "Microsoft YaHei", "SimHei")
_CJK_FILE = re.compile(r"cjk|wqy|pingfang|msyh|simhei|sourcehan", re.IGNORECASE)  # where no fontconfig answers


def _fc_match(family: str) -> Path | None:
    """The font file fontconfig picks for ``family``, if it is that family (fc-match substitutes otherwise)."""
    try:
        out = subprocess.run(["fc-match", "-f", "%{file}\n%{family}", family], capture_output=True, text=True,
                             timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):  # no fontconfig on this machine
        return None
    path, _, names = out.partition("\n")
    return Path(path) if path and family in names.split(",") and Path(path).is_file() else None


def _known() -> str | None:
    names = {f.name for f in font_manager.fontManager.ttflist}
    return next((f for f in CJK_FAMILIES if f in names), None)


@functools.cache
def use_cjk_font() -> str | None:
    """Let matplotlib draw Chinese: register the first of :data:`CJK_FAMILIES` this machine has and append it to
    ``font.family``, after the families already there (a figure's texts take the list when they are made).
    Returns the family used, or None when no CJK face is installed (labels then show boxes). Calling it again
    changes nothing."""
    if _known() is None:
        paths = [p for p in map(_fc_match, CJK_FAMILIES) if p is not None] or \
            [Path(p) for p in font_manager.findSystemFonts() if _CJK_FILE.search(Path(p).name)]
        for path in paths:
            font_manager.fontManager.addfont(str(path))
    family = _known()
    if family is not None and family not in matplotlib.rcParams["font.family"]:
        matplotlib.rcParams["font.family"] = [*matplotlib.rcParams["font.family"], family]
    return family


__all__ = ["CJK_FAMILIES", "use_cjk_font"]
