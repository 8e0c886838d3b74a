"""Trace files under hostile input: any valid workload round-trips in both formats, and every malformed trace
raises TraceFormatError naming the file and the 1-based line of the first bad record (never another error)."""
from __future__ import annotations

import csv
import gzip
import io
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvlab import ConfigError, Request, TraceFormatError, Workload, load_trace, read_trace, write_trace
from kvlab.workloads.traces import DATA, TRACES
from kvlab.workloads.mixes import FIELDS, HASH_ID_MAX, INT_MAX, _csv_rows

BIG = tuple(np.random.default_rng(7).integers(0, INT_MAX + 1, 30_000).tolist())  # a 180 KiB CSV cell


# ---------------------------------------------------------------------------------------------------- round trip
# Text that CSV and JSON must quote or escape, and text that splits lines in some readers but not in ours.
NASTY = st.sampled_from([",", '"', '""', "\n", "\r", "\r\n", " ", "\t", "\x00", "#", "é", "中文", "😀", "\u2028",
                         "\x85", "\x0c", "\ufeff", "null", "1,2", '"a,b"'])
NAMES = st.lists(NASTY | st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=4),
                 min_size=1, max_size=5).map("".join)
LENGTHS = st.integers(0, 50) | st.integers(0, INT_MAX) | st.sampled_from([0, 1, INT_MAX])


@st.composite
def workloads(draw) -> Workload:
    prefixes = draw(st.dictionaries(NAMES, st.integers(1, 40) | st.integers(1, INT_MAX), max_size=3))
    ids = draw(st.lists(st.integers(0, INT_MAX), min_size=1, max_size=8, unique=True))
    reqs = []
    for i in ids:
        pid = draw(st.sampled_from([None, *prefixes]))
        plen = prefixes.get(pid, 0)
        toks = None
        if plen <= 40 and draw(st.booleans()):
            n = draw(st.integers(max(plen, 1), 40))
            toks = tuple(draw(st.lists(st.integers(0, INT_MAX), min_size=n, max_size=n)))
        elif plen == 0 and draw(st.integers(0, 9)) == 0:  # now and then a long one, from a seed
            n, seed = draw(st.integers(1, 30_000)), draw(st.integers(0, 2**32))
            toks = tuple(np.random.default_rng(seed).integers(0, INT_MAX + 1, n).tolist())
        prompt_len = len(toks) if toks is not None else draw(st.integers(max(plen, 1), INT_MAX))
        hashes = None
        if pid is None and toks is None and draw(st.integers(0, 3)) == 0:  # a Mooncake-style prompt
            prompt_len = draw(st.integers(1, 5000))
            hashes = tuple(draw(st.lists(st.integers(0, HASH_ID_MAX), min_size=-(-prompt_len // 512),
                                         max_size=-(-prompt_len // 512))))
        arrival = draw(st.floats(0, allow_nan=False, allow_infinity=False) | st.integers(0, 10**6))
        reqs.append(Request(i, arrival, prompt_len, draw(LENGTHS), draw(NAMES | st.just("default")), pid, plen,
                            toks, hashes))
    return Workload(draw(st.sampled_from(["w", "trace-1"])), reqs)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(w=workloads(), suffix=st.sampled_from([".jsonl", ".csv"]))
@example(w=Workload("w", [Request(3, 0.25, len(BIG), 7, 'a,"b"\nc', "sys,\"1\"", 5, BIG)]), suffix=".csv")
@example(w=Workload("w", [Request(3, 0.25, len(BIG), 7, 'a,"b"\nc', "sys,\"1\"", 5, BIG)]), suffix=".jsonl")
@example(w=Workload("w", [Request(0, 0.0, 1, 0, ",", "\x00", 1)]), suffix=".csv")  # NUL: Python 3.10's writer
def test_any_workload_round_trips(tmp_path_factory, w, suffix):
    path = tmp_path_factory.mktemp("rt") / f"{w.name}{suffix}"
    limit = csv.field_size_limit()
    back = read_trace(write_trace(w, path))
    assert back.name == w.name and back.requests == w.requests
    assert [type(r.arrival) for r in back] == [float] * len(back)
    assert csv.field_size_limit() == limit  # the reader leaves the process-wide csv state alone


def test_a_30000_token_prompt_reads_back_whatever_the_csv_limit(tmp_path):
    w = Workload("big", [Request(0, 0.0, len(BIG), 1, prompt_tokens=BIG), Request(1, 1.0, 4, 1)])
    path = write_trace(w, tmp_path / "big.csv")
    old = csv.field_size_limit(1000)  # someone else's setting: not ours to rely on or change
    try:
        assert read_trace(path).requests == w.requests
        assert csv.field_size_limit() == 1000
    finally:
        csv.field_size_limit(old)


def test_a_name_utf8_cannot_encode_is_refused_when_read(tmp_path):
    """A lone surrogate is valid JSON (``"\\ud800"``) but no text: it could not be hashed as a tenant's salt or
    written back. It is refused where it enters, naming the line, not at admission long after."""
    with pytest.raises(ConfigError, match="UTF-8"):
        Request(0, 0.0, 2, 1, tenant="bad\ud800")
    with pytest.raises(ConfigError, match="UTF-8"):
        Request(0, 0.0, 2, 1, prefix_id="p\udfff", prefix_len=1)
    path = tmp_path / "s.jsonl"
    path.write_text('{"id":0,"arrival":0.0,"prompt_len":2,"output_len":1}\n'
                    '{"id":1,"arrival":0.0,"prompt_len":2,"output_len":1,"tenant":"bad\\ud800"}\n')
    with pytest.raises(TraceFormatError, match=r"line 2: .*UTF-8"):
        read_trace(path)


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.lists(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                                      max_size=6), min_size=1, max_size=5), max_size=6),
       eol=st.sampled_from(["\r\n", "\n", "\r"]), quote_all=st.booleans())
def test_csv_reader_reads_what_csv_writer_writes(rows, eol, quote_all):
    out = io.StringIO()
    # csv.writer quotes only the characters of its own line end: with "\n" it leaves a "\r" bare (and its reader
    # then splits there too), so other line ends are tried with every cell quoted
    quoting = csv.QUOTE_ALL if quote_all or eol != "\r\n" else csv.QUOTE_MINIMAL
    csv.writer(out, lineterminator=eol, quoting=quoting).writerows(rows)
    text = out.getvalue()
    ours = list(_csv_rows(text, "t.csv"))
    reader = csv.reader(io.StringIO(text, newline=""))
    theirs, starts, line = [], [], 0
    for row in reader:
        theirs.append(row)
        starts.append(line + 1)
        line = reader.line_num
    assert [cells for _, cells in ours] == theirs
    assert [first for first, _ in ours] == starts


# ---------------------------------------------------------------------------------------------------- JSONL grid
BASE = {"id": 7, "arrival": 1.5, "prompt_len": 8, "output_len": 2}
BAD_INT = [True, False, 8.0, 8.5, "8", [8], {"v": 8}, -1, 2**31, 2**63, 2**70, 10**30, "NaN", "Infinity"]


def _json_lines(out: list[tuple[str, dict]]) -> list[tuple[str, bytes]]:
    """Each named record as one JSON line, with the non-finite spellings JSON has unquoted."""
    cases = []
    for cid, rec in out:
        text = json.dumps(rec)
        for token in ("NaN", "Infinity", "-Infinity", "1e999"):  # JSON spellings json.dumps would quote
            text = text.replace(f'"{token}"', token)
        cases.append((cid, text.encode()))
    return cases


def _jsonl_field_cases():
    """(case id, raw JSON text of the record) for every wrong value of every field."""
    out = []
    for name in ("id", "prompt_len", "output_len"):
        for v in [*BAD_INT, None, *([0] if name == "prompt_len" else [])]:
            out.append((f"{name}={v!r}", {**BASE, name: v}))
    for v in [*BAD_INT, 0, 9]:  # 0 with a prefix id, 9 > prompt_len
        out.append((f"prefix_len={v!r}", {**BASE, "prefix_id": "p", "prefix_len": v}))
    out.append(("prefix_len without prefix_id", {**BASE, "prefix_len": 3}))
    out.append(("prefix_id, prefix_len null", {**BASE, "prefix_id": "p", "prefix_len": None}))
    for v in [True, "1.5", -1, -0.5, None, [1], "NaN", "Infinity", "-Infinity", 10**400, "1e999"]:
        out.append((f"arrival={v!r}", {**BASE, "arrival": v}))
    for v in [5, True, "", [], {}]:
        out.append((f"tenant={v!r}", {**BASE, "tenant": v}))
    for v in [5, "", True, []]:
        out.append((f"prefix_id={v!r}", {**BASE, "prefix_id": v, "prefix_len": 3}))
    for v in ["1 2 3 4 5 6 7 8", [1] * 7, [1] * 9, [1.0] * 8, [-1] + [1] * 7, [INT_MAX + 1] + [1] * 7,
              [True] * 8, [None] * 8, 5, {}, [[1]] * 8]:
        out.append((f"prompt_tokens={str(v)[:20]}", {**BASE, "prompt_tokens": v}))
    for v in [[True], [1.0], ["1"], [[1]], [None], [-1], [HASH_ID_MAX + 1], [2**63], [], [1, 2], 5, "1", {}]:
        out.append((f"hash_ids={str(v)[:20]}", {**BASE, "hash_ids": v}))
    out.append(("hash_ids with prefix_id", {**BASE, "hash_ids": [1], "prefix_id": "p", "prefix_len": 3}))
    out.append(("hash_ids with prompt_tokens", {**BASE, "hash_ids": [1], "prompt_tokens": [1] * 8}))
    out.append(("unknown field", {**BASE, "priority": 1}))
    out.append(("missing field", {k: v for k, v in BASE.items() if k != "output_len"}))
    return _json_lines(out)


JSONL_SYNTAX = [
    ("truncated", b'{"id": 7, "arrival": 1.5,'),
    ("trailing text", json.dumps(BASE).encode() + b" x"),
    ("two objects", json.dumps(BASE).encode() * 2),
    ("array", b"[1, 2, 3]"),
    ("string", b'"id"'),
    ("number", b"7"),
    ("null", b"null"),
    ("deeply nested array", b"[" * 100_000),
    ("deeply nested field", b'{"id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("field twice", b'{"id": 7, "id": 8, "arrival": 1.5, "prompt_len": 8, "output_len": 2}'),
    ("5000 digits", b'{"id": ' + b"9" * 5000 + b', "arrival": 1.5, "prompt_len": 8, "output_len": 2}'),
    ("raw control character", b'{"id": 7, "arrival": 1.5, "prompt_len": 8, "output_len": 2, "tenant": "a\x01"}'),
    ("latin-1 byte", b'{"id": 7, "arrival": 1.5, "prompt_len": 8, "output_len": 2, "tenant": "caf\xe9"}'),
    ("lone continuation byte", b'\x80{"id": 7}'),
    ("truncated utf-8", b'{"id": 7, "tenant": "\xe4\xb8"}'),
    ("utf-16", json.dumps(BASE).encode("utf-16-le")),
]


def _good_jsonl(i: int) -> bytes:
    return json.dumps({"id": i, "arrival": float(i), "prompt_len": 8, "output_len": 2}).encode()


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("where", ["first", "later"])
@pytest.mark.parametrize("cid, bad", _jsonl_field_cases() + JSONL_SYNTAX, ids=lambda x: x if isinstance(x, str) else "")
def test_malformed_jsonl_names_the_line(tmp_path, cid, bad, where, eol):
    before = [] if where == "first" else [b"# a comment", _good_jsonl(1), b"", b"   ", _good_jsonl(2)]
    lines = [*before, bad, _good_jsonl(3), b'{"broken']  # a later error must not be the one reported
    path = tmp_path / "t.jsonl"
    path.write_bytes(eol.join(lines) + eol)
    with pytest.raises(TraceFormatError) as e:
        read_trace(path)
    line = len(before) + 1
    assert e.value.line == line and e.value.path == str(path), str(e.value)
    assert str(e.value).startswith(f"{path}, line {line}: ")


@pytest.mark.parametrize("lines, line, word", [
    ([_good_jsonl(1), _good_jsonl(2), _good_jsonl(1)], 3, "id 1 appears twice"),
    ([b'{"id": 1, "arrival": 0, "prompt_len": 8, "output_len": 1, "prefix_id": "p", "prefix_len": 2}',
      b'{"id": 2, "arrival": 0, "prompt_len": 8, "output_len": 1, "prefix_id": "p", "prefix_len": 3}'], 2,
     "prefix 'p'"),
    ([b"# nothing", b""], 1, "no request"),
    ([], 1, "no request"),
    ([_good_jsonl(1), _good_jsonl(1), b"{"], 2, "appears twice"),  # the first bad line wins, in order
])
def test_jsonl_relations_name_the_line(tmp_path, lines, line, word):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(TraceFormatError, match=word) as e:
        read_trace(path)
    assert e.value.line == line


def test_jsonl_nulls_bom_and_strict_types(tmp_path):
    path = tmp_path / "t.jsonl"
    rec = {**BASE, "tenant": None, "prefix_id": None, "prefix_len": None, "prompt_tokens": None}
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(rec).encode() + b"\n")  # a byte-order mark, then nulls
    assert read_trace(path).requests == [Request(7, 1.5, 8, 2)]
    path.write_bytes(json.dumps({**BASE, "arrival": 2}).encode())  # an int arrival is a number of seconds
    assert read_trace(path)[0].arrival == 2.0


# ---------------------------------------------------------------------------------------------------- CSV grid
HEADER = ",".join(FIELDS)
GOOD_ROW = dict(id="7", arrival="1.5", prompt_len="8", output_len="2", tenant="t", prefix_id="", prefix_len="",
                prompt_tokens="", hash_ids="")
CELL_INT = ["true", "8.0", "8.5", "nan", "inf", "abc", "1_0", "\u0663", "0x10", "1e3", "8 8", "--1",
            str(2**31), str(2**63), str(2**70), "9" * 5000, "00000000000000000000009999999999"]


def _csv_cell_cases():
    out = []
    for name in ("id", "prompt_len", "output_len"):
        for v in [*CELL_INT, "", "-1", *(["0"] if name == "prompt_len" else [])]:
            out.append((f"{name}={v[:12]!r}", {name: v}))
    for v in [*CELL_INT, "-1", "0", "9"]:
        out.append((f"prefix_len={v[:12]!r}", {"prefix_id": "p", "prefix_len": v}))
    out.append(("prefix_id without prefix_len", {"prefix_id": "p"}))
    out.append(("prefix_len without prefix_id", {"prefix_len": "3"}))
    for v in ["", "nan", "inf", "-inf", "-1", "-0.5", "abc", "1e999", "true", "0x10", "1_0", "1.5.5", "\u0661"]:
        out.append((f"arrival={v!r}", {"arrival": v}))
    for v in ["1 2 3", " ".join(["1"] * 9), " ".join(["1"] * 7 + ["x"]), " ".join(["-1"] + ["1"] * 7),
              " ".join(["1.0"] * 8), " ".join([str(INT_MAX + 1)] + ["1"] * 7), " ".join(["9" * 40] * 8),
              ",".join(["1"] * 8)]:
        out.append((f"prompt_tokens={v[:16]!r}", {"prompt_tokens": v}))
    for v in ["1 2", "-1", "x", "1.0", "true", str(HASH_ID_MAX + 1), "9" * 40, "1,2"]:
        out.append((f"hash_ids={v[:16]!r}", {"hash_ids": v}))
    out.append(("hash_ids with prompt_tokens", {"hash_ids": "1", "prompt_tokens": " ".join(["1"] * 8)}))
    rows = []
    for cid, change in out:
        cells = {**GOOD_ROW, **change}
        buf = io.StringIO()
        csv.writer(buf, lineterminator="").writerow([cells[f] for f in FIELDS])  # quoted as a writer would
        rows.append((cid, buf.getvalue().encode()))
    return rows


CSV_SYNTAX = [
    ("unterminated quote swallowing the next record", b'7,1.5,8,2,"abc,,,,'),
    ("stray quote in a cell", b'7,1.5,8,2,ab"c,,,,'),
    ("text after a closing quote", b'7,1.5,8,2,"ab"c,,,,'),
    ("escaped quote, never closed", b'7,1.5,8,2,"ab"",,,,'),
    ("too many cells", b"7,1.5,8,2,t,,,,,9"),
    ("latin-1 byte", b"7,1.5,8,2,caf\xe9,,,,"),
    ("bad byte in a number", b"7,1.\xff5,8,2,t,,,,"),
    ("a quoted cell over two lines, then a bad cell", b'7,1.5,8,2,"two\nlines",,x,,'),
    ("NUL in a number", b"7,1.5,8\x00,2,t,,,,"),
]


def _good_csv(i: int) -> bytes:
    return f"{i},{float(i)},8,2,t,,,,".encode()


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("where", ["first", "later"])
@pytest.mark.parametrize("cid, bad", _csv_cell_cases() + CSV_SYNTAX, ids=lambda x: x if isinstance(x, str) else "")
def test_malformed_csv_names_the_line(tmp_path, cid, bad, where, eol):
    before = [] if where == "first" else [_good_csv(1), b"", b'2,2.0,8,2,"multi\nline ""tenant""",,,,']
    lines = [HEADER.encode(), *before, bad, _good_csv(3), b'4,"']  # a later error must not be the one reported
    path = tmp_path / "t.csv"
    path.write_bytes(eol.join(lines) + eol)
    with pytest.raises(TraceFormatError) as e:
        read_trace(path)
    line = 2 + sum(1 + b.count(b"\n") for b in before)
    assert e.value.line == line and e.value.path == str(path), str(e.value)
    assert str(e.value).startswith(f"{path}, line {line}: ")


@pytest.mark.parametrize("text, line, word", [
    (b"", 1, "header"),
    (b"\n\n", 1, "header"),
    (b"id,arrival,prompt_len,output_len,colour\n7,1.5,8,2,red\n", 1, "colour"),
    (b"id,arrival,prompt_len,id,output_len\n", 1, "twice"),
    (b"id,arrival,prompt_len\n7,1.5,8\n", 1, "output_len"),
    (b"id,arri\xffval,prompt_len,output_len\n", 1, "UTF-8"),
    (b'id,"arrival,prompt_len,output_len\n7,1.5,8,2\n', 1, "never closes"),
    (b"id,arrival,prompt_len,output_len\n", 1, "no request"),
    (b"id,arrival,prompt_len,output_len\n1,0,8,2\n2,1,8,2\n1,2,8,2\n", 4, "id 1 appears twice"),
    (b"id,arrival,prompt_len,output_len,prefix_id,prefix_len\n1,0,8,2,p,2\n2,1,8,2,p,3\n", 3, "prefix 'p'"),
    (b'id,arrival,prompt_len,output_len,tenant\n1,0,8,2,"abc\n2,1,8,2,"x"\n', 2, r"quote inside a cell \(on line 3\)"),
])
def test_csv_file_level_errors_name_the_line(tmp_path, text, line, word):
    path = tmp_path / "t.csv"
    path.write_bytes(text)
    with pytest.raises(TraceFormatError, match=word) as e:
        read_trace(path)
    assert e.value.line == line, str(e.value)


def test_csv_lenient_where_harmless(tmp_path):
    path = tmp_path / "t.csv"
    # a byte-order mark (Excel writes one), spaces around numbers, CR-only line ends, no line end at the end
    path.write_bytes(b"\xef\xbb\xbfid,arrival,prompt_len,output_len,tenant\r 1 , 0.5 ,8, 2 ,\r2,1,8,2,x")
    assert read_trace(path).requests == [Request(1, 0.5, 8, 2), Request(2, 1.0, 8, 2, tenant="x")]


def test_a_short_row_is_refused_and_a_swallowing_quote_is_named(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(b"id,arrival,prompt_len,output_len,tenant\n1,0,8,2\n")
    with pytest.raises(TraceFormatError, match="4 cells for 5 columns") as e:
        read_trace(path)
    assert e.value.line == 2
    # the quote on line 2 is closed by the stray one on line 4: one long cell, and the row's cells do not fit.
    # (Closed in the same column, the long cell would make a good row: CSV cannot tell that from a tenant
    # holding line ends, which must round-trip.)
    path.write_bytes(b'id,arrival,prompt_len,output_len,tenant\n1,0,8,2,"abc\n2,1,8,2,t\n3,2,8,2",t\n')
    with pytest.raises(TraceFormatError, match="6 cells for 5 columns .*lines 2-4: is a quote missing") as e:
        read_trace(path)
    assert e.value.line == 2


def test_errors_are_trace_format_errors_never_others(tmp_path):
    """Random bytes, mostly near-valid: read_trace returns a workload or raises TraceFormatError."""
    rng = np.random.default_rng(0)
    good = write_trace(Workload("w", [Request(i, float(i), 8, 2, f"t,{i}\n", prompt_tokens=tuple(range(8)))
                                      for i in range(5)]), tmp_path / "g.csv").read_bytes()
    for suffix, data in ((".csv", good), (".jsonl", write_trace(read_trace(tmp_path / "g.csv"),
                                                                  tmp_path / "g.jsonl").read_bytes())):
        for k in range(300):
            b = bytearray(data)
            for _ in range(rng.integers(1, 4)):
                b[rng.integers(len(b))] = rng.choice(list(b'",\n\r\x00\xff 0-9.e[]{}:'))
            path = tmp_path / f"m{k}{suffix}"
            path.write_bytes(bytes(b))
            try:
                read_trace(path)
            except TraceFormatError as e:
                assert 1 <= e.line <= b.count(b"\n") + b.count(b"\r") + 1 and str(Path(e.path)) == str(path)


# ---------------------------------------------------------------------------------------------------- production
MOON = {"timestamp": 20, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}


def _mooncake_cases():
    """(case id, raw JSON text of one bad Mooncake record)."""
    out = []
    for v in [[True, 1], [0, 1.0], ["0", 1], [[0], 1], [None, 1], [0, -1], [0, HASH_ID_MAX + 1], [0, 2**64],
              [0, 10**400], [0], [0, 1, 2], [], "0 1", 5, None, {}, True]:
        out.append((f"hash_ids={str(v)[:20]}", {**MOON, "hash_ids": v}))
    for name in ("input_length", "output_length"):
        for v in [-1, 1.5, 600.0, "600", True, None, [600], 2**31, 2**70, *([0] if name == "input_length" else [])]:
            out.append((f"{name}={v!r}", {**MOON, name: v}))
    for v in ["NaN", "Infinity", "-Infinity", "1e999", "20", True, None, [20], {"ms": 20}]:
        out.append((f"timestamp={v!r}", {**MOON, "timestamp": v}))
    for key in MOON:
        out.append((f"no {key}", {k: v for k, v in MOON.items() if k != key}))
    out.append(("unknown key", {**MOON, "session": 1}))
    return _json_lines(out) + [
        ("truncated", b'{"timestamp": 20, "input_length": 600,'),
        ("not an object", b"[20, 600, 3, [0, 1]]"),
        ("key twice", b'{"timestamp": 20, "timestamp": 21, "input_length": 600, "output_length": 3, '
                      b'"hash_ids": [0, 1]}'),
        ("latin-1 byte", b'{"timestamp": 20, "input_length": 600, "output_length": 3, "hash_ids": [0, 1], "\xe9": 1}'),
    ]


def _moon_line(t: int, ids: list[int] | None = None) -> bytes:
    return json.dumps({"timestamp": t, "input_length": 600, "output_length": 3, "hash_ids": ids or [0, 1]}).encode()


def _write(path: Path, data: bytes, compress: bool) -> Path:
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("where", ["first", "later"])
@pytest.mark.parametrize("cid, bad", _mooncake_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_malformed_mooncake_names_the_line(tmp_path, cid, bad, where, compress):
    before = [] if where == "first" else [_moon_line(0), b"", _moon_line(10, [0, 2])]
    lines = [*before, bad, _moon_line(30), b'{"broken']  # a later error must not be the one reported
    path = _write(tmp_path / ("t.jsonl.gz" if compress else "t.jsonl"), b"\n".join(lines) + b"\n", compress)
    for fmt in ("mooncake", None):  # detected from the first record, or else kvlab's reader names the line
        with pytest.raises(TraceFormatError) as e:
            load_trace(path, format=fmt)
        line = len(before) + 1
        assert e.value.line == line and e.value.path == str(path), (fmt, str(e.value))


AZ_HEAD = b"TIMESTAMP,ContextTokens,GeneratedTokens"
AZ_GOOD = "2023-11-16 18:15:46.6805900"


def _azure_cases():
    out = []
    for v in ["2023-11-16", "18:15:46.6805900", "2023-13-16 18:15:46.6805900", "2023-02-30 18:15:46.68",
              "2023-11-16 24:00:00.0", "2023-11-16 18:60:46.0", "2023-11-16 18:15:60.0", "2023/11/16 18:15:46.68",
              "2023-11-16 18:15:46.", "2023-11-16 18:15:46.1234567890", "2023-11-16 18:15:46.68+01:00",
              "2023-11-16 18:15:46.68Z", "nan", "", "1700158546.68", "true", "\u0662023-11-16 18:15:46.68"]:
        out.append((f"TIMESTAMP={v!r}", f"{v},374,44"))
    for col in ("ContextTokens", "GeneratedTokens"):
        for v in ["0", "-1", "1.5", "", "abc", "nan", "inf", "true", "1e3", "0x10", "1_0", str(2**31), "9" * 5000]:
            if col == "GeneratedTokens" and v == "0":
                continue  # no output is a valid record
            row = f"{AZ_GOOD},{v},44" if col == "ContextTokens" else f"{AZ_GOOD},374,{v}"
            out.append((f"{col}={v[:12]!r}", row))
    out += [("two cells", f"{AZ_GOOD},374"), ("four cells", f"{AZ_GOOD},374,44,1"),
            ("stray quote", f'{AZ_GOOD},3"74,44')]
    return [(cid, row.encode()) for cid, row in out]


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("where", ["first", "later"])
@pytest.mark.parametrize("cid, bad", _azure_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_malformed_azure_names_the_line(tmp_path, cid, bad, where, compress):
    before = [] if where == "first" else [b"2023-11-16 18:15:40.0000000,10,5", b"", b"2023-11-16 18:15:41.5,10,0"]
    lines = [AZ_HEAD, *before, bad, b"2023-11-16 18:15:50.0,1,1", b'x,"']
    path = _write(tmp_path / "t.csv", b"\r\n".join(lines), compress)
    for fmt in ("azure", None):
        with pytest.raises(TraceFormatError) as e:
            load_trace(path, format=fmt)
        line = 2 + len(before)
        assert e.value.line == line and e.value.path == str(path), (fmt, str(e.value))


@pytest.mark.parametrize("fmt, lines, line, word", [
    ("mooncake", [_moon_line(10), _moon_line(10), _moon_line(9)], 3, "earlier than the record before"),
    ("mooncake", [b"", b"# only a comment"], 1, "no request"),
    ("azure", [AZ_HEAD, b"2023-11-16 18:15:41.0000001,1,1", b"2023-11-16 18:15:41.0000000,1,1"], 3,
     "earlier than the row before"),
    ("azure", [AZ_HEAD], 1, "no request"),
    ("azure", [], 1, "empty file: expected the header"),
    ("azure", [b"TIMESTAMP,ContextTokens"], 1, "an Azure trace has the header"),
    ("azure", [b"TIMESTAMP,ContextTokens,GeneratedTokens,Extra"], 1, "an Azure trace has the header"),
    ("azure", [b"id,arrival,prompt_len,output_len", b"1,0,8,2"], 1, "looks like a kvlab trace.*--format kvlab"),
    ("mooncake", [b'{"id": 1, "arrival": 0, "prompt_len": 8, "output_len": 2}'], 1, "looks like a kvlab trace"),
    ("mooncake", [b"", AZ_HEAD, AZ_GOOD.encode() + b",1,1"], 2, "looks like an Azure CSV trace.*--format azure"),
    ("azure", [b"# a comment", _moon_line(0)], 2, "looks like a Mooncake JSONL trace.*--format mooncake"),
    ("kvlab", [_moon_line(0)], 1, "looks like a Mooncake JSONL trace"),
    ("kvlab", [AZ_HEAD], 1, "looks like an Azure CSV trace"),
])
def test_production_file_level_errors(tmp_path, fmt, lines, line, word):
    path = tmp_path / "t.txt"
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(TraceFormatError, match=word) as e:
        load_trace(path, format=fmt)
    assert e.value.line == line, str(e.value)


def test_bad_gzip_names_the_line_where_the_text_stops(tmp_path):
    text = b"\n".join(_moon_line(t) for t in range(2000)) + b"\n"
    whole = gzip.compress(text)
    cut = _write(tmp_path / "cut.jsonl.gz", whole[:len(whole) // 2], False)
    with pytest.raises(TraceFormatError, match="ends early") as e:
        load_trace(cut)
    assert 1 < e.value.line < 2000
    # what decompresses before the cut really ends on that line
    partial = zlib.decompressobj(wbits=31).decompress(whole[:len(whole) // 2])
    assert e.value.line == 1 + partial.count(b"\n")
    broken = bytearray(whole)
    broken[len(broken) // 2] ^= 0xFF
    with pytest.raises(TraceFormatError, match="not valid gzip data|ends early") as e:
        load_trace(_write(tmp_path / "bad.gz", bytes(broken), False))
    assert e.value.path == str(tmp_path / "bad.gz")
    for name, data in (("not.gz", text), ("trailing.gz", whole + b"junk"), ("header.gz", whole[:5])):
        with pytest.raises(TraceFormatError, match="gzip") as e:
            load_trace(_write(tmp_path / name, data, False))
        assert e.value.path == str(tmp_path / name)
    real = gzip.decompress((DATA / TRACES["mooncake-conversation"]).read_bytes())
    cut_at = real.index(b"\n", len(real) // 2) + 1  # members far longer than one 64 KiB piece of input
    two = _write(tmp_path / "two.gz", gzip.compress(real[:cut_at]) + gzip.compress(real[cut_at:]), False)
    assert load_trace(two).requests == load_trace("mooncake-conversation").requests  # several members read as one


def test_random_damage_gives_a_workload_or_a_trace_format_error(tmp_path):
    """Bytes flipped in real trace heads: load_trace returns or raises TraceFormatError, never another error."""
    rng = np.random.default_rng(1)
    heads = {name: b"\n".join(gzip.decompress((DATA / TRACES[name]).read_bytes()).split(b"\n")[:30])
             for name in ("azure-code-2023", "mooncake-conversation")}
    for data in heads.values():
        for k in range(200):
            b = bytearray(data)
            for _ in range(rng.integers(1, 4)):
                b[rng.integers(len(b))] = rng.choice(list(b'",\n\r\x00\xff 0-9.e[]{}:-'))
            path = _write(tmp_path / f"m{k}", bytes(b), bool(k % 2))
            try:
                load_trace(path)
            except TraceFormatError as e:
                assert 1 <= e.line <= b.count(b"\n") + b.count(b"\r") + 1 and e.path == str(path)
