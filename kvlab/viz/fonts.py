"""Chinese in matplotlib figures: the chapters label their figures in Chinese first.

Matplotlib draws with DejaVu Sans, which has no CJK glyphs: a Chinese label comes out as boxes, with a "Glyph
missing" warning. :func:`use_cjk_font` adds a CJK face (Noto Sans CJK, which the README installs as
``fonts-noto-cjk``) to ``font.family`` *after* the generic family: matplotlib (3.6 and later) falls back glyph by
glyph along that list, so Latin text keeps its look and only the Chinese characters come from the CJK face.
Matplotlib's font cache may predate the font's installation, so the file is found through fontconfig
(``fc-match``) and added by path.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import matplotlib
from matplotlib import font_manager

CJK_FAMILIES = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Source Han Sans SC", "WenQuanYi Zen Hei")


def _fc_match(family: str) -> Path | None:
    """The font file fontconfig picks for ``family``, if it is that family (fc-match substitutes otherwise)."""
    try:
        out = subprocess.run(["fc-match", "-f", "%{file}\n%{family}", family], capture_output=True, text=True,
                             timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):  # no fontconfig on this machine
        return None
    path, _, names = out.partition("\n")
    return Path(path) if path and family in names.split(",") and Path(path).is_file() else None


def use_cjk_font() -> str | None:
    """Let matplotlib draw Chinese: register the first of :data:`CJK_FAMILIES` found and append it to
    ``font.family``, after the families already there. Returns the family used, or None when no CJK font is
    installed (labels then show boxes). Calling it again changes nothing."""
    known = {f.name for f in font_manager.fontManager.ttflist}
    for family in CJK_FAMILIES:
        if family not in known:
            path = _fc_match(family)
            if path is None:
                continue
            font_manager.fontManager.addfont(str(path))
            known = {f.name for f in font_manager.fontManager.ttflist}
            if family not in known:  # a collection whose first face has another name
                continue
        families = list(matplotlib.rcParams["font.family"])
        if family not in families:
            matplotlib.rcParams["font.family"] = [*families, family]
        return family
    return None


__all__ = ["CJK_FAMILIES", "use_cjk_font"]
