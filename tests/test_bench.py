"""``kvlab bench --quick`` as a smoke test: every benchmark runs and reports well-formed rows. It never checks
speed (a shared CI machine is too noisy for that); the figures live in docs/benchmarks.md. The pool benchmark's
two peer-style baselines are checked to behave like pools, since every ratio it reports rests on them."""
from __future__ import annotations

import contextlib
import io
import json
import math
import random
from array import array

import pytest
from hypothesis import given, settings, strategies as st

from kvlab import BlockPool, FastBlockPool, KVLabError, hotpath_compiled
from kvlab.app import bench
from kvlab.app.cli import main

bench_pool = bench.load("bench_pool")  # once: loading executes the benchmark file


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``kvlab bench --quick`` once for the module: (the JSON it wrote, what it printed). With KVLAB_BENCH_SMOKE=1:
    bench_llm runs every part on a few tokens (its quick sizes took minutes, most of this file's time)."""
    out, buf = tmp_path_factory.mktemp("bench") / "bench.json", io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(buf):
        mp.setenv("KVLAB_BENCH_SMOKE", "1")
        assert main(["bench", "--quick", "--out", str(out)]) == 0
    return json.loads(out.read_text()), buf.getvalue(), out


def test_every_benchmark_runs_in_quick_mode_and_writes_json(quick_run):
    result, printed, out = quick_run
    names = {r["benchmark"] for r in result["rows"]}
    assert names == set(bench.available()) and len(names) >= 6
    for r in result["rows"]:
        assert r["name"] and r["unit"] is not None and math.isfinite(r["value"]), r
        assert r.get("ratio") is None or math.isfinite(r["ratio"]), r
    assert {"date", "commit", "torch", "device", "cpu_count"} <= set(result["machine"])
    assert "| benchmark | figure |" in printed and str(out) in printed


def test_only_the_smoke_test_shrinks_bench_llm_below_its_quick_sizes(monkeypatch):
    """``KVLAB_BENCH_SMOKE=1`` changes ``--quick`` only: a user's ``kvlab bench --quick`` and full runs are as they
    were."""
    llm = bench.load("bench_llm")
    monkeypatch.delenv("KVLAB_BENCH_SMOKE", raising=False)
    assert llm.sizes_for(True) == llm.QUICK and llm.sizes_for(False) == llm.FULL
    monkeypatch.setenv("KVLAB_BENCH_SMOKE", "1")
    assert llm.sizes_for(True) == llm.SMOKE != llm.QUICK and llm.sizes_for(False) == llm.FULL


def test_pool_benchmark_reports_every_row_with_a_positive_ratio(quick_run):
    """Every row is there with a positive ratio to the vLLM baseline: vLLM's own BlockPool where vLLM can be
    imported (its version named), else the model, named as such (the tests run without vLLM)."""
    result, printed, _ = quick_run
    rows = {r["name"]: r for r in result["rows"] if r["benchmark"] == "bench_pool"}
    peer = bench_pool.vllm_peer()
    assert peer.real or peer.label == "vLLM-style pool, a model of vLLM 0.33.0" and peer.why
    fast = ["FastBlockPool"] + (["PyFastBlockPool"] if hotpath_compiled else [])
    want = ["BlockPool (reference, pure Python, informational), n=1, fresh"]
    for n in (1, 16, 256):
        for state in ("fresh", "shuffled"):
            want += [bench_pool.baseline_name(peer, n, state), f"nano-vllm-style BlockManager, n={n}, {state}"]
            want += [f"{c}, n={n}, {state}, {s}" for c in fast for s in ("no subscriber", "1 subscriber")]
    assert set(want) <= set(rows), sorted(set(want) - set(rows))
    baselines = [name for name in rows if "(baseline" in name]
    assert len(baselines) == 6 and all(name.startswith(peer.label) for name in baselines)
    assert ("vLLM not importable" in baselines[0]) is not peer.real
    for name in want:
        r = rows[name]
        assert r["unit"] == "ns/block" and r["value"] > 0, r
        if "(baseline" not in name:
            assert math.isfinite(r["ratio"]) and r["ratio"] > 0 and r["baseline"] > 0, r
        if name.startswith(("BlockPool", "FastBlockPool", "PyFastBlockPool")):
            assert 0 < r["ratios"]["nano-style"] < math.inf, r
        if name.startswith(("FastBlockPool", "PyFastBlockPool")):
            assert r["goal"] == "<= 0.5x (quick: not judged)", r
    assert rows[want[0]]["goal"] is None  # the reference is shown, not judged
    created = [r for r in rows.values() if r["name"].startswith("create ")]
    assert len(created) == 3 and all(r["unit"] == "s" and r["value"] >= 0 for r in created)
    assert [r["ratio"] is None for r in created] == [True, False, False]
    assert created[0]["name"].startswith(f"create {peer.label}: ")
    assert "nano-style" in printed  # the second ratio is printed beside the first


def test_pool_benchmark_falls_back_to_the_model_and_says_so(monkeypatch, capsys):
    """Without vLLM the baseline is the model of vLLM 0.33.0: its rows say so, and so does a line on stderr."""
    monkeypatch.setattr(bench_pool, "vllm_peer", lambda: bench_pool.MODEL._replace(why="ModuleNotFoundError: x"))
    monkeypatch.setattr(bench_pool, "timing_rows", lambda quick, peer: [bench_pool._row(
        bench_pool.baseline_name(peer, 1, "fresh"), 1.0)])
    monkeypatch.setattr(bench_pool, "creation_rows", lambda quick, peer: [])
    monkeypatch.setattr(bench_pool, "copy_bandwidth", lambda quick: [])
    (row,) = bench_pool.run(quick=True)
    assert row["name"] == "vLLM-style pool, a model of vLLM 0.33.0 (baseline; vLLM not importable), n=1, fresh"
    err = capsys.readouterr().err
    assert "vLLM cannot be imported (ModuleNotFoundError: x)" in err and "requirements-vllm.txt" in err


def _real_vllm_pool_is_built_and_called_as_vllm_does():
    """Where vLLM is installed (benchmarks/requirements-vllm.txt, a 600 MB benchmark-only install, not in CI): its
    own BlockPool, prefix caching on, KV events off, no metrics collector, block 0 the null block; one timed call
    leaves it as it found it. Collected only where vLLM imports (a skip would fail CI's no-skip guard)."""
    peer = bench_pool.vllm_peer()
    assert type(peer.make(8)).__module__ == "vllm.v1.core.block_pool"
    for shuffled in (False, True):
        pool = bench_pool.vllm_pool(64, shuffled, peer.make)
        assert pool.enable_caching and not pool.enable_kv_cache_events and pool.metrics_collector is None
        assert pool.null_block.block_id == 0 and pool.get_num_free_blocks() == 63
        before = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        want = [1 + i for i in bench_pool.shuffled_order(63)] if shuffled else list(range(1, 64))
        assert before == want  # the same permutation as the model's queue
        for n in (1, 16, 63):
            pool.free_blocks(pool.get_new_blocks(n))
            assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == before


if bench_pool.vllm_peer().real:
    test_the_real_vllm_pool_is_built_and_called_as_vllm_does = _real_vllm_pool_is_built_and_called_as_vllm_does


def test_ns_per_item_measures_per_item():
    calls = []
    ns = bench.ns_per_item(lambda: calls.append(1), items=4, reps=10, rounds=2)
    assert len(calls) == 20 and ns > 0


def test_ns_per_item_together_interleaves_rounds():
    calls = []
    ns = bench.ns_per_item_together({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                    items=2, reps=3, rounds=2)
    assert calls == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    assert set(ns) == {"a", "b"} and all(v > 0 for v in ns.values())


def test_format_table_shows_extra_ratios_after_the_main_one():
    table = bench.format_table({"rows": [{"name": "x", "value": 2.0, "unit": "ns", "baseline": 4.0, "ratio": 0.5,
                                          "ratios": {"other": 0.25}}]})
    assert "| 0.5; other 0.25 |" in table


# ---------------------------------------------------------------- the baselines behave like pools
N = 8
ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache"]), st.integers(0, N),
                         st.randoms(use_true_random=False)), max_size=40)


@settings(max_examples=80, deadline=None)
@given(ops)
def test_vllm_style_pool_hands_out_and_takes_back_blocks(steps):
    """Against a model free queue (a list; block 0 is the null block, never in it): allocation takes the n at the
    head with refcount 1 and drops any hash a reused block still carries; free puts blocks reaching refcount 0 back,
    uncached ones at the head and cached ones at the tail, each in the order given; refusals change nothing."""
    pool, model, held, cached = bench_pool.VllmStylePool(N), list(range(1, N)), [], {}
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    for step, n, rnd in steps:
        if step == "alloc":
            if n > len(model):
                with pytest.raises(ValueError):
                    pool.get_new_blocks(n)
            else:
                got = pool.get_new_blocks(n)
                assert [b.block_id for b in got] == model[:n] and all(b.ref_cnt == 1 for b in got)
                assert all(b.block_hash is None for b in got)
                for b in got:
                    cached.pop(b.block_id, None)
                del model[:n]
                held += got
        elif step == "cache" and held:
            b = rnd.choice(held)
            key = bytes([rnd.randrange(3)])  # few keys: blocks share them
            pool.cache_block(b, key)
            keys = cached.setdefault(b.block_id, [])  # its first key on the block, further ones beside it
            if key not in keys:
                keys.append(key)
        elif step == "free" and held:
            k = min(n, len(held))
            rnd.shuffle(held)
            back, held = held[:k], held[k:]
            pool.free_blocks(back + [pool.null_block])  # the null block is skipped
            model[:0] = [b.block_id for b in back if b.block_id not in cached]
            model += [b.block_id for b in back if b.block_id in cached]
        assert pool.free_block_queue.ids() == model and pool.get_num_free_blocks() == len(model)
        assert sorted(model + [b.block_id for b in held]) == list(range(1, N))
        assert all(pool.blocks[i].ref_cnt == 0 for i in model) and all(b.ref_cnt == 1 for b in held)
        assert {i: b.block_hash for i, b in enumerate(pool.blocks) if b.block_hash is not None} == \
            {i: keys[0] for i, keys in cached.items()}
        assert pool.extra_hashes_by_block == {i: set(keys[1:]) for i, keys in cached.items() if keys[1:]}
        entries = {key: (v if isinstance(v, dict) else {v.block_id: v})
                   for key, v in pool.cached_block_hash_to_block._cache.items()}
        assert all(entries.values()) and {(key, i) for key, d in entries.items() for i in d} == \
            {(key, i) for i, keys in cached.items() for key in keys}


def test_vllm_style_pool_drops_a_reused_blocks_cached_hash_and_keeps_shared_blocks():
    pool = bench_pool.VllmStylePool(5)  # blocks 1-4 free
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")
    pool.cache_block(b, b"g")  # a second key for b: kept beside the block
    assert pool.cached_block_hash_to_block._cache == {b"h": {a.block_id: a, b.block_id: b}, b"g": b}
    assert pool.extra_hashes_by_block == {b.block_id: {b"g"}}
    pool.free_blocks([a, b])  # cached: to the tail, evicted last
    assert pool.free_block_queue.ids() == [3, 4, a.block_id, b.block_id]
    pool.get_new_blocks(3)  # blocks 3, 4, then a: a's hash goes, b's stay
    assert a.block_hash is None and pool.cached_block_hash_to_block._cache == {b"h": {b.block_id: b}, b"g": b}
    c = pool.get_new_blocks(1)[0]
    assert c is b and b.block_hash is None and len(pool.cached_block_hash_to_block) == 0
    assert pool.extra_hashes_by_block == {}
    c.ref_cnt += 1  # a second holder: the first free keeps the block out of the queue
    pool.free_blocks([c])
    assert pool.free_block_queue.ids() == [] and c.ref_cnt == 1
    pool.free_blocks([c])
    assert pool.free_block_queue.ids() == [b.block_id]


def test_vllm_style_pool_sends_another_pools_blocks_back_to_it():
    p, q = bench_pool.VllmStylePool(4), bench_pool.VllmStylePool(4)
    mine, theirs = p.get_new_blocks(2), q.get_new_blocks(1)
    p.free_blocks(iter([mine[0], theirs[0], mine[1]]))  # any iterable, as the peer takes
    assert p.free_block_queue.ids() == [1, 2, 3] and q.free_block_queue.ids() == [1, 2, 3]


@settings(max_examples=60, deadline=None)
@given(ops)
def test_nano_style_block_manager_hands_out_and_takes_back_blocks(steps):
    """Against a model deque: allocation takes the n at the left with refcount 1 (hash and tokens reset) and
    marks them used; free returns them to the right, last id first (a block table released from its end), and
    empties the table it was given."""
    mgr, model, held = bench_pool.NanoStyleBlockManager(N), list(range(N)), []
    for step, n, rnd in steps:
        if step == "alloc":
            if n > len(model):
                with pytest.raises(ValueError):
                    mgr.allocate(n)
            else:
                got = mgr.allocate(n)
                assert got == model[:n]
                assert all(mgr.blocks[b].ref_count == 1 and mgr.blocks[b].hash == -1 for b in got)
                del model[:n]
                held += got
        elif held:
            k = min(n, len(held))
            rnd.shuffle(held)
            back, held = held[:k], held[k:]
            table = list(back)
            mgr.free(table)
            assert table == []
            model += back[::-1]
        assert list(mgr.free_block_ids) == model and mgr.used_block_ids == set(held)
        assert all(mgr.blocks[i].ref_count == 0 for i in model) and mgr.hash_to_block_id == {}



FLOOR_FIELDS = ("status", "refcount", "hits", "last_access", "created", "owner", "tokens", "reusable")
FLOOR_STEPS = st.lists(st.tuples(st.sampled_from(["alloc", "free", "bad", "pending", "reusable"]), st.integers(0, N),
                                 st.integers(-1, 3), st.randoms(use_true_random=False)), max_size=40)
FLOOR_BAD = [("allocate", (-1,), {}), ("allocate", (1.0,), {}), ("allocate", (True,), {}),
             ("allocate", (1,), {"owner": -2}), ("free", ([N],), {}), ("free", ([0.0],), {})]


def run_beside_the_reference(floor, steps) -> None:
    """Drive :class:`BlockPool` and the benchmark's :class:`InlinedReference` with the same random allocations
    (with owners, some PENDING), frees (ids repeated, sometimes more often than held), blocks marked reusable and
    bad arguments; after each step both must have given the same ids or refused, and hold the same fields, free
    stack, clock, counters, cached blocks and events."""
    ref, held, seen = BlockPool(N, with_storage=False), [], ([], [])
    ref.events.subscribe(seen[0].append)
    floor.events.subscribe(seen[1].append)
    for step, n, owner, rnd in steps:
        if step in ("alloc", "pending"):
            if n > len(floor.stacks[0]) and floor.cached:
                continue  # the reference would evict, which the floor leaves out
            call, args, kw = "allocate", (n,), {"owner": owner, **({"status": 1} if step == "pending" else {})}
        elif step == "free":
            call, args, kw = "free", ([rnd.choice(held) for _ in range(n)] if held else [],), {}
        elif step == "reusable":
            if held:
                b = rnd.choice(held)
                if ref.arrays.status[b] == 2:  # marking is no work of the floor's: the test does it there
                    ref.mark_reusable([b])
                    floor.reusable[b] = 1
                    floor.clock.tick()
                    floor.lock_acquisitions += 1
            continue
        else:
            call, args, kw = rnd.choice(FLOOR_BAD)
        got = []
        for pool in (ref, floor):
            try:
                got.append(("ok", getattr(pool, call)(*args, **kw)))
            except (KVLabError, ValueError):
                got.append(("refused", None))
        assert got[0] == got[1], (call, args, kw)
        if got[0][0] == "ok":
            for b in got[0][1] or ():
                held.append(b)
            for b in args[0] if call == "free" else ():
                held.remove(b)
        for name in FLOOR_FIELDS:
            assert list(getattr(ref.arrays, name)) == list(getattr(floor, name)), name
        assert ref.free_ids() == list(floor.stacks[0])[::-1] and ref.clock.now() == floor.clock.now()
        assert {k: ref.counts[k] for k in floor.counts} == floor.counts
        assert ref.lock_acquisitions == floor.lock_acquisitions
        assert {b for b, _ in ref.policy.order()} == floor.cached and seen[0] == seen[1]


@pytest.mark.parametrize("fields", [list, array])
@settings(max_examples=80, deadline=None)
@given(steps=FLOOR_STEPS)
def test_inlined_reference_does_all_the_reference_does(fields, steps):
    """The InlinedReference rows time the reference's own work: same ids, refusals, fields, stack, clock,
    counters, cached blocks and events, PENDING blocks and reusable ones included."""
    run_beside_the_reference(bench_pool.InlinedReference(N, fields), steps)


@pytest.mark.parametrize("fields", [list, array])
def test_inlined_reference_caches_and_aborts_as_the_reference_does(fields):
    """The paths random steps may miss in a derandomized run: a reusable block freed to cached, a PENDING block
    freed (aborted), a held block freed twice at once, an allocation that would need eviction skipped."""
    rnd = random.Random(0)
    steps = [("alloc", 1, 0, rnd), ("reusable", 0, 0, rnd), ("free", 1, 0, rnd), ("pending", 1, 2, rnd),
             ("free", 1, 0, rnd), ("alloc", 1, 3, rnd), ("free", 2, 0, rnd), ("alloc", N, 0, rnd)]
    floor = bench_pool.InlinedReference(N, fields)  # one block held at a time, so every free picks it
    run_beside_the_reference(floor, steps)
    assert floor.cached == {0} and floor.counts == {"allocations": 3, "frees": 2, "served_free": 3}


def test_shuffled_pools_hold_the_same_permutation_and_every_block():
    order = bench_pool.shuffled_order(64)
    assert sorted(order) == list(range(64)) and order != list(range(64))
    vllm_order = [1 + i for i in bench_pool.shuffled_order(63)]  # block 0 is the null block
    assert bench_pool.vllm_pool(64, shuffled=True).free_block_queue.ids() == vllm_order
    assert bench_pool.vllm_pool(64, shuffled=False).free_block_queue.ids() == list(range(1, 64))
    assert list(bench_pool.nano_pool(64, shuffled=True).free_block_ids) == order[::-1]
    for cls in (BlockPool, FastBlockPool):
        pool = bench_pool.kvlab_pool(cls, 64, shuffled=True, subscriber=True)
        assert pool.free_ids() == order and pool.events  # someone listens
        pool.check_invariants()


def test_timed_calls_leave_the_baselines_as_they_were():
    """One timed call, ``free(allocate(n))``, returns every baseline to the state it found (so every round times
    the same work)."""
    for shuffled in (False, True):
        v, nm = bench_pool.vllm_pool(64, shuffled), bench_pool.nano_pool(64, shuffled)
        before_v, before_n = v.free_block_queue.ids(), list(nm.free_block_ids)
        for n in (1, 16, 63):
            v.free_blocks(v.get_new_blocks(n))
            assert v.free_block_queue.ids() == before_v
        for n in (1, 16, 64):
            nm.free(nm.allocate(n))
            assert sorted(nm.free_block_ids) == sorted(before_n) and not nm.used_block_ids


# ---------------------------------------------------------------- bench_engine's model of nano-vllm (bb823b3)
bench_engine = bench.load("bench_engine")


def _nano_prefill(mgr, seq):
    """Admission and one prefill chunk of the whole rest, as nano-vllm's scheduler and postprocess do it."""
    hits = mgr.can_allocate(seq)
    assert hits != -1
    mgr.allocate(seq, hits)
    seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
    mgr.hash_blocks(seq)
    seq.num_cached_tokens += seq.num_scheduled_tokens
    seq.num_scheduled_tokens = 0
    return hits


def test_nano_model_caches_full_blocks_after_compute_and_hits_a_prefix_but_its_last_block(monkeypatch):
    """Full blocks are registered by ``hash_blocks`` once computed; a later prompt hits its cached prefix, never
    its own last block (even a full one); a hit on a block in use shares it, a hit on a freed one takes it back
    from the deque; freed blocks keep their hashes until ``_allocate_block`` hands them out again."""
    monkeypatch.setattr(bench_engine.NanoSeq, "block_size", 4)
    mgr, Seq = bench_engine.NanoReplayManager(8, 4), bench_engine.NanoSeq
    a = Seq(list(range(12)))  # three full blocks
    assert _nano_prefill(mgr, a) == 0 and a.block_table == [0, 1, 2] and len(mgr.hash_to_block_id) == 3
    b = Seq(list(range(8)) + [90, 91])  # two shared blocks and a partial one
    assert _nano_prefill(mgr, b) == 2 and b.block_table == [0, 1, 3]
    assert [mgr.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    c = Seq(list(range(12)))  # all three blocks cached, but the last one is computed again
    assert mgr.can_allocate(c) == 2
    mgr.deallocate(a)
    assert list(mgr.free_block_ids) == [4, 5, 6, 7, 2] and mgr.blocks[2].hash != -1
    d = Seq(list(range(12)) + [5])  # now hits all three, the third one taken back from the deque
    assert _nano_prefill(mgr, d) == 3 and d.block_table == [0, 1, 2, 4] and 2 not in mgr.free_block_ids
    for seq in (b, d):
        mgr.deallocate(seq)
    assert not mgr.used_block_ids and sorted(mgr.free_block_ids) == list(range(8))
    cached = mgr.blocks[0].hash  # block 0 is handed out again (after 5, 6, 7, ...): its hash entry goes
    for _ in range(8):
        mgr._allocate_block()
    assert cached not in mgr.hash_to_block_id and all(mgr.blocks[i].hash == -1 for i in range(8))


def test_nano_model_allocates_and_hashes_decoded_blocks_as_nano_vllm():
    """Decode: ``may_append`` takes a block when the length is one past a boundary; the block that a step's
    token fills is hashed after that step, chained on the block before it."""
    mgr, seq = bench_engine.NanoReplayManager(4, 4), bench_engine.NanoSeq([1, 2, 3])
    seq.block_size = 4
    _nano_prefill(mgr, seq)
    for token in (4, 5, 6, 7, 8):
        seq.append_token(token)
        assert mgr.can_append(seq)
        seq.num_scheduled_tokens = 1
        mgr.may_append(seq)
        mgr.hash_blocks(seq)
        seq.num_cached_tokens += 1
        seq.num_scheduled_tokens = 0
    assert seq.block_table == [0, 1] and seq.num_cached_tokens == 8
    first = mgr.compute_hash([1, 2, 3, 4])
    assert mgr.blocks[0].hash == first and mgr.blocks[1].hash == mgr.compute_hash([5, 6, 7, 8], first)
    assert mgr.compute_hash([5, 6, 7, 8], first) != mgr.compute_hash([5, 6, 7, 8])


def test_nano_model_hashes_as_nano_vllm():
    xxhash = pytest.importorskip("xxhash")
    import numpy as np

    h = bench_engine.NanoReplayManager.compute_hash([3, 1, 4], 7)
    assert h == xxhash.xxh64((7).to_bytes(8, "little") + np.array([3, 1, 4]).tobytes()).intdigest()


def test_replay_finds_the_same_cached_prompt_tokens_in_kvlab_and_the_nano_model():
    ops, cfg = bench_engine.record(300)
    kvlab_hits = bench_engine.replay_kvlab(ops, cfg.num_blocks, cfg.block_size)
    assert kvlab_hits > 0 and bench_engine.replay_nano(ops, cfg.num_blocks, cfg.block_size) == kvlab_hits


def test_the_rows_name_the_commit_measured(tmp_path, monkeypatch):
    """In a git checkout the machine line names HEAD (``+changes`` when kvlab's or the benchmarks' files differ
    from it); an installed copy with no checkout around it names none."""
    import subprocess

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=bench.Path(bench.__file__).resolve().parents[2])
    if head.returncode == 0:
        assert bench.commit() in (head.stdout.strip(), head.stdout.strip() + "+changes")
        assert f"commit {bench.commit()}" in bench.report({"machine": bench.machine(), "quick": True, "rows": []})
    fake = tmp_path / "site-packages" / "kvlab" / "app" / "bench.py"
    fake.parent.mkdir(parents=True)
    monkeypatch.setattr(bench, "__file__", str(fake))
    assert bench.commit() is None
    assert "commit" not in bench.report({"machine": bench.machine(), "quick": True, "rows": []}).splitlines()[0]
