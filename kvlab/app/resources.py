"""The course files kvlab ships beside its code: the chapter notebooks and the benchmarks.

A wheel carries them inside the package (``kvlab/chapters``, ``kvlab/benchmarks``; see ``pyproject.toml``), so
a student who only ran ``pip install kvlab`` has them; a checkout (an editable install) has them at its root.
:func:`shipped` finds either, and :func:`copy_chapters` is ``kvlab chapters DEST``.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from kvlab.core.errors import ConfigError

_PKG = Path(__file__).resolve().parents[1]  # kvlab/, where the wheel puts the course folders
FOLDERS = ("chapters", "benchmarks")


def shipped(name: str) -> Path:
    """The folder ``name`` (one of :data:`FOLDERS`): inside the installed package, else in the checkout."""
    if name not in FOLDERS:
        raise ConfigError(f"kvlab ships no {name!r} folder; it ships {', '.join(FOLDERS)}")
    for d in (_PKG / name, _PKG.parent / name):
        if d.is_dir():
            return d
    raise ConfigError(f"kvlab's {name} are missing: neither {_PKG / name} nor {_PKG.parent / name} exists "
                      "(a broken install: reinstall kvlab)")


def chapter_notebooks(solutions: bool = True) -> list[Path]:
    """The course notebooks, relative to :func:`shipped` ``("chapters")``: the chapters, then (if
    ``solutions``) ``solutions/*.ipynb``."""
    src = shipped("chapters")
    found = sorted(src.glob("*.ipynb")) + (sorted(src.glob("solutions/*.ipynb")) if solutions else [])
    return [p.relative_to(src) for p in found]


def course_files(solutions: bool = True) -> list[Path]:
    """What the notebooks link to comes with them: :func:`chapter_notebooks` and the course's Markdown files
    (the glossary, the teaching notes, the table of vLLM facts), relative to :func:`shipped` ``("chapters")``."""
    src = shipped("chapters")
    return chapter_notebooks(solutions) + [p.relative_to(src) for p in sorted(src.glob("*.md"))]


def copy_chapters(dest: str | Path, *, solutions: bool = True, overwrite: bool = False) -> list[Path]:
    """Copy the course (:func:`course_files`) into ``dest`` (created if missing), keeping ``solutions/`` as a
    subfolder. Returns the files written. Refuses, before writing anything, when ``dest`` is a file or when a
    file there would be replaced and ``overwrite`` is false (a student's work is never lost to a second copy)."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"cannot copy the chapters into {str(dest)!r}: it is a file, not a folder")
    src, names = shipped("chapters"), course_files(solutions)
    clash = [str(dest / n) for n in names if (dest / n).exists()]
    if clash and not overwrite:
        raise ConfigError(f"{len(clash)} file(s) of the course already in {str(dest)!r} (first: {clash[0]}); nothing "
                          "copied: choose another folder, or overwrite them on purpose (kvlab chapters --force)")
    linked = sorted({str((dest / n).parent) for n in names
                     if (dest / n).parent != dest and (dest / n).parent.is_symlink()})
    if linked:
        raise ConfigError(f"{linked[0]!r} is a link: kvlab copies the chapters into DEST only, never through a link "
                          "out of it; nothing copied")
    written = []
    for n in names:
        (dest / n).parent.mkdir(parents=True, exist_ok=True)
        written.append(_replace(src / n, dest / n))
    return written


def _replace(src: Path, target: Path) -> Path:
    """Copy ``src`` to ``target`` through a new file beside it, renamed over ``target``: a link at ``target`` is
    replaced, never written through, and an interrupted copy leaves ``target`` as it was."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f, open(src, "rb") as s:
            shutil.copyfileobj(s, f)
        shutil.copymode(src, tmp)  # mkstemp made it private (0600)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    return target
