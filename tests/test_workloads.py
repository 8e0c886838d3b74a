"""Workload generators (text §2.2.1 scenarios), arrivals, requests and trace files."""
from __future__ import annotations

import json
import math
import pickle
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import ConfigError, Request, TraceFormatError, Workload, make_workload, read_trace, write_trace
from kvlab.workloads.mixes import (HASH_BLOCK, HASH_ID_MAX, INT_MAX, SCENARIOS, TURN, WORKLOADS, LengthRange,
                                   burst_arrivals, poisson_arrivals)

N = 4000


def new_tokens(w: Workload) -> np.ndarray:
    return np.array([r.prompt_len - r.prefix_len for r in w])


def outputs(w: Workload) -> np.ndarray:
    return np.array([r.output_len for r in w])


@pytest.fixture(scope="module")
def big() -> dict[str, Workload]:
    return {name: make_workload(name, N, seed=1) for name in SCENARIOS}


# ---------------------------------------------------------------------------------------------------- generators
@pytest.mark.parametrize("name", [*WORKLOADS, "dialogue"])
def test_same_seed_same_workload_other_seed_differs(name):
    a, b, c = make_workload(name, 200, seed=7), make_workload(name, 200, seed=7), make_workload(name, 200, seed=8)
    assert a.requests == b.requests
    assert a.requests != c.requests
    assert [r.id for r in a] == list(range(200))
    assert all(x.arrival <= y.arrival for x, y in zip(a.requests, a.requests[1:]))


def test_dialogue_is_chat():
    assert make_workload("dialogue", 50, 3).requests == make_workload("chat", 50, 3).requests


def test_length_range_matches_its_bounds_and_mean():
    for lr in (TURN, LengthRange(10, 100, 32), LengthRange(1000, 10000, 3162), LengthRange(500, 2000, 1000)):
        x = lr.sample(np.random.default_rng(0), 20000)
        assert x.dtype == np.int64 and x.min() >= lr.lo and x.max() <= lr.hi
        # standard error of the mean is < 0.5% here; 2% leaves room for rounding to ints
        assert abs(x.mean() - lr.mean) < 0.02 * lr.mean, (lr, x.mean())
        # a truncated density, not a clip: the bounds hold no pile of clipped draws
        assert (x == lr.hi).mean() < 0.01


def test_chat_turns_follow_the_texts_dialogue_numbers(big):
    w = big["chat"]
    for x in (new_tokens(w), outputs(w)):
        assert x.min() >= 10 and x.max() <= 200
        assert abs(x.mean() - 50) < 2.5  # text: "平均约50 tokens"


@pytest.mark.parametrize("name, lo, hi, mean", [
    ("document", 200, 5000, 0.7 * 447 + 0.3 * 2236),  # paragraphs 200-1000, documents 1000-5000
    ("code", 100, 2000, 0.7 * 224 + 0.3 * 1000),  # functions 100-500, classes 500-2000
    ("retrieval", 1000, 10000, 3162),  # responses 1000-10000
])
def test_outputs_follow_the_texts_ranges(big, name, lo, hi, mean):
    x = outputs(big[name])
    assert x.min() >= lo and x.max() <= hi
    assert abs(x.mean() - mean) < 0.05 * mean


def test_output_mixtures_hold_both_kinds(big):
    doc, code = outputs(big["document"]), outputs(big["code"])
    assert 0.65 < (doc <= 1000).mean() < 0.75  # 70% paragraphs; a paragraph never exceeds 1000
    assert 0.65 < (code <= 500).mean() < 0.75


def test_retrieval_queries_are_short(big):
    q = new_tokens(big["retrieval"])
    assert q.min() >= 10 and q.max() <= 100 and abs(q.mean() - 32) < 2


def test_shared_prefixes(big):
    for name, scn in SCENARIOS.items():
        w = big[name]
        used = [r for r in w if r.prefix_id]
        assert abs(len(used) / N - scn.prefix_share) < 0.04
        lens = {}
        for r in used:
            assert r.prefix_id.startswith(f"{name}/{scn.prefix_kind}-")
            assert scn.prefix_range[0] <= r.prefix_len <= scn.prefix_range[1]
            assert lens.setdefault(r.prefix_id, r.prefix_len) == r.prefix_len
        assert len(lens) == scn.num_prefixes
    assert not any(r.prefix_id for r in make_workload("code", 300, 0, prefix_share=0.0))
    assert all(r.prefix_id for r in make_workload("code", 300, 0, prefix_share=1.0))



def test_prefix_lengths_reach_both_ends_of_their_range(monkeypatch):
    """A scenario's prefix lengths are drawn from its whole closed range: narrowed to two lengths, both occur."""
    monkeypatch.setitem(SCENARIOS, "chat", replace(SCENARIOS["chat"], prefix_range=(64, 65), num_prefixes=8))
    lens = {r.prefix_len for seed in range(4) for r in make_workload("chat", 200, seed, prefix_share=1.0)}
    assert lens == {64, 65}

def test_token_ids_share_exactly_the_prefix():
    w = make_workload("chat", 200, 0, prefix_share=1.0)
    by_prefix: dict[str, list[Request]] = {}
    for r in w:
        by_prefix.setdefault(r.prefix_id, []).append(r)
    a, b = next(v for v in by_prefix.values() if len(v) >= 2)[:2]
    ta, tb = a.prompt_token_ids(), b.prompt_token_ids()
    assert len(ta) == a.prompt_len and ta == a.prompt_token_ids()  # deterministic
    assert ta[:a.prefix_len] == tb[:b.prefix_len]
    assert ta[a.prefix_len:a.prefix_len + 8] != tb[b.prefix_len:b.prefix_len + 8]
    assert max(a.prompt_token_ids(vocab_size=50)) < 50
    given_ids = Request(9, 0.0, 3, 1, prompt_tokens=(5, 6, 7))
    assert given_ids.prompt_token_ids() == [5, 6, 7]


def test_mixed_names_tenants_after_scenarios():
    w = make_workload("mixed", 400, 0)
    assert {r.tenant for r in w} == set(SCENARIOS)
    for r in w:
        assert r.prefix_id is None or r.prefix_id.startswith(r.tenant + "/")
    assert {r.tenant for r in make_workload("chat", 300, 0, tenants=3)} == {"tenant-0", "tenant-1", "tenant-2"}


# ---------------------------------------------------------------------------------------------------- arrivals
def test_poisson_arrivals_rate():
    t = poisson_arrivals(20000, 5.0, np.random.default_rng(0))
    gaps = np.diff(t)
    assert t[0] == 0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 0.2) < 0.01
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential gaps: coefficient of variation 1


def test_burst_arrivals_group_and_keep_the_rate():
    t = burst_arrivals(16 * 3000 + 5, 8.0, 16, np.random.default_rng(0))
    assert t.size == 16 * 3000 + 5
    starts, counts = np.unique(t, return_counts=True)
    assert (counts[:-1] == 16).all() and counts[-1] == 5
    assert abs(np.diff(starts).mean() - 2.0) < 0.1  # bursts every 16/8 s on average
    w = make_workload("chat", 64, 0, arrival="burst", burst_size=8)
    assert len({r.arrival for r in w}) == 8


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(n=2.5), dict(rate=0), dict(rate=math.inf), dict(tenants=0),
                                    dict(arrival="uniform"), dict(burst_size=0), dict(prefix_share=1.5),
                                    dict(name="chess"), dict(n=True)])
def test_make_workload_rejects_bad_arguments(kwargs):
    args = {"name": "chat", "n": 10, **kwargs}
    key = next(iter(kwargs))
    with pytest.raises(ConfigError, match="unknown workload 'chess'" if key == "name" else f"invalid {key}="):
        make_workload(args.pop("name"), args.pop("n"), **args)


# ---------------------------------------------------------------------------------------------------- requests
@pytest.mark.parametrize("kwargs, word", [
    (dict(prompt_len=0), "prompt_len"), (dict(output_len=-1), "output_len"), (dict(arrival=-1.0), "arrival"),
    (dict(arrival=math.nan), "arrival"), (dict(arrival="soon"), "arrival"), (dict(id=True), "id"),
    (dict(prefix_id="sys"), "prefix_len"), (dict(prefix_len=3), "prefix_len"),
    (dict(prefix_id="sys", prefix_len=11), "prefix_len"), (dict(tenant=""), "tenant"),
    (dict(prompt_tokens=(1, 2)), "prompt_tokens"), (dict(prompt_len=2.0), "prompt_len"),
    # the pool's int32 fields bound ids, lengths and token ids: refused here, not overflowed later
    (dict(id=-1), "id"), (dict(id=2**31), "id"), (dict(prompt_len=2**31), "prompt_len"),
    (dict(output_len=2**70), "output_len"), (dict(arrival=10**400), "arrival"),
    (dict(arrival=np.bool_(True)), "arrival"),
    (dict(prompt_tokens="0123456789"), "prompt_tokens"), (dict(prompt_tokens=[True] * 10), "prompt_tokens"),
    (dict(prompt_tokens=[1.0] * 10), "prompt_tokens"), (dict(prompt_tokens=[2**31] * 10), "prompt_tokens"),
    (dict(prompt_tokens=np.zeros(10)), "prompt_tokens"),
])
def test_request_rejects_bad_fields(kwargs, word):
    base = dict(id=1, arrival=0.5, prompt_len=10, output_len=4)
    with pytest.raises(ConfigError, match=word):
        Request(**{**base, **kwargs})


def test_request_normalises_numpy_values():
    r = Request(np.int64(3), np.float32(1.5), np.int32(10), np.int64(2))
    assert type(r.id) is int and type(r.arrival) is float and r.total_len == 12
    r = Request(0, 0.0, 3, 1, prompt_tokens=np.array([5, 6, 2**31 - 1], dtype=np.int64))
    assert r.prompt_tokens == (5, 6, 2**31 - 1) and {type(t) for t in r.prompt_tokens} == {int}


# ---------------------------------------------------------------------------------------------------- hash ids
def test_hash_ids_give_one_content_block_per_id():
    r = Request(0, 0.0, 1100, 5, hash_ids=[7, 0, 3])  # 512 + 512 + 76 tokens
    toks = r.prompt_token_ids(vocab_size=INT_MAX + 1)
    assert r.hash_ids == (7, 0, 3) and len(toks) == 1100
    assert toks == [h * HASH_BLOCK + o for h, n in ((7, 512), (0, 512), (3, 76)) for o in range(n)]
    assert Request(1, 0.0, 512, 1, hash_ids=(9,)).prompt_token_ids(10 * HASH_BLOCK) == list(range(9 * 512, 4608 + 512))


@settings(max_examples=60, deadline=None)
@given(a=st.lists(st.integers(0, 6), min_size=1, max_size=5), b=st.lists(st.integers(0, 6), min_size=1, max_size=5),
       cut_a=st.integers(0, 511), cut_b=st.integers(0, 511))
def test_equal_ids_share_tokens_and_distinct_ids_none(a, b, cut_a, cut_b):
    ra = Request(0, 0.0, 512 * len(a) - cut_a, 1, hash_ids=a)
    rb = Request(1, 0.0, 512 * len(b) - cut_b, 1, hash_ids=b)
    ta, tb = ra.prompt_token_ids(INT_MAX + 1), rb.prompt_token_ids(INT_MAX + 1)
    for i, t in enumerate(ta):  # a token names its id and offset, nothing else
        assert divmod(t, HASH_BLOCK) == (a[i // HASH_BLOCK], i % HASH_BLOCK)
    assert (set(ta) & set(tb) == set()) == (set(a).isdisjoint(b))


def test_a_126k_token_prompt_is_built_whole():
    ids = list(range(1000, 1000 + 247))
    r = Request(0, 0.0, 126_195, 1, hash_ids=ids)
    toks = r.prompt_token_ids(INT_MAX + 1)
    assert len(toks) == 126_195 and type(toks[0]) is int
    assert toks[::HASH_BLOCK] == [h * HASH_BLOCK for h in ids] and toks[-1] == ids[-1] * 512 + 126_195 % 512 - 1


def test_hash_ids_are_exact_or_refused_by_a_small_vocabulary():
    r = Request(0, 0.0, 600, 1, hash_ids=(0, 1))
    assert max(r.prompt_token_ids(vocab_size=600)) == 599  # ids 0..599 fit exactly
    with pytest.raises(ConfigError, match="token ids up to 599, past vocab_size=599.*collide"):
        r.prompt_token_ids(vocab_size=599)
    top = Request(0, 0.0, 512, 1, hash_ids=(HASH_ID_MAX,))
    assert top.prompt_token_ids(INT_MAX + 1)[-1] == INT_MAX  # the largest id still fits the pool's int32


@pytest.mark.parametrize("kwargs, word", [
    (dict(hash_ids=(1,)), "hash_ids must be 2 ints"), (dict(hash_ids=(1, 2, 3)), "got 3 ids"),
    (dict(hash_ids=()), "got 0 ids"), (dict(hash_ids=(1, -1)), "got -1"),
    (dict(hash_ids=(1, HASH_ID_MAX + 1)), f"got {HASH_ID_MAX + 1}"), (dict(hash_ids=(True, 1)), "got True"),
    (dict(hash_ids=(1.0, 2)), "got 1.0"), (dict(hash_ids="12"), "got '12'"), (dict(hash_ids=5), "got 5"),
    (dict(hash_ids=((1,), 2)), r"got \(1,\)"), (dict(hash_ids=np.zeros(2)), "array of float64"),
    (dict(hash_ids=(1, 2), prefix_id="p", prefix_len=3), "exclude prefix_id"),
    (dict(hash_ids=(1, 2), prompt_tokens=tuple(range(600))), "exclude prefix_id and prompt_tokens"),
])
def test_request_rejects_bad_hash_ids(kwargs, word):
    with pytest.raises(ConfigError, match=f"request 4: .*{word}"):
        Request(**{"id": 4, "arrival": 0.0, "prompt_len": 600, "output_len": 1, **kwargs})


def test_hash_ids_normalise_and_round_trip(tmp_path):
    r = Request(0, 0.0, 600, 1, hash_ids=np.array([3, 4], dtype=np.int32))
    assert r.hash_ids == (3, 4) and {type(h) for h in r.hash_ids} == {int}
    w = Workload("m", [r, Request(1, 0.5, 2, 0, hash_ids=[3]), Request(2, 1.0, 8, 1)])
    for suffix in (".jsonl", ".csv"):
        assert read_trace(write_trace(w, tmp_path / f"m{suffix}")).requests == w.requests
    assert '"hash_ids":[3,4]' in (tmp_path / "m.jsonl").read_text()
    assert b",3 4\r\n" in (tmp_path / "m.csv").read_bytes()


def test_workload_sorts_and_checks_consistency():
    w = Workload("w", [Request(2, 1.0, 5, 1), Request(1, 1.0, 5, 1), Request(0, 2.0, 5, 1)])
    assert [r.id for r in w] == [1, 2, 0]
    assert w.sequence_lengths().tolist() == [6, 6, 6]
    with pytest.raises(ConfigError, match="id 1 appears twice"):
        Workload("w", [Request(1, 0.0, 5, 1), Request(1, 1.0, 5, 1)])
    with pytest.raises(ConfigError, match="prefix 'p'"):
        Workload("w", [Request(1, 0.0, 5, 1, prefix_id="p", prefix_len=2),
                       Request(2, 1.0, 5, 1, prefix_id="p", prefix_len=3)])
    s = make_workload("chat", 100, 0).summary()
    assert s["requests"] == 100 and s["total_p95"] >= s["total_p50"]


# ---------------------------------------------------------------------------------------------------- traces
tenants = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6)


@st.composite
def requests(draw):
    out = []
    prefix_lens = {"a": draw(st.integers(1, 5)), "b,\"x\"": draw(st.integers(1, 5))}
    for i in draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=8, unique=True)):
        pid = draw(st.sampled_from([None, *prefix_lens]))
        plen = prefix_lens.get(pid, 0)
        n = draw(st.integers(max(plen, 1), 12))
        toks = draw(st.none() | st.lists(st.integers(0, 99), min_size=n, max_size=n).map(tuple))
        out.append(Request(i, draw(st.floats(0, 1e6, allow_nan=False)), n, draw(st.integers(0, 50)),
                           draw(tenants), pid, plen, toks))
    return out


@settings(max_examples=40, deadline=None)
@given(reqs=requests(), suffix=st.sampled_from([".jsonl", ".csv"]))
def test_trace_round_trip(tmp_path_factory, reqs, suffix):
    path = tmp_path_factory.mktemp("trace") / f"mine{suffix}"
    w = Workload("mine", reqs)
    write_trace(w, path)
    back = read_trace(path)
    assert back.name == "mine" and back.requests == w.requests


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_generated_workload_round_trips(tmp_path, suffix):
    w = make_workload("mixed", 300, 4)
    assert read_trace(write_trace(w, tmp_path / f"t{suffix}"), name="mixed").requests == w.requests


def write_lines(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"id": 1, "arrival": 0.0, "prompt_len": 8, "output_len": 3})


@pytest.mark.parametrize("bad, line, word", [
    ('{"id": 2, "arrival": 1.0, "prompt_len": 8', 4, "not valid JSON"),
    ('[1, 2, 3]', 4, "JSON object"),
    ('{"id": 2, "arrival": 1.0, "prompt_len": 8}', 4, "output_len"),
    ('{"id": 2, "arrival": 1.0, "prompt_len": 8, "output_len": 1, "priority": 3}', 4, "priority"),
    ('{"id": 2, "arrival": 1.0, "prompt_len": "8a", "output_len": 1}', 4, "prompt_len"),
    ('{"id": 2, "arrival": 1.0, "prompt_len": 8, "output_len": true}', 4, "output_len"),
    ('{"id": 2, "arrival": -1, "prompt_len": 8, "output_len": 1}', 4, "arrival"),
    ('{"id": 1, "arrival": 1.0, "prompt_len": 8, "output_len": 1}', 4, "id 1 appears twice"),
    ('{"id": 2, "arrival": 1.0, "prompt_len": 8, "output_len": 1, "prompt_tokens": [1]}', 4, "prompt_tokens"),
])
def test_malformed_jsonl_line_is_named(tmp_path, bad, line, word):
    path = write_lines(tmp_path, "t.jsonl", ["# a comment", GOOD, "", bad, GOOD.replace('"id": 1', '"id": 9')])
    with pytest.raises(TraceFormatError, match=word) as e:
        read_trace(path)
    assert e.value.line == line and f"line {line}:" in str(e.value) and e.value.path == str(path)


HEADER = "id,arrival,prompt_len,output_len,tenant,prefix_id,prefix_len"


@pytest.mark.parametrize("lines, line, word", [
    ([HEADER, "1,0.0,8,3,,,", "2,x,8,3,,,"], 3, "arrival"),
    ([HEADER, "1,0.0,8,3,,,", "2,1.0,8,3,u,p,", "3,1.5,8,3,u,p,2"], 3, "prefix_len"),
    ([HEADER, "1,0.0,8,3,,,", "2,1.0,8,3,u,p,2", "3,1.5,8,3,u,p,4"], 4, "prefix 'p'"),
    ([HEADER, "1,0.0,8,3,,,,9"], 2, "cells"),
    (["id,arrival,prompt_len,output_len,colour", "1,0.0,8,3,red"], 1, "colour"),
    ([HEADER, '1,0.0,8,3,"multi', 'line",,', "2,1.0,,3,,,"], 4, "prompt_len"),
])
def test_malformed_csv_line_is_named(tmp_path, lines, line, word):
    with pytest.raises(TraceFormatError, match=word) as e:
        read_trace(write_lines(tmp_path, "t.csv", lines))
    assert e.value.line == line


def test_trace_file_level_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"\.txt"):
        read_trace(tmp_path / "t.txt")
    with pytest.raises(ConfigError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceFormatError, match="no request"):
        read_trace(write_lines(tmp_path, "empty.jsonl", ["# only a comment"]))
    with pytest.raises(TraceFormatError, match="header") as e:
        read_trace(write_lines(tmp_path, "empty.csv", []))
    assert e.value.line == 1
    err = pickle.loads(pickle.dumps(TraceFormatError("f.csv", 7, "bad")))
    assert (err.path, err.line, str(err)) == ("f.csv", 7, "f.csv, line 7: bad")
