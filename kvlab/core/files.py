"""Reading files kvlab did not write (traces, model files): nothing read is trusted.

* Only a regular file is read. A FIFO would block the reader until someone writes to it (forever, in a notebook),
  a device such as ``/dev/zero`` never ends, a directory is no data: each is a :class:`ConfigError` naming the path.
  The file is opened without waiting (``O_NONBLOCK``) and judged by ``fstat`` on what was opened, so it cannot be
  swapped for a FIFO between the check and the read.
* Size is bounded before anything is held: at most :data:`MAX_FILE_BYTES` read, and a gzip stream bounded as it
  expands (:func:`gunzip`), since a 20 KB file can decompress to gigabytes.
* A message names the file, cut to :data:`MAX_SHOWN` characters (a path can be as long as the file system allows).

The readers above bound what is theirs to bound: lines, JSON depth, fields (:mod:`kvlab.workloads.mixes`).
"""
from __future__ import annotations

import os
import stat
import zlib
from collections.abc import Callable
from pathlib import Path

from kvlab.core.checks import check_path
from kvlab.core.errors import ConfigError

MAX_FILE_BYTES = 1 << 28  # 256 MiB, read or decompressed: the bundled Mooncake trace is 3 MB decompressed
MAX_SHOWN = 200  # characters of a path an error message shows


def shown(path: object) -> str:
    """``path`` as an error message names it: quoted, at most :data:`MAX_SHOWN` characters."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else repr(path)
    return repr(text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "...")


def os_reason(e: OSError | ValueError) -> str:
    """Why the OS refused a path, in words (``ValueError``: a NUL in the path)."""
    return e.strerror or str(e) if isinstance(e, OSError) else "the path holds a NUL character"


def regular_file(path: object, what: str) -> Path:
    """``path`` if it names a regular file (symlinks followed), else :class:`ConfigError` naming it: for readers
    that open the file themselves (a model file read through a memory map)."""
    p = check_path(path, what)
    try:
        mode = os.stat(p).st_mode
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {what} {shown(p)}: {os_reason(e)}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{what} {shown(p)} is {_kind(mode)}, not a regular file")
    return p


def read_file(path: object, what: str, limit: int | None = None) -> bytes:
    """The bytes of regular file ``path``, at most ``limit`` of them (default :data:`MAX_FILE_BYTES`);
    :class:`ConfigError` naming the path and ``what`` it was meant to be for anything else (missing, unreadable,
    not a regular file, too large)."""
    p = check_path(path, what)
    limit = MAX_FILE_BYTES if limit is None else limit
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {what} {shown(p)}: {os_reason(e)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {shown(p)} is {_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise ConfigError(f"{what} {shown(p)} holds {st.st_size:,} bytes; kvlab reads at most {limit:,}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)  # the file may have grown since fstat
    except OSError as e:
        raise ConfigError(f"cannot read {what} {shown(p)}: {os_reason(e)}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ConfigError(f"{what} {shown(p)} holds more than {limit:,} bytes; kvlab reads at most {limit:,}")
    return data


def gunzip(data: bytes, where: str, fault: Callable[[list[bytes], str], Exception],
           limit: int | None = None) -> bytes:
    """``data`` decompressed (every gzip member of it), never holding more than ``limit`` bytes of output
    (default :data:`MAX_FILE_BYTES`). A corrupt or cut-off stream raises ``fault(what was decompressed so far,
    the problem)`` (the caller says where the readable part stops); output past ``limit`` is a
    :class:`ConfigError` naming ``where``."""
    limit = MAX_FILE_BYTES if limit is None else limit
    out: list[bytes] = []
    size, rest = 0, data
    while rest:
        unzip = zlib.decompressobj(wbits=31)  # 31: gzip header and trailer
        at, step = 0, 1 << 16  # in pieces, so that what precedes a fault is kept for its line number
        try:
            while not unzip.eof and (at < len(rest) or unzip.unconsumed_tail):
                piece = unzip.unconsumed_tail or rest[at:at + step]
                if not unzip.unconsumed_tail:
                    at += step
                out.append(unzip.decompress(piece, limit - size + 1))  # never more than one byte past the limit
                size += len(out[-1])
                if size > limit:
                    raise ConfigError(f"{shown(where)} decompresses to more than {limit:,} bytes; kvlab reads at "
                                      f"most {limit:,} (is it a gzip bomb?)")
        except zlib.error as e:
            raise fault(out, f"not valid gzip data ({e})") from None
        if not unzip.eof:
            raise fault(out, "the gzip data ends early (a truncated file?)")
        rest = unzip.unused_data + rest[at:]  # the next member, if any
    return b"".join(out)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "no regular file"
