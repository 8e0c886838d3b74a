"""KV cache events on the wire, as vLLM and SGLang publish them for KV-aware routers, decoded and encoded.

The idea: a serving engine sends one ZeroMQ message per engine step that changed its prefix cache, three frames
``[topic, seq, payload]``: ``seq`` counts messages as 8 bytes big-endian, ``payload`` is one msgpack
``KVEventBatch``, the positional array ``[ts, events, data_parallel_rank]``. Each event is tagged by its class
name and comes in one of two encodings:

* a map, ``{"type": "BlockStored", "block_hashes": [...], ...}``: vLLM from 0.24.0 on (0.34.0's ``KVCacheEvent``
  has ``tag=True`` and no ``array_like``);
* a positional array, ``["BlockStored", [...], parent, ...]``, every declared field in order (msgspec's
  ``omit_defaults`` leaves nothing out of an array): vLLM up to 0.23.0 and SGLang (their ``KVCacheEvent`` has
  ``array_like=True``). SGLang calls the batch's third
  field ``attn_dp_rank`` and sends fewer fields (``BlockStored`` stops at ``medium``, ``BlockRemoved`` has
  ``block_hashes`` and ``medium``); by position they are the same.

:func:`decode_batch` reads both, events of both kinds in one batch included. Its fast path is msgspec's typed
decoder for a batch all of one encoding with no field it does not know; anything else (a newer release's field,
an event type it does not know, one event it cannot read) takes the tolerant path, which keeps every event it can
read and counts what it skipped in ``notes``. Only a payload that is no batch at all, or over the size cap, is an
error (:class:`~kvlab.core.errors.KVEventError`). :func:`encode_batch` writes vLLM 0.34.0's bytes exactly: the
fields vLLM declares without a default always, the others only when set (its ``omit_defaults``).

Block hashes are ints (vLLM's default since ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the hash's low 64 bits)
or bytes (the full hash); both are kept as they came.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Union

import msgspec

from kvlab.core.errors import KVEventError

BlockHash = Union[int, bytes]
MAX_PAYLOAD = 64 << 20  # bytes: a step that stores 4 million token ids; a bigger payload is refused unread
END_SEQ = -1  # the seq of the replay service's end marker
MAX_NOTES = 64  # distinct things a Counter of notes tells apart (a hostile stream must not grow it without end)


class BlockStored(msgspec.Struct, tag=True, forbid_unknown_fields=True, gc=False):
    """Full blocks entered the prefix cache: a chain, ``block_hashes[0]`` on ``parent_block_hash`` (None: a
    prompt's first block) and each next one on the one before; ``token_ids`` are all their tokens, in order,
    ``block_size`` per block. The other fields as vLLM 0.34.0 names them (None where the sender has none)."""
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(msgspec.Struct, tag=True, forbid_unknown_fields=True, gc=False):
    """Blocks left the prefix cache (evicted, or their hash dropped)."""
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, forbid_unknown_fields=True, gc=False):
    """The prefix cache was reset: every block it named is gone."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
EVENT_TYPES: tuple[type[KVEvent], ...] = (BlockStored, BlockRemoved, AllBlocksCleared)
_BY_NAME: dict[str, type[KVEvent]] = {t.__name__: t for t in EVENT_TYPES}
# What vLLM 0.34.0 declares without a default, so writes even when None (the rest only when set): its
# kv_events.py, BlockStored lines 57-68, BlockRemoved lines 124-125.
_ALWAYS = {BlockStored: frozenset(("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                   "medium", "lora_name")),
           BlockRemoved: frozenset(("block_hashes", "medium")), AllBlocksCleared: frozenset()}


class KVEventBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """One engine step's events: ``ts`` (the sender's ``time.time()``), the events in order, and the
    data-parallel rank that sent them (None when the sender leaves it out)."""
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# The positional encoding, for the fast path only: the same fields read by position, then made the types above.
class _StoredArray(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _RemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    ts: float
    events: list[Union[_StoredArray, _RemovedArray, _ClearedArray]]
    data_parallel_rank: int | None = None


_MAP_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_ARRAY_DECODER = msgspec.msgpack.Decoder(_ArrayBatch)
_ANY_DECODER = msgspec.msgpack.Decoder()
_ENCODER = msgspec.msgpack.Encoder()
_CANONICAL = {_StoredArray: BlockStored, _RemovedArray: BlockRemoved, _ClearedArray: AllBlocksCleared}


def decode_batch(payload: bytes, *, max_bytes: int = MAX_PAYLOAD, notes: Counter[str] | None = None) -> KVEventBatch:
    """The batch in ``payload`` (either encoding, vLLM's or SGLang's). What it had to skip is counted in ``notes``
    (``"unknown event type X"``, ``"unknown field BlockStored.x"``, ``"unreadable BlockStored"``...);
    :class:`KVEventError` for a payload over ``max_bytes`` or one that is no batch."""
    if len(payload) > max_bytes:
        raise KVEventError(f"a KV event payload of {len(payload):,} bytes is over the cap of {max_bytes:,} bytes "
                           f"(max_bytes)")
    try:
        return _MAP_DECODER.decode(payload)
    except msgspec.DecodeError:
        pass
    try:
        got = _ARRAY_DECODER.decode(payload)
        return KVEventBatch(got.ts, [_CANONICAL[type(e)](*msgspec.structs.astuple(e)) for e in got.events],
                            got.data_parallel_rank)
    except msgspec.DecodeError:
        return _tolerant(payload, notes if notes is not None else Counter())


def _tolerant(payload: bytes, notes: Counter[str]) -> KVEventBatch:
    """The slow path: read the payload as plain msgpack, keep each event that is readable."""
    try:
        raw = _ANY_DECODER.decode(payload)
    except msgspec.DecodeError as e:
        raise KVEventError(f"a KV event payload of {len(payload):,} bytes is not msgpack ({e}): "
                           f"{bytes(payload[:24])!r}") from None
    if not (isinstance(raw, list) and 2 <= len(raw) and isinstance(raw[1], list)
            and isinstance(raw[0], (int, float)) and not isinstance(raw[0], bool)):
        raise KVEventError(f"a KV event payload must be a batch [ts, events, data_parallel_rank], got "
                           f"{_shown(raw)}")
    rank = raw[2] if len(raw) > 2 else None
    if rank is not None and (type(rank) is not int):
        note(notes, "unreadable data_parallel_rank")
        rank = None
    if len(raw) > 3:
        note(notes, "unknown field KVEventBatch[3]", len(raw) - 3)
    events = [e for e in (_event(item, notes) for item in raw[1]) if e is not None]
    return KVEventBatch(float(raw[0]), events, rank)


def _event(item: object, notes: Counter[str]) -> KVEvent | None:
    """One event of either encoding, or None (counted in ``notes``)."""
    if isinstance(item, dict):
        name, fields = item.get("type"), {k: v for k, v in item.items() if k != "type"}
    elif isinstance(item, list) and item:
        name, fields = item[0], None
    else:
        note(notes, f"unreadable event {_shown(item, 30)}")
        return None
    kind = _BY_NAME.get(name) if isinstance(name, str) else None
    if kind is None:
        note(notes, f"unknown event type {_shown(name, 40)}")
        return None
    known = kind.__struct_fields__
    if fields is None:  # positional: field i is at i + 1
        assert isinstance(item, list)
        fields = dict(zip(known, item[1:]))
        if len(item) - 1 > len(known):
            note(notes, f"unknown field {name}[{len(known)}]", len(item) - 1 - len(known))
    for extra in [k for k in fields if k not in known]:
        note(notes, f"unknown field {name}.{extra[:40] if isinstance(extra, str) else _shown(extra, 40)}")
        del fields[extra]
    try:
        return msgspec.convert(fields, kind)
    except msgspec.ValidationError as e:
        note(notes, f"unreadable {name} ({e})")
        return None


def note(notes: Counter[str], what: str, n: int = 1) -> None:
    """Count ``what`` in ``notes``; past :data:`MAX_NOTES` distinct notes, under ``"other"``."""
    notes[what if what in notes or len(notes) < MAX_NOTES else "other"] += n


def _shown(v: object, limit: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def encode_batch(batch: KVEventBatch) -> bytes:
    """``batch`` in vLLM 0.34.0's bytes: a positional batch (all three fields, a rank of None too) of map-encoded
    events, each written by a struct declared as vLLM declares it (:func:`_as_vllm`), so that msgspec lays out
    the bytes as for vLLM's own."""
    events = [_VLLM[type(e)](*msgspec.structs.astuple(e)) for e in batch.events]
    return _ENCODER.encode([batch.ts, events, batch.data_parallel_rank])


def _as_vllm(kind: type[KVEvent]) -> type[msgspec.Struct]:
    """``kind``'s fields with vLLM 0.34.0's required-ness (:data:`_ALWAYS`) and its ``omit_defaults``: the
    fields it declares without a default are written always, the others only when set."""
    always = _ALWAYS[kind]
    fields = [(f.name, f.type) if f.name in always else (f.name, f.type, None) for f in msgspec.structs.fields(kind)]
    return msgspec.defstruct(kind.__name__, fields, tag=kind.__name__, omit_defaults=True, gc=False)


_VLLM = {kind: _as_vllm(kind) for kind in EVENT_TYPES}


def event_map(event: KVEvent) -> dict[str, Any]:
    """``event`` as a map under vLLM's names, ``"type"`` first, every field."""
    return {"type": type(event).__name__, **msgspec.structs.asdict(event)}


def split_message(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of a published message; :class:`KVEventError` unless it is three frames with
    an 8-byte seq >= 0."""
    if len(frames) != 3:
        raise KVEventError(f"a KV event message is 3 frames [topic, seq, payload], got {len(frames)} frames "
                           f"{_shown([bytes(f[:16]) for f in frames[:4]])}")
    topic, seq, payload = frames
    return topic, _seq(seq, allow_end=False), payload


def split_replay(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of one reply of a replay service, as a DEALER receives it: vLLM's
    ``[b"", topic, seq, payload]`` or SGLang's ``[b"", seq, payload]`` (topic ``b""``); seq :data:`END_SEQ` ends
    the replay."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise KVEventError(f"a replay reply is [b'', topic, seq, payload] (vLLM) or [b'', seq, payload] (SGLang), "
                           f"got {len(frames)} frames {_shown([bytes(f[:16]) for f in frames[:5]])}")
    return frames[1] if len(frames) == 4 else b"", _seq(frames[-2], allow_end=True), frames[-1]


def _seq(raw: bytes, *, allow_end: bool) -> int:
    if len(raw) != 8:
        raise KVEventError(f"a KV event seq is 8 bytes big-endian, got {len(raw)} bytes {bytes(raw[:16])!r}")
    seq = int.from_bytes(raw, "big", signed=True)
    if seq < 0 and not (allow_end and seq == END_SEQ):
        raise KVEventError(f"a KV event seq counts from 0, got {seq}")
    return seq


def seq_bytes(seq: int) -> bytes:
    """``seq`` as it travels: 8 bytes big-endian (:data:`END_SEQ` as vLLM writes it, two's complement)."""
    return seq.to_bytes(8, "big", signed=True)


__all__ = ["AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored", "END_SEQ", "EVENT_TYPES", "KVEvent",
           "KVEventBatch", "MAX_PAYLOAD", "decode_batch", "encode_batch", "event_map", "note", "seq_bytes",
           "split_message", "split_replay"]
