"""A run saved with the notebook: a view's frames packed small enough to live in the notebook file.

A view's live frames travel to the browser one message at a time and stay there; a saved notebook keeps only
each widget's synced state. So a view also keeps its whole run in one synced trait, ``replay`` (see
:mod:`kvlab.viz.views`): JupyterLab and Notebook 7 save it with the notebook (kvlab's install turns their "save
widget state" setting on) and ``kvlab html`` with the page, and the browser replays it where no kernel answers.

The packing, written down once here (the browser reads it from :func:`layout_js`, as ``kvUnpackReplay`` in
``widgets/common.js`` does)::

    magic "KVR1" | u32 every | u32 total | zlib( (u32 length, frame bytes) for each frame kept )

all little endian. ``total`` is how many frames the run had and ``every`` which of them were kept: frames
0, every, 2*every, ... and always the last. Frames compress ~35-170x (a frame repeats most of the previous one's
bytes), so a 2,000-step run of a 512-block pool, 17.7 MB of frames, packs into 0.24 MB with every frame kept;
a longer run keeps every 2nd, 4th, ... frame until it fits :data:`REPLAY_BYTES`.
"""
from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence

from kvlab.core.checks import show
from kvlab.core.errors import ConfigError
from kvlab.viz.frames import DATAVIEW, decode_frame

MAGIC = b"KVR1"
HEAD_FIELDS = (("every", "I"), ("total", "I"))  # after the magic
HEAD = struct.Struct("<4s" + "".join(code for _, code in HEAD_FIELDS))
LENGTH = struct.Struct("<I")
REPLAY_BYTES = 1 << 20  # packed bytes per view: a notebook of 20 views grows by at most ~27 MB of base64
UNPACKED_LIMIT = 1 << 30  # what unpacking inflates to at most: a small file must not claim gigabytes


def layout_js() -> str:
    """The packing as the JavaScript constant ``KV_REPLAY`` that ``kvUnpackReplay`` (``widgets/common.js``)
    reads: the magic, each head field as ``[name, offset, DataView type]``, the head's size and each frame's
    length field, so the browser keeps no offset of its own."""
    at, head = 4, []
    for name, code in HEAD_FIELDS:
        head.append([name, at, DATAVIEW[code]])
        at += struct.calcsize(code)
    data = {"magic": MAGIC.decode(), "head": head, "headSize": HEAD.size, "length": [LENGTH.size, DATAVIEW["I"]]}
    return f"const KV_REPLAY = {json.dumps(data)};"


def kept(total: int, every: int) -> list[int]:
    """The indices of the frames a packing with ``every`` keeps of ``total``: 0, every, 2*every, ..., and the
    last."""
    keep = list(range(0, total, every))
    if keep and keep[-1] != total - 1:
        keep.append(total - 1)
    return keep


def pack_frames(frames: Sequence[bytes], budget: int = REPLAY_BYTES) -> bytes:
    """``frames`` packed as the module docstring lays out: every frame if that fits ``budget`` bytes, else every
    2nd, 4th, ... (always the first and the last). Empty for no frames."""
    if not frames:
        return b""
    every = 1
    while True:
        body = b"".join(LENGTH.pack(len(frames[i])) + frames[i] for i in kept(len(frames), every))
        packed = HEAD.pack(MAGIC, every, len(frames)) + zlib.compress(body, 6)
        if len(packed) <= budget or every >= len(frames):
            return packed
        every *= 2


def unpack_frames(data: bytes | bytearray | memoryview) -> tuple[list[bytes], int, int]:
    """(the frames, ``every``, ``total``) of a packing, each frame checked as :func:`~kvlab.viz.frames.decode_frame`
    checks one; :class:`ConfigError` naming what is wrong with anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ConfigError(f"a packed replay is bytes, not {show(data)}")
    data = bytes(data)
    if len(data) < HEAD.size or data[:4] != MAGIC:
        raise ConfigError(f"not a packed kvlab replay: {len(data)} bytes starting {data[:4]!r}, expected {MAGIC!r}")
    _, every, total = HEAD.unpack_from(data)
    if every < 1 or total < 1:
        raise ConfigError(f"a packed replay keeps every {every} of {total} frames: both must be >= 1")
    inflate = zlib.decompressobj()
    try:
        body = inflate.decompress(data[HEAD.size:], UNPACKED_LIMIT)
    except zlib.error as e:
        raise ConfigError(f"a packed replay's frames do not decompress: {e}") from None
    if inflate.unconsumed_tail:
        raise ConfigError(f"a packed replay's frames inflate past {UNPACKED_LIMIT:,} bytes")
    if not inflate.eof or inflate.unused_data:
        raise ConfigError("a packed replay's frames are cut short" if not inflate.eof else
                          f"a packed replay has {len(inflate.unused_data):,} bytes after its frames")
    frames: list[bytes] = []
    at = 0
    while at < len(body):
        if at + LENGTH.size > len(body):
            raise ConfigError(f"a packed replay ends inside the length of frame {len(frames)}")
        (n,), at = LENGTH.unpack_from(body, at), at + LENGTH.size
        if at + n > len(body):
            raise ConfigError(f"frame {len(frames)} of a packed replay claims {n:,} bytes; {len(body) - at:,} are left")
        try:
            decode_frame(body[at:at + n])
        except ConfigError as e:
            raise ConfigError(f"frame {len(frames)} of a packed replay is not valid: {e}") from None
        frames.append(body[at:at + n])
        at += n
    if len(frames) != len(kept(total, every)):
        raise ConfigError(f"a packed replay keeping every {every} of {total} frames should hold "
                          f"{len(kept(total, every))}, holds {len(frames)}")
    return frames, every, total


__all__ = ["REPLAY_BYTES", "kept", "layout_js", "pack_frames", "unpack_frames"]
