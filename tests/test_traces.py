"""Production traces: the bundled files load exactly (counts, lengths, nanosecond arrivals, hash ids), formats are
detected, and the prefix-hit bound equals a brute force over pairs and kvlab's own prefix cache replaying the
requests."""
from __future__ import annotations

import csv
import gzip
import hashlib
import json
from collections import Counter
from datetime import datetime, timedelta
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlab
from kvlab import (BlockPool, ConfigError, KVSpec, Request, SequenceManager, Workload, load_trace, make_workload,
                   prefix_hit_bound, prefix_hits, read_trace, trace_names, write_trace)
from kvlab.workloads.traces import DATA, TRACES
from kvlab.workloads.mixes import HASH_BLOCK, INT_MAX

NAMES = ("azure-conv-2023", "azure-code-2023", "mooncake-conversation")


@pytest.fixture(scope="module")
def traces() -> dict[str, Workload]:
    return {name: load_trace(name) for name in NAMES}


@pytest.fixture(scope="module")
def mooncake(traces) -> Workload:
    return traces["mooncake-conversation"]


@pytest.fixture(scope="module")
def sessions(mooncake) -> Workload:
    return sessions_with_partial_hits(mooncake, 15)


def raw_rows(name: str) -> list[list[str]]:
    with gzip.open(DATA / TRACES[name], "rt", newline="") as f:
        return list(csv.reader(f))


def raw_records(name: str) -> list[dict]:
    with gzip.open(DATA / TRACES[name], "rt") as f:
        return [json.loads(line) for line in f]


def ticks(ts: str) -> Fraction:
    """An Azure TIMESTAMP in seconds, another way: datetime to the microsecond, then the 7th digit's 100 ns."""
    dt = datetime.strptime(ts[:26], "%Y-%m-%d %H:%M:%S.%f")
    return Fraction((dt - datetime(2023, 1, 1)) // timedelta(microseconds=1), 10**6) + Fraction(int(ts[26]), 10**7)


# ---------------------------------------------------------------------------------------------------- bundled
def test_bundled_names():
    assert trace_names() == list(NAMES)
    assert all((DATA / f).is_file() for f in TRACES.values()) and (DATA / "ATTRIBUTION.md").is_file()
    assert kvlab.load_trace is load_trace and kvlab.prefix_hit_bound is prefix_hit_bound


@pytest.mark.parametrize("name, n, prompt, output", [
    # figures computed from the files with gzip + csv/json alone (see /work README's table and docs/traces.md)
    ("azure-conv-2023", 19366, (1155, 1020), 211),
    ("azure-code-2023", 8819, (2048, None), 28),
    ("mooncake-conversation", 12031, (12035, 6909), 343),
])
def test_bundled_traces_have_their_published_shape(traces, name, n, prompt, output):
    w = traces[name]
    assert w.name == name and len(w) == n
    assert [r.id for r in w] == list(range(n)) and {r.tenant for r in w} == {"default"}
    arrivals = np.array([r.arrival for r in w])
    assert arrivals[0] == 0.0 and (np.diff(arrivals) >= 0).all()
    lens = np.array([r.prompt_len for r in w])
    assert round(lens.mean()) == prompt[0] and (prompt[1] is None or np.median(lens) == prompt[1])
    assert round(np.mean([r.output_len for r in w])) == output


def test_azure_lengths_and_arrivals_are_the_files_exactly(traces):
    for name in ("azure-conv-2023", "azure-code-2023"):
        rows = raw_rows(name)
        assert rows[0] == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        w = traces[name]
        assert [(r.prompt_len, r.output_len) for r in w] == [(int(c), int(g)) for _, c, g in rows[1:]]
        assert {len(ts) for ts, _, _ in rows[1:]} == {27}  # seven fractional digits throughout
        t0 = ticks(rows[1][0])
        assert [r.arrival for r in w] == [float(ticks(ts) - t0) for ts, _, _ in rows[1:]]
    conv = traces["azure-conv-2023"]
    assert conv[1].arrival == 4.314579  # 18:15:50.9951690 - 18:15:46.6805900: all seven digits count
    assert conv[-1].arrival == 3501.721937


def test_mooncake_records_are_the_files_exactly(mooncake):
    recs = raw_records("mooncake-conversation")
    assert [(r.arrival, r.prompt_len, r.output_len, r.hash_ids) for r in mooncake] == \
        [(rec["timestamp"] / 1000, rec["input_length"], rec["output_length"], tuple(rec["hash_ids"])) for rec in recs]
    assert sum(r.prompt_len for r in mooncake) == 144_793_823 and max(r.prompt_len for r in mooncake) == 126_195
    assert max(max(r.hash_ids) for r in mooncake) == 182_789


def test_unknown_names_and_formats_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read trace 'azure-2023': No such file or directory; it is no "
                                          r"bundled trace either \(azure-conv-2023, azure-code-2023, "
                                          r"mooncake-conversation\)"):
        load_trace("azure-2023")
    with pytest.raises(ConfigError, match="cannot read trace .*missing.jsonl"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="trace .* is a directory, not a regular file"):
        load_trace(tmp_path)
    with pytest.raises(ConfigError, match="a trace is a bundled name or a path, got 7"):
        load_trace(7)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="format must be one of azure, mooncake, kvlab or None, got 'json'"):
        load_trace("azure-conv-2023", format="json")


# ---------------------------------------------------------------------------------------------------- formats
def _variants(src: Path, tmp_path: Path, stem: str) -> list[Path]:
    """The file ``src`` gzipped as it is, unzipped, and both under names that say nothing of the format."""
    plain = gzip.decompress(src.read_bytes())
    out = []
    for name, data in ((f"{stem}.gz", src.read_bytes()), (f"{stem}.txt", plain), (stem, plain),
                       (f"{stem}-2", gzip.compress(plain))):
        (tmp_path / name).write_bytes(data)
        out.append(tmp_path / name)
    return out


@pytest.mark.parametrize("name, fmt", [("azure-code-2023", "azure"), ("mooncake-conversation", "mooncake")])
def test_formats_are_detected_and_gzip_is_transparent(traces, tmp_path, name, fmt):
    for path in _variants(DATA / TRACES[name], tmp_path, "t"):
        for given_format in (None, fmt):
            w = load_trace(path, format=given_format)
            assert w.requests == traces[name].requests, (path, given_format)
    assert load_trace(tmp_path / "t.gz").name == "t" and load_trace(str(tmp_path / "t.txt")).name == "t"


def test_kvlab_formats_load_too_and_keep_hash_ids(mooncake, tmp_path):
    w = Workload("m", mooncake.requests[:200] + [Request(10**6, 3600.0, 5, 1, prompt_tokens=(1, 2, 3, 4, 5))])
    for suffix in (".jsonl", ".csv"):
        path = write_trace(w, tmp_path / f"m{suffix}")
        (tmp_path / f"m{suffix}.gz").write_bytes(gzip.compress(path.read_bytes()))
        for p in (path, tmp_path / f"m{suffix}.gz"):
            for fmt in (None, "kvlab"):
                back = load_trace(p, format=fmt)
                assert back.name == "m" and back.requests == w.requests == read_trace(path).requests


def test_a_mooncake_file_with_comments_and_zero_output_loads(tmp_path):
    lines = ["", '{"timestamp": 1500, "input_length": 600, "output_length": 0, "hash_ids": [4, 5]}',
             '{"timestamp": 1500, "input_length": 1, "output_length": 2, "hash_ids": [4]}',
             '{"timestamp": 2750.5, "input_length": 512, "output_length": 2, "hash_ids": [9]}']
    (tmp_path / "m.jsonl").write_text("\n".join(lines))
    w = load_trace(tmp_path / "m.jsonl")
    assert w.requests == [Request(0, 0.0, 600, 0, hash_ids=(4, 5)), Request(1, 0.0, 1, 2, hash_ids=(4,)),
                          Request(2, 1.2505, 512, 2, hash_ids=(9,))]


def test_azure_times_keep_every_digit(tmp_path):
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-12-31 23:59:59.999999999,1,0",
            "2024-01-01 00:00:00,2,1", "2024-01-01 00:00:00.000000001,3,1", "2024-02-29 12:00:00.5,4,1"]
    (tmp_path / "a.csv").write_text("\n".join(rows) + "\n")
    w = load_trace(tmp_path / "a.csv")
    assert [r.arrival for r in w] == [0.0, 1e-9, 2e-9, float(Fraction(59 * 86400 + 43200, 1) + Fraction(1, 2)
                                                              + Fraction(1, 10**9))]
    assert [(r.prompt_len, r.output_len) for r in w] == [(1, 0), (2, 1), (3, 1), (4, 1)]


# ---------------------------------------------------------------------------------------------------- the bound
def brute_hits(reqs: list[Request], B: int) -> list[int]:
    """The bound's definition over all pairs: common leading hash ids, each side's cover, the best earlier one."""
    out = []
    for i, r in enumerate(reqs):
        best = 0
        for e in reqs[:i]:
            k = 0
            while k < min(len(e.hash_ids), len(r.hash_ids)) and e.hash_ids[k] == r.hash_ids[k]:
                k += 1
            if k and e.tenant == r.tenant:
                best = max(best, min(HASH_BLOCK * k, e.prompt_len, r.prompt_len))
        out.append(min(best, r.prompt_len - 1) // B * B)
    return out


def token_brute_hits(reqs: list[Request], B: int) -> list[int]:
    """From the token ids alone: the longest common token prefix with an earlier request, in whole blocks."""
    toks = [r.prompt_token_ids(INT_MAX + 1) for r in reqs]
    out = []
    for i, r in enumerate(reqs):
        best = 0
        for j in range(i):
            if reqs[j].tenant == r.tenant:
                a, b = toks[i], toks[j]
                n = min(len(a), len(b))
                diff = np.flatnonzero(np.array(a[:n]) != np.array(b[:n]))
                best = max(best, int(diff[0]) if diff.size else n)
        out.append(min(best, r.prompt_len - 1) // B * B)
    return out


def cache_hits(reqs: list[Request], B: int, vocab_size: int = INT_MAX + 1) -> list[int]:
    """kvlab's prefix cache, big enough never to evict, replaying the requests one at a time in arrival order."""
    pool = BlockPool(sum(-(-r.prompt_len // B) for r in reqs), spec=KVSpec(block_size=B), with_storage=False)
    mgr = SequenceManager(pool, prefix_cache=True)
    hits = []
    for r in reqs:
        toks = r.prompt_token_ids(vocab_size)
        s = mgr.create(toks, tenant=r.tenant)  # the cached prefix is matched here
        hits.append(s.num_cached_tokens)
        s.append(toks[s.num_tokens:])
        mgr.cache_full_blocks(s)
        s.free()
    mgr.check_invariants()
    assert pool.counts["evictions"] == 0
    return hits


def as_tokens(r: Request) -> Request:
    """The same prompt given by its token ids instead of hash ids."""
    return Request(r.id, r.arrival, r.prompt_len, r.output_len, r.tenant,
                   prompt_tokens=tuple(r.prompt_token_ids(INT_MAX + 1)))


def sessions_with_partial_hits(w: Workload, n_sessions: int) -> Workload:
    """The requests of the first conversations (by their first two hash ids) in which a request reuses a last,
    partial 512-token block: many hits, and the cover rule exercised."""
    hits = prefix_hits(w, 16)
    partial = [w[i].hash_ids[:2] for i in np.flatnonzero(hits % HASH_BLOCK != 0)]
    count = Counter(r.hash_ids[:2] for r in w)
    keep = set(list(dict.fromkeys(k for k in partial if count[k] >= 2))[:n_sessions])
    return Workload("sessions", [r for r in w if r.hash_ids[:2] in keep])


def test_the_published_figures(mooncake):
    assert prefix_hit_bound(Workload("300", mooncake.requests[:300]), 16) == 345_952
    total = sum(r.prompt_len for r in mooncake)
    bound = prefix_hit_bound(mooncake, 16)
    assert round(total / 1e6, 1) == 144.8 and round(100 * bound / total, 1) == 37.4
    hits = prefix_hits(mooncake, 16)
    assert hits.dtype == np.int64 and hits.shape == (len(mooncake),) and int(hits.sum()) == bound
    assert all(0 <= h <= r.prompt_len - 1 and h % 16 == 0 for h, r in zip(hits.tolist(), mooncake))


@pytest.mark.parametrize("B", [1, 16, 48, 512, 1000])
def test_bound_equals_brute_force_over_pairs(mooncake, B):
    reqs = mooncake.requests[:400]
    assert prefix_hits(Workload("x", reqs), B).tolist() == brute_hits(reqs, B)


def test_hash_path_equals_the_token_path(sessions):
    """The trie over hash ids against the same prompts given as token ids, compared block by block."""
    w = Workload("s", sessions.requests[:40])
    as_toks = Workload("t", [as_tokens(r) for r in w])
    for B in (16, 48, 512):
        assert prefix_hits(w, B).tolist() == prefix_hits(as_toks, B).tolist()


@pytest.mark.parametrize("B", [16, 32, 512])
def test_bound_equals_kvlabs_prefix_cache_on_mooncake(mooncake, sessions, B):
    first = mooncake.requests[:100]
    assert cache_hits(first, B) == prefix_hits(Workload("x", first), B).tolist()
    w = sessions
    hits = prefix_hits(w, B)
    assert len(w) >= 80 and (hits > HASH_BLOCK).sum() >= 60  # many multi-block hits, not just the system prompt
    assert (prefix_hits(w, 16) % HASH_BLOCK != 0).sum() >= 10  # and reused partial last blocks
    assert cache_hits(w.requests, B) == hits.tolist()


def test_block_sizes_that_do_not_divide_512():
    """Tokens are content: a block is shared iff all its tokens lie in the common chain. At B = 48 the common
    1024 tokens hold 21 whole blocks (1008 tokens); block 21 (tokens 1008..1055) straddles into the differing
    third id and is lost. A partial last id counts only as far as it reaches."""
    e = Request(0, 0.0, 1536, 1, hash_ids=(0, 1, 2))
    r = Request(1, 1.0, 1536, 1, hash_ids=(0, 1, 9))
    for B, hit in ((48, 1008), (24, 1008), (16, 1024), (512, 1024), (1000, 1000), (1536, 0)):
        w = Workload("x", [e, r])
        assert prefix_hits(w, B).tolist() == [0, hit] == cache_hits(w.requests, B), B
    short = Request(0, 0.0, 600, 1, hash_ids=(0, 1))  # id 1 covers 88 tokens only
    longer = Request(1, 1.0, 1500, 1, hash_ids=(0, 1, 2))
    again = Request(2, 2.0, 700, 1, hash_ids=(0, 1))  # now id 1 has been seen whole
    w = Workload("y", [short, longer, again])
    for B, hits in ((48, [0, 576, 672]), (16, [0, 592, 688]), (512, [0, 512, 512])):
        assert prefix_hits(w, B).tolist() == hits == cache_hits(w.requests, B) == brute_hits(w.requests, B)


def test_tenants_do_not_share_and_one_token_is_left():
    a = Request(0, 0.0, 1024, 1, tenant="a", hash_ids=(0, 1))
    b = Request(1, 1.0, 1024, 1, tenant="b", hash_ids=(0, 1))
    a2 = Request(2, 2.0, 1024, 1, tenant="a", hash_ids=(0, 1))
    w = Workload("t", [a, b, a2])
    assert prefix_hits(w, 16).tolist() == [0, 0, 1008] == cache_hits(w.requests, 16)
    assert prefix_hits(w, 1).tolist() == [0, 0, 1023]


def test_generated_workloads_are_bounded_by_their_tokens():
    """Without hash ids, requests are compared by their token ids (prefix and per-request tokens)."""
    w = make_workload("mixed", 80, seed=3, tenants=2)
    hits = prefix_hits(w, 16)
    assert hits.sum() > 0 and hits.tolist() == cache_hits(w.requests, 16, vocab_size=32000)  # prefix_hits' vocab
    given = Workload("g", [Request(0, 0.0, 6, 1, prompt_tokens=(1, 2, 3, 4, 5, 6)),
                           Request(1, 1.0, 5, 1, prompt_tokens=(1, 2, 3, 4, 9)),
                           Request(2, 2.0, 3, 1, prompt_tokens=(1, 2, 3))])
    assert prefix_hits(given, 2).tolist() == [0, 4, 2]


def test_bad_arguments_are_refused():
    w = Workload("m", [Request(0, 0.0, 5, 1, hash_ids=(1,)), Request(1, 1.0, 5, 1)])
    with pytest.raises(ConfigError, match="mixes 1 requests with hash_ids and 1 without \\(request 1\\)"):
        prefix_hits(w, 16)
    for B in (0, -16, 16.0, True, "16", None):
        with pytest.raises(ConfigError, match="block_size must be a positive int"):
            prefix_hit_bound(Workload("e", [Request(0, 0.0, 5, 1)]), B)
    assert prefix_hits(Workload("e", []), 16).tolist() == [] and prefix_hit_bound(Workload("e", []), 16) == 0
    assert prefix_hits(Workload("n", [Request(0, 0.0, 5, 1, hash_ids=(1,))] * 1), np.int64(2)).tolist() == [0]


@st.composite
def small_traces(draw) -> Workload:
    """A few requests over a tiny id alphabet (so that chains repeat), lengths cutting the last id anywhere."""
    reqs = []
    for i in range(draw(st.integers(1, 7))):
        ids = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
        length = HASH_BLOCK * (len(ids) - 1) + draw(st.integers(1, HASH_BLOCK) | st.sampled_from([1, 511, 512]))
        reqs.append(Request(i, float(draw(st.integers(0, 3))), length, 1, draw(st.sampled_from(["a", "b"])),
                            hash_ids=ids))
    return Workload("small", reqs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=small_traces(), B=st.sampled_from([1, 7, 16, 24, 48, 100, 512, 700]))
def test_bound_on_small_traces_equals_every_other_way(w, B):
    hits = prefix_hits(w, B).tolist()
    assert hits == brute_hits(w.requests, B) == token_brute_hits(w.requests, B)
    assert hits == prefix_hits(Workload("t", [as_tokens(r) for r in w]), B).tolist()
    if B >= 7:  # a pool of 1-token blocks is slow to replay and adds nothing
        assert hits == cache_hits(w.requests, B)


# ---------------------------------------------------------------------------------------------------- packaging
def test_the_wheel_ships_the_traces_and_their_attribution(wheel):
    names = set(wheel.namelist())
    for f in [*TRACES.values(), "ATTRIBUTION.md", "LICENSE-azure-cc-by-4.0.txt", "LICENSE-mooncake-apache-2.0.txt"]:
        assert f"kvlab/data/traces/{f}" in names, f
    for f in TRACES.values():
        assert wheel.read(f"kvlab/data/traces/{f}") == (DATA / f).read_bytes()


def test_bundled_files_are_the_sources_unmodified():
    text = (DATA / "ATTRIBUTION.md").read_text()
    for f in TRACES.values():
        assert f"{hashlib.sha256((DATA / f).read_bytes()).hexdigest()}  {f}" in text
    for cite in ("Splitwise: Efficient generative LLM inference using phase splitting", "ISCA 2024",
                 "Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving", "FAST 2025",
                 "AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv",
                 "FAST25-release/traces/conversation_trace.jsonl", "CC-BY 4.0", "Apache-2.0", "unmodified"):
        assert cite in text, cite
