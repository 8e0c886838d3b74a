"""kvlab.kvevents.wire against the engines' own bytes (tests/fixtures/kv_events, made by vLLM's and SGLang's code),
and against what a stream may hold that no engine sends on purpose."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from kvlab.core.errors import KVEventError
from kvlab.kvevents import wire
from kvlab.kvevents.wire import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch,
                                 encode_batch, event_map, split_message, split_replay)

HERE = Path(__file__).parent / "fixtures" / "kv_events"
sys.path.insert(0, str(HERE))
from make_fixtures import plain  # noqa: E402  (values as expected.json writes them, by the script that wrote it)
EXPECTED = json.loads((HERE / "expected.json").read_text())
pack = msgspec.msgpack.encode



@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_engines_payload_decodes_to_what_its_code_put_in(name):
    want = EXPECTED[name]
    notes: Counter[str] = Counter()
    batch = decode_batch((HERE / name).read_bytes(), notes=notes)
    assert notes == Counter()
    assert (batch.ts, batch.data_parallel_rank) == (want["ts"], want["data_parallel_rank"])
    assert len(batch.events) == len(want["events"])
    for got, exp in zip(batch.events, want["events"]):
        fields = plain(event_map(got))
        assert {k: fields[k] for k in exp} == exp  # every field the producer has, under its name
        assert all(fields[k] is None for k in set(fields) - set(exp))  # the rest (SGLang has fewer): unset


def test_the_fixtures_cover_both_encodings_and_both_engines():
    assert {(w["producer"].split()[0], w["encoding"]) for w in EXPECTED.values()} == {
        ("vllm", "map"), ("vllm", "array"), ("sglang", "array")}
    assert "vllm-0.23.0-basic.array.msgpack" in EXPECTED  # positional bytes from a release that sent them


@pytest.mark.parametrize("case", ["basic", "full", "bare"])
def test_kvlab_writes_vllm_0_34s_bytes_exactly(case):
    sent = (HERE / f"vllm-0.34.0-{case}.map.msgpack").read_bytes()
    assert encode_batch(decode_batch(sent)) == sent
    # the positional encoding of the same events is re-written in 0.34.0's
    assert encode_batch(decode_batch((HERE / f"vllm-0.34.0-{case}.array.msgpack").read_bytes())) == sent


def test_vllm_0_23s_positional_bytes_hold_the_same_events_as_0_34s_maps():
    old = (HERE / "vllm-0.23.0-basic.array.msgpack").read_bytes()
    assert decode_batch(old) == decode_batch((HERE / "vllm-0.34.0-basic.map.msgpack").read_bytes())
    assert len(msgspec.msgpack.decode(old)[1][0]) == 12  # 0.23.0's BlockStored: the tag and 11 fields


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_fast_and_the_tolerant_path_agree(name):
    data = (HERE / name).read_bytes()
    assert wire._tolerant(data, Counter()) == decode_batch(data)


def stored(n=1):
    return BlockStored(list(range(1, n + 1)), None, list(range(4 * n)), 4, None, "GPU", None, group_idx=0)


def as_map(e):
    return msgspec.msgpack.decode(encode_batch(KVEventBatch(0.0, [e])))[1][0]


def as_array(e):
    return [type(e).__name__, *msgspec.structs.astuple(e)]


def test_one_batch_may_mix_both_encodings():
    removed = BlockRemoved([9], "CPU", 1)
    batch = decode_batch(pack([1.5, [as_map(stored()), as_array(removed), ["AllBlocksCleared"]], 3]))
    assert batch == KVEventBatch(1.5, [stored(), removed, AllBlocksCleared()], 3)


def test_unknown_event_types_and_fields_are_skipped_and_counted():
    notes: Counter[str] = Counter()
    future = {**as_map(BlockRemoved([5], "GPU")), "priority": 3}
    batch = decode_batch(pack([2.0, [{"type": "BlockPinned", "block_hashes": [1]}, future,
                                     [*as_array(BlockRemoved([6])), "x", "y"], ["BlockMoved", 1]], 0, "extra"]),
                         notes=notes)
    assert batch.events == [BlockRemoved([5], "GPU"), BlockRemoved([6])]
    assert notes == Counter({"unknown event type 'BlockPinned'": 1, "unknown event type 'BlockMoved'": 1,
                             "unknown field BlockRemoved.priority": 1, "unknown field BlockRemoved[5]": 2,
                             "unknown field KVEventBatch[3]": 1})


def test_unreadable_events_are_skipped_and_counted_the_rest_kept():
    notes: Counter[str] = Counter()
    batch = decode_batch(pack([0, [{"type": "BlockStored", "block_hashes": "nope"}, 42, [], {"no": "type"},
                                   as_map(stored())], "rank?"]), notes=notes)
    assert batch == KVEventBatch(0.0, [stored()], None)
    assert sum(notes.values()) == 5 and notes["unreadable data_parallel_rank"] == 1
    assert any(k.startswith("unreadable BlockStored (") for k in notes)
    assert notes["unknown event type None"] == 1


def test_notes_stay_bounded_whatever_a_stream_holds():
    notes: Counter[str] = Counter()
    decode_batch(pack([0, [{"type": f"T{i}"} for i in range(500)]]), notes=notes)
    assert len(notes) == wire.MAX_NOTES + 1 and notes["other"] == 500 - wire.MAX_NOTES


@pytest.mark.parametrize("payload, says", [
    (b"", "not msgpack"),
    (b"\xc1", "not msgpack"),
    ((HERE / "vllm-0.34.0-basic.map.msgpack").read_bytes()[:-5], "not msgpack"),  # truncated
    (pack({"ts": 1}), "must be a batch"),
    (pack([1.0]), "must be a batch"),
    (pack(["x", []]), "must be a batch"),
    (pack([True, []]), "must be a batch"),
    (pack([1.0, {}]), "must be a batch"),
])
def test_a_payload_that_is_no_batch_is_a_typed_error_naming_it(payload, says):
    with pytest.raises(KVEventError, match=says):
        decode_batch(payload)


def test_a_payload_over_the_cap_is_refused_unread():
    data = (HERE / "vllm-0.34.0-full.map.msgpack").read_bytes()
    with pytest.raises(KVEventError, match=f"{len(data)} bytes is over the cap of 100 bytes"):
        decode_batch(data, max_bytes=100)
    assert decode_batch(data, max_bytes=len(data)).events


@pytest.mark.parametrize("frames, says", [
    ([b"t", b"\0" * 8], "got 2 frames"),
    ([b"t", b"\0" * 8, b"p", b"q"], "got 4 frames"),
    ([b"t", b"\0" * 7, b"p"], "8 bytes big-endian, got 7 bytes"),
    ([b"t", b"\0" * 9, b"p"], "got 9 bytes"),
    ([b"t", (-1).to_bytes(8, "big", signed=True), b"p"], "counts from 0, got -1"),
])
def test_malformed_messages_are_typed_errors(frames, says):
    with pytest.raises(KVEventError, match=says):
        split_message(frames)


def test_a_message_splits_into_topic_seq_payload():
    assert split_message([b"kv", (2**40 + 3).to_bytes(8, "big"), b"p"]) == (b"kv", 2**40 + 3, b"p")


def test_replay_replies_of_both_engines_split_and_end_at_seq_minus_one():
    end = (-1).to_bytes(8, "big", signed=True)
    assert split_replay([b"", b"topic", (7).to_bytes(8, "big"), b"p"]) == (b"topic", 7, b"p")  # vLLM's
    assert split_replay([b"", (7).to_bytes(8, "big"), b"p"]) == (b"", 7, b"p")  # SGLang's: no topic
    assert split_replay([b"", b"", end, b""]) == (b"", wire.END_SEQ, b"")
    assert split_replay([b"", end, b""]) == (b"", wire.END_SEQ, b"")
    for bad in ([b"", b"p"], [b"x", b"t", (1).to_bytes(8, "big"), b"p"], [b"", b"t", b"\0", b"p"]):
        with pytest.raises(KVEventError):
            split_replay(bad)


def test_event_map_uses_vllms_field_names():
    full = decode_batch((HERE / "vllm-0.34.0-full.map.msgpack").read_bytes())
    sent = msgspec.msgpack.decode((HERE / "vllm-0.34.0-full.map.msgpack").read_bytes())[1]
    for got, raw in zip(full.events, sent):
        assert list(event_map(got)) == list(raw)  # every field set here: the same names in the same order
