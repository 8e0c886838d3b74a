"""The KV connector does not trust its peer: every control message is checked (``check_announce``,
``check_plan``, ``check_segments``, ``Link.recv_json``) before any byte of K/V lands; what fails is a
``ProtocolError`` and the step's sequences are given back. Generated hostile values for the checks, then hostile
peers: as a thread of this process for a grid of lies, and as a second process."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.distributed import (KVSender, ProtocolError, RemoteRequest, decode_rank, make_manager, run_threads,
                               spawn)
from kvlab.distributed.connector import (MAX_SEGMENTS, TAG_ANNOUNCE, TAG_PLAN, TAG_SEGMENTS, check_announce,
                                         check_plan, check_segments)
from kvlab import TinyConfig

CFG = TinyConfig()
PROMPT = list(range(1, 41))  # 40 tokens: 3 blocks of 16 on the receiver

json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(value=json_values | st.lists(st.lists(json_values, min_size=4, max_size=4), max_size=3))
def test_an_announce_is_requests_or_a_protocol_error(value):
    try:
        got = check_announce(value)
    except ProtocolError:
        return
    assert all(isinstance(r, RemoteRequest) and r.prompt and type(r.first_token) is int for r in got)


@settings(max_examples=300, deadline=None)
@given(value=json_values | st.fixed_dictionaries({"starts": json_values, "runs": json_values}),
       lengths=st.lists(st.integers(1, 50), min_size=1, max_size=4), rows=st.none() | st.integers(0, 200))
def test_a_plan_is_starts_and_runs_or_a_protocol_error(value, lengths, rows):
    try:
        starts, theirs = check_plan(value, lengths, rows)
    except ProtocolError:
        return
    assert len(starts) == len(lengths) and all(0 <= s < n for s, n in zip(starts, lengths))
    assert theirs is None or (all(k >= 1 for k in theirs) and (rows is None or sum(theirs) == rows))


def _consecutive(rows: list[int]) -> bool:
    return all(b - a == 1 for a, b in zip(rows, rows[1:]))


@settings(max_examples=500, deadline=None)
@given(flat=st.lists(st.integers(0, 40), min_size=1, max_size=24, unique=True), direct=st.booleans(),
       value=st.lists(st.integers(-2, 30) | st.booleans() | st.floats(0, 5), max_size=10) | json_values)
def test_segments_cover_every_row_once_each_inside_one_run_or_are_refused(flat, direct, value):
    """Against an independent check: the pieces tile the rows in order, and in place (``direct``) each piece's
    rows are consecutive ids, one slice of the pool (the receiver whose blocks are [3, 1, 5] and was sent one
    3-row segment wrote block 4 and never block 1)."""
    try:
        pieces = check_segments(value, flat, direct)
    except ProtocolError:
        ok = (isinstance(value, list) and all(type(v) is int and v >= 1 for v in value) and sum(value) == len(flat)
              and len(value) < MAX_SEGMENTS)
        if ok and direct:
            at, ok = 0, True
            for k in value:
                ok = ok and _consecutive(flat[at:at + k])
                at += k
        assert not ok, (value, flat, direct)  # refused only what is wrong
        return
    assert [a for a, _ in pieces] == [sum(k for _, k in pieces[:i]) for i in range(len(pieces))]
    assert sum(k for _, k in pieces) == len(flat)
    if direct:
        assert all(_consecutive(flat[a:a + k]) for a, k in pieces)


def test_the_reported_case_three_scattered_blocks_one_segment():
    with pytest.raises(ProtocolError, match="spans two runs"):
        check_segments([3], [3, 1, 5], True)
    assert check_segments([3], [3, 1, 5], False) == [(0, 3)]  # staged: copied row by row, wherever they lie


# ---------------------------------------------------------------- hostile peers
def _raw(link, data: bytes, dst: int, tag: int, length: int | None = None) -> None:
    """Send ``data`` as a control message would go, announcing ``length`` bytes (default: the true length)."""
    link.send(link.control([len(data) if length is None else length]), dst, tag)
    if data and length is None:
        link.send(link.control(torch.frombuffer(bytearray(data), dtype=torch.uint8), torch.uint8), dst, tag)


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


ANNOUNCE = [[0, PROMPT, 7, None]]
LIES = {  # where the lie comes, and what is sent there
    "announce not UTF-8": ("announce", b"\xff\xfe[]", None),
    "announce length -1": ("announce", b"", -1),
    "announce length 2**40": ("announce", b"", 2**40),
    "announce nested": ("announce", b"[" * 100_000 + b"]" * 100_000, None),
    "announce prompt of strs": ("announce", _json([[0, ["a", "b"], 7, None]]), None),
    "announce bool id": ("announce", _json([[True, PROMPT, 7, None]]), None),
    "announce tenant no text": ("announce", _json([[0, PROMPT, 7, 5]]), None),
    "announce twice the id": ("announce", _json([[0, PROMPT, 7, None], [0, PROMPT, 7, None]]), None),
    "segments not a list": ("segments", _json({"n": 40}), None),
    "segments short": ("segments", _json([39]), None),
    "segments long": ("segments", _json([41]), None),
    "segments zero": ("segments", _json([0, 40]), None),
    "segments -1 and 41": ("segments", _json([-1, 41]), None),
    "segments floats": ("segments", _json([20.0, 20.0]), None),
    "segments too many": ("segments", _json([1] * 40 + [0] * 4096), None),
    "segments length 2**40": ("segments", b"", 2**40),
}


def _liar(link, where, data, length):
    """A prefill rank that tells one lie: in its announce, or in its cut of the rows into segments."""
    KVSender(link, make_manager(CFG, 16, 64), 1)  # the handshake: the same KV layout on both ranks
    if where == "announce":
        _raw(link, data, 1, TAG_ANNOUNCE, length)
        return "lied"
    link.send_json(ANNOUNCE, 1, TAG_ANNOUNCE)
    link.recv_json(1, TAG_PLAN)
    _raw(link, data, 1, TAG_SEGMENTS, length)
    return "lied"


def _receiver(link):
    manager = make_manager(CFG, 16, 64)
    free = manager.pool.num_free_blocks
    try:
        decode_rank(link, manager=manager, max_new_tokens=2)
        error = None
    except ProtocolError as e:
        error = str(e)
    manager.check_invariants()
    return {"error": error, "live": len(manager), "free": manager.pool.num_free_blocks == free}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_lying_sender_is_a_protocol_error_and_the_receiver_gives_back_its_blocks(lie):
    where, data, length = LIES[lie]
    _, got = run_threads([_liar, _receiver], [{"where": where, "data": data, "length": length}, {}], timeout=5)
    assert got["error"] is not None and len(got["error"]) < 400, got
    assert got["live"] == 0 and got["free"], got


def test_a_lying_sender_in_another_process():
    """The same from a second process (the receiver in a third): segments that do not cover its rows."""
    _, got = spawn([_liar, _receiver], [{"where": "segments", "data": _json([1, 1]), "length": None}, {}],
                   timeout=10)
    assert "do not cover them once" in got["error"] and got["live"] == 0 and got["free"]
