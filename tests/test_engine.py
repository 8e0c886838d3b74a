"""Engine: determinism, completion without leaks, preemption by recompute and swap, prefetch, tenant quotas,
real mode against the model without paging, the sequence/prefix fast paths it relies on, and the baseline."""
from __future__ import annotations

import pytest

from kvlab import BlockPool, KVSpec
from kvlab.memory.baseline import ContiguousAllocator
from kvlab.serve.config import CostModel, EngineConfig
from kvlab.serve.engine import Engine
from kvlab.serve.events import Admitted, Finished, Preempted, SwappedIn, TenantReclaimed
from kvlab.core.errors import ConfigError, DoubleFreeError, OutOfBlocksError
from kvlab.core.events import EventRecorder
from kvlab.serve.metrics import StepMetrics
from kvlab.serve.model import TinyConfig, TinyLlama
from kvlab.core.prefix import PrefixHit, PrefixStored
from kvlab.core.sequence import SequenceManager
from kvlab.workloads.mixes import Request, make_workload
from kvlab.workloads.traces import prefix_hit_bound


def _drained(e: Engine, aborted: str = "") -> None:
    """Every request finished: no sequence and no referenced block is left, only cached prefix blocks."""
    e.check_invariants()
    pool = e.memory.pool
    assert not e.memory.manager.seqs and not e.running and not e.swapped
    assert not pool.arrays.refcount.any(), "a block is still referenced after every request finished"
    assert pool.num_free_blocks + pool.num_cached_blocks == pool.num_blocks
    assert all(r.finish_step >= 0 for r in e.log.requests.values() if r.tenant != aborted)


def test_same_seed_same_metrics():
    w = make_workload("chat", 200, seed=3, rate=100)
    a, b = Engine(w, num_blocks=512).run(), Engine(w, num_blocks=512).run()
    assert a == b and a["finished"] == 200


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_completes_every_request(mode):
    w = make_workload("document", 40, seed=1, rate=50)
    e = Engine(w, num_blocks=400, max_model_len=8192, preemption=mode, prefix_caching=False)
    rec = EventRecorder(e.events, (Preempted,))
    s = e.run()
    assert s["finished"] == 40 and s["preemptions"] > 0 and len(rec) == s["preemptions"]
    assert {ev.mode for ev in rec} == {mode}
    _drained(e)
    assert e.memory.pool.num_free_blocks == 400


def test_swap_keeps_prefix_sharing_and_completes():
    """With prefix caching, a swap moves only private blocks; shared and cached ones stay resident (a victim
    holding nothing else is recomputed instead) and every request still finishes."""
    w = make_workload("document", 30, seed=1, rate=50)
    e = Engine(w, num_blocks=400, max_model_len=8192, preemption="swap")
    rec = EventRecorder(e.events, (Preempted,))
    resident = 0  # blocks swapped requests keep in the pool (shared or named by the cache)
    while e.step():
        resident = max(resident, sum(e.memory.held(j) for j in e.swapped))
        assert all(e.memory.held(j) == len(j.kv.block_table) - e.memory.swap_need(j) for j in e.swapped)
    s = e.summary()
    assert s["finished"] == 30 and s["prefix_hit_tokens"] > 0 and resident > 0
    assert "swap" in {ev.mode for ev in rec} and s["swap_ins"] > 0
    _drained(e)


def test_prefetch_hides_swap_in_stalls():
    """Same swap-heavy run with and without prefetch: same requests finish; prefetched swap-ins overlap compute,
    so the seconds steps spend waiting on host copies drop."""
    w = make_workload("document", 40, seed=1, rate=50)
    cfg = dict(num_blocks=400, max_model_len=8192, preemption="swap", prefix_caching=False)
    on, off = Engine(w, prefetch=True, **cfg), Engine(w, prefetch=False, **cfg)
    rec = EventRecorder(on.events, (SwappedIn,))
    a, b = on.run(), off.run()
    assert a["finished"] == b["finished"] == 40
    assert a["prefetched_swap_ins"] > 0 == b["prefetched_swap_ins"]
    assert sum(ev.prefetched for ev in rec) == a["prefetched_swap_ins"]
    assert a["swap_in_stall_s"] < b["swap_in_stall_s"] and a["swap_stall_s"] < b["swap_stall_s"]
    assert a["swap_stall_s"] == pytest.approx(on.log.series("stall_s").sum())
    _drained(on), _drained(off)


def test_no_prefix_caching_frees_everything():
    e = Engine(make_workload("chat", 100, seed=2, rate=80), num_blocks=256, prefix_caching=False)
    e.run()
    _drained(e)
    assert e.memory.pool.num_free_blocks == 256


def test_prefix_cache_saves_prefill_and_events_share_the_pool_bus():
    w = make_workload("chat", 150, seed=4, rate=60)
    e = Engine(w, num_blocks=1024)
    rec = EventRecorder(e.events, (Admitted, Finished, StepMetrics, PrefixHit))
    on, off = e.run(), Engine(w, num_blocks=1024, prefix_caching=False).run()
    assert on["prefix_hit_tokens"] > 0 and off["prefix_hit_tokens"] == 0 and on["prefix_hit_rate"] > 0.3
    assert e.events is e.memory.pool.events
    kinds = {type(ev) for ev in rec}
    assert kinds == {Admitted, Finished, StepMetrics, PrefixHit}
    assert sum(ev.tokens for ev in rec if isinstance(ev, PrefixHit)) == on["prefix_hit_tokens"]
    _drained(e)


MODEL = TinyLlama(TinyConfig())


def _real_requests() -> list[Request]:
    shared = tuple(range(10, 30))  # 5 blocks of 4 shared by every prompt: prefix hits
    return [Request(i, 0.0, 20 + (i % 3) * 5, 5 + i % 4,
                    prompt_tokens=shared + tuple((i * 7 + k) % 101 for k in range((i % 3) * 5))) for i in range(8)]


@pytest.mark.parametrize("mode, shared", [("recompute", "wait"), ("swap", "wait"), ("recompute", "duplicate"),
                                          ("swap", "duplicate")])
def test_real_mode_tokens_equal_the_model_without_paging(mode, shared):
    """The tiny decoder through the engine's paged KV tensor, with chunked prefill, prefix hits and preemption,
    generates exactly the tokens of full recomputation without any cache."""
    reqs = _real_requests()
    e = Engine(reqs, model=MODEL, num_blocks=16 if shared == "duplicate" else 12, block_size=4, max_model_len=64,
               max_batched_tokens=16, preemption=mode, shared_prefill=shared)
    rec = EventRecorder(e.events, (Preempted,))
    s = e.run()
    assert s["finished"] == 8 and s["prefix_hit_tokens"] > 0 and mode in {ev.mode for ev in rec}
    assert e.memory.pool.storage is not None
    for r in reqs:
        assert e.outputs[r.id] == MODEL.generate_full(r.prompt_tokens, r.output_len), f"request {r.id}"
    _drained(e)


def test_engine_fast_paths_agree_with_sequence_and_prefix_api():
    """append_tokens does append_batch's bookkeeping; peek is match without references or counting."""
    runs = []
    for fast in (False, True):
        mgr = SequenceManager(BlockPool(32, spec=KVSpec(block_size=4)), prefix_cache=True)
        a = mgr.create(list(range(9)))
        (mgr.append_tokens if fast else mgr.append_batch)([a], [list(range(9))])
        mgr.cache_full_blocks(a)
        b = a.fork()
        (mgr.append_tokens if fast else mgr.append_batch)([a, b], [[1, 2], [3]])  # b's tail is copied first
        mgr.check_invariants()
        runs.append(([s.block_table for s in (a, b)], [s.token_ids for s in (a, b)],
                     mgr.pool.arrays.tokens.tolist(), mgr.pool.arrays.refcount.tolist()))
    assert runs[0] == runs[1]
    cache = mgr.prefix_cache
    before = (cache.get_stats(), mgr.pool.arrays.refcount.tolist())
    peeked = cache.peek(list(range(9)) + [5], None)
    assert (cache.get_stats(), mgr.pool.arrays.refcount.tolist()) == before
    assert peeked == cache.match(list(range(9)) + [5], None)[0] == a.block_table[:2]


def test_quota_respected_every_step_and_reservation_isolates():
    heavy = [Request(i, 0.0, 900, 300, tenant="heavy") for i in range(40)]
    light = [Request(100 + i, 0.5 * i, 60, 20, tenant="light") for i in range(10)]
    cfg = EngineConfig(num_blocks=300, max_model_len=2048, quotas={"heavy": 200}, reservations={"light": 60})
    e = Engine(heavy + light, cfg)
    rec = EventRecorder(e.events, (StepMetrics,))
    e.run()
    _drained(e)
    assert max(dict(m.tenant_blocks).get("heavy", 0) for m in rec) <= 200
    light_wait = max(e.log.requests[100 + i].ttft_steps for i in range(10))
    assert light_wait < 20, "the light tenant waited behind the heavy one despite its reservation"


def test_remove_tenant_reclaims_all_its_blocks():
    reqs = [Request(i, 0.0, 200, 100, tenant=f"t{i % 2}") for i in range(20)]
    e = Engine(reqs, num_blocks=400, prefix_caching=False)
    for _ in range(10):
        e.step()
    held = e.held["t1"]
    assert held > 0
    rec = EventRecorder(e.events, (TenantReclaimed,))
    free_before = e.memory.pool.num_free_blocks
    assert e.remove_tenant("t1") == held
    assert e.memory.pool.num_free_blocks == free_before + held and rec.events[0].blocks == held
    e.run()
    _drained(e, aborted="t1")
    assert {r.tenant for r in e.log.finished()} == {"t0"}


def test_contiguous_baseline_wastes_what_paging_saves():
    w = make_workload("chat", 300, seed=5, rate=200)
    paged = Engine(w, num_blocks=1024).run()
    e = Engine(w, num_blocks=1024, memory="contiguous")
    base = e.run()
    e.check_invariants()
    assert e.memory.arena.reserved == 0 and e.memory.gauges().token_slots == 0
    assert base["finished"] == 300 and base["preemptions"] == 0
    assert paged["internal_waste"] < 0.1 < 0.5 < base["internal_waste"]
    assert paged["max_running"] > base["max_running"]


def test_step_api_and_config_errors():
    e = Engine([Request(0, 0.0, 5, 3)], num_blocks=8, block_size=4)
    steps = 0
    while e.step():
        steps += 1
    assert steps == 3 and not e.step() and e.log.requests[0].tpot_steps == 1
    with pytest.raises(ConfigError, match="max_model_len"):
        Engine([Request(0, 0.0, 3000, 10)], max_model_len=2048)
    with pytest.raises(ConfigError, match="preemption"):
        EngineConfig(preemption="drop")
    with pytest.raises(ConfigError, match="reservations"):
        EngineConfig(num_blocks=10, reservations={"a": 11})
    with pytest.raises(ConfigError, match="more blocks than their tenant"):
        Engine([Request(0, 0.0, 100, 10, tenant="a")], num_blocks=64, block_size=4, quotas={"a": 20})
    cfg = EngineConfig(quotas={"a": 5})
    e = Engine([], cfg)
    e.remove_tenant("a")
    assert cfg.quotas == {"a": 5}, "the engine edited the caller's config"


def test_contiguous_allocator_first_fit_and_merge():
    a = ContiguousAllocator(100)
    assert [a.reserve(i, 30) for i in range(3)] == [0, 30, 60]
    with pytest.raises(OutOfBlocksError, match="longest run is 10"):
        a.reserve(9, 20)
    a.release(1)
    assert a.fragmentation() == pytest.approx(0.25) and a.reserve(4, 20) == 30
    a.release(0), a.release(4), a.release(2)
    a.check_invariants()
    assert a.largest_free == 100
    with pytest.raises(DoubleFreeError, match="owner 2"):
        a.release(2)


# ---------------------------------------------------------------------------------------------------- metrics
def test_kv_usage_by_block_and_by_token_part_on_half_empty_blocks():
    """Two 17-token prompts at block size 16 on a 6-block pool: after the second step one request holds 18
    tokens (its first output token went in) and the other 17, in two blocks each: 4 of 6 blocks (66.7%) are in
    use, but only 35 of 96 token slots (36.5%)."""
    reqs = [Request(0, 0.0, 17, 3), Request(1, 0.001, 17, 3)]  # the second arrives during the first step
    e = Engine(reqs, num_blocks=6, block_size=16)
    e.step()
    e.step()
    m = e.log.steps[-1]
    assert (m.used_slots, m.used_tokens) == (4 * 16, 35)
    assert round(m.usage_by_block, 3) == 0.667 and round(m.usage_by_token, 3) == 0.365
    assert m.utilisation == m.usage_by_token  # nothing is cached yet
    e.run()
    s = e.summary()
    assert 0 < s["usage_by_token"] < s["usage_by_block"] <= s["peak_usage_by_block"] <= 1


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_usage_gauges_equal_a_pass_over_the_pool(mode):
    """The O(sequences) gauges against the pool's own arrays after every step, with prefix hits (shared full
    blocks), cached blocks, evictions and preemptions."""
    w = make_workload("chat", 120, seed=5, rate=400, prefix_share=0.8)
    e = Engine(w, num_blocks=160, max_batched_tokens=256, preemption=mode)
    pool, refreshed = e.memory.pool, 0
    while e.step():
        a = pool.arrays
        held = a.refcount > 0
        m = e.log.steps[-1]
        assert m.used_slots == int(held.sum()) * 16 and m.used_tokens == int(a.tokens[held].sum())
        assert m.token_slots == int(a.tokens.sum())
        refreshed += bool(pool.num_cached_blocks)
    s = e.summary()
    assert refreshed and s["evictions"] and s["prefix_hit_tokens"]


def test_prefix_counters_are_in_tokens_and_lifetimes_come_from_evictions():
    """The hit counters are vLLM 0.34.0's: a request's first admission counts as a query (its prompt) and a hit
    (its cached prefix); a readmission after a preemption finds the request's own blocks again and is counted
    apart (vLLM's preempted_queries and preempted_hits). Together they are every lookup the cache saw."""
    w = make_workload("chat", 150, seed=2, rate=300, prefix_share=0.9)
    e = Engine(w, num_blocks=200, max_batched_tokens=256)
    s = e.run()
    cache, records = e.memory.cache, e.log.requests
    assert s["preemptions"] > 0 and s["preempted_hit_tokens"] == sum(r.preempted_hit_tokens
                                                                    for r in records.values()) > 0
    assert s["prefix_cache_queries"] == sum(r.prompt_len for r in w.requests)
    assert s["prefix_cache_queries"] + e.preempted_query_tokens == cache.query_tokens
    assert s["prefix_cache_hits"] + s["preempted_hit_tokens"] == cache.hit_tokens
    assert s["prefix_cache_hits"] == s["prefix_hit_tokens"] == sum(r.prefix_hit_tokens for r in records.values())
    assert 0 < s["prefix_hit_tokens"] <= prefix_hit_bound(w, 16)  # an unbounded cache serves no more
    assert all(records[r.id].prefix_hit_tokens <= (r.prompt_len - 1) // 16 * 16 for r in w.requests)
    assert s["prefix_hit_rate"] == pytest.approx(s["prefix_cache_hits"] / s["prefix_cache_queries"])
    life = e.memory.lifetimes
    assert s["block_lifetime_count"] == s["idle_before_evict_count"] == len(life.lifetime) == s["evictions"] > 0
    assert all(0 <= i <= t for i, t in zip(life.idle, life.lifetime))
    assert s["idle_before_evict_p50_ticks"] <= s["idle_before_evict_p90_ticks"] <= s["idle_before_evict_max_ticks"]
    assert s["reuse_gap_count"] == len(cache.reuse_gaps) > 0 and min(cache.reuse_gaps) > 0


def test_generated_blocks_are_registered_at_release_and_serve_a_follow_up():
    """A prefill registers its full blocks at once; decode steps register nothing; the request's generated full
    blocks are registered when it is released, and a follow-up turn (prompt = the first turn's prompt and reply)
    hits them."""
    prompt = list(range(100, 120))  # 20 tokens: one full block
    reply = [(0 * 7919 + i) % 32000 for i in range(20)]  # the metadata engine's stand-in samples of request 0
    reqs = [Request(0, 0.0, 20, 20, prompt_tokens=tuple(prompt)),
            Request(1, 10.0, 45, 2, prompt_tokens=tuple(prompt + reply + [7] * 5))]
    e = Engine(reqs, num_blocks=64, block_size=16)
    rec = EventRecorder(e.events, (PrefixStored, StepMetrics, Finished))
    e.run()
    first = [type(ev).__name__ for ev in rec.events[:rec.events.index(rec.of(Finished)[0]) + 1]]
    steps_with_stores = {i for i, kind in enumerate(first) if kind == "PrefixStored"}
    assert first[0] == "PrefixStored" and first[-2:] == ["PrefixStored", "Finished"]  # prefill, then release
    assert len(steps_with_stores) == 2  # nothing in between: the decode steps stored no block
    assert e.log.requests[1].prefix_hit_tokens == 32  # the prompt's block and the block of prompt + reply


def test_a_request_waits_for_a_shared_prefill_in_flight_and_then_hits_it():
    """Two requests arriving together with the same 64-token document: with ``shared_prefill="wait"`` the second
    is held back while the first computes the document, then takes all of it from the cache; with
    ``"duplicate"`` (vLLM's behaviour) it computes the document a second time."""
    doc = tuple(range(100, 164))
    reqs = [Request(i, 0.0, 72, 2, prompt_tokens=doc + tuple(range(i * 8, i * 8 + 8))) for i in range(2)]
    hits = {}
    for shared in ("wait", "duplicate"):
        e = Engine(reqs, num_blocks=64, block_size=8, max_batched_tokens=256, shared_prefill=shared)
        rec = EventRecorder(e.events, (Admitted,))
        s = e.run()
        hits[shared] = (s["prefix_hit_tokens"], [(ev.request_id, ev.engine_step, ev.cached_tokens) for ev in rec])
        _drained(e)
    assert hits["wait"] == (64, [(0, 0, 0), (1, 1, 64)])  # admitted once request 0 has cached the document
    assert hits["duplicate"] == (0, [(0, 0, 0), (1, 0, 0)])


def test_with_a_pool_that_keeps_everything_hits_equal_the_bound():
    """The first 400 Mooncake requests (real arrival times, shared conversation prefixes arriving together):
    waiting for shared prefills reaches :func:`kvlab.prefix_hit_bound`; duplicating them falls short by the one
    512-token block request 1 computes beside request 0, and by nothing more: what follows it is registered."""
    from kvlab import load_trace, prefix_hit_bound
    from kvlab.workloads.mixes import Workload

    w = Workload("first 400", load_trace("mooncake-conversation").requests[:400])
    cfg = dict(num_blocks=400_000, block_size=16, max_model_len=131072, max_batched_tokens=8192)
    got = {shared: Engine(w, shared_prefill=shared, **cfg).run() for shared in ("wait", "duplicate")}
    assert got["wait"]["evictions"] == got["wait"]["preemptions"] == 0
    assert got["wait"]["prefix_hit_tokens"] == prefix_hit_bound(w, 16)
    assert got["duplicate"]["prefix_hit_tokens"] == prefix_hit_bound(w, 16) - 512


@pytest.mark.parametrize("kwargs, word", [
    (dict(policy="opt", prefix_caching=False), "prefix_caching=True"),
    (dict(policy="opt", memory="contiguous"), "memory='paged'"),
    (dict(shared_prefill="sometimes"), "shared_prefill"),
])
def test_engine_settings_that_cannot_work_are_refused(kwargs, word):
    with pytest.raises(ConfigError, match=word):
        Engine(make_workload("chat", 5, 0), EngineConfig(**kwargs))


def test_opt_knows_the_future_so_it_takes_no_requests_added_later():
    e = Engine(make_workload("chat", 5, 0), EngineConfig(policy="opt"))
    with pytest.raises(ConfigError, match="cannot take requests added later"):
        e.add_requests(make_workload("chat", 2, 1).requests)
    assert e.run()["finished"] == 5


def test_a_request_no_reservation_leaves_room_for_is_refused_up_front():
    """Two tenants reserve 2 blocks each of a 4-block pool and each sends a request needing 3: neither could ever
    run (each would wait for the other's reserved blocks, forever), so the engine refuses them when built, and
    ``add_requests`` refuses such a request and keeps what it had."""
    cfg = EngineConfig(num_blocks=4, block_size=16, max_model_len=64, prefix_caching=False,
                       reservations={"a": 2, "b": 2})
    with pytest.raises(ConfigError, match=r"requests \[0, 1\] need more blocks than their tenant may ever hold"):
        Engine([Request(0, 0.0, 32, 10, tenant="b"), Request(1, 0.0, 32, 10, tenant="a")], cfg)
    e = Engine([Request(0, 0.0, 16, 10, tenant="b")], cfg)
    with pytest.raises(ConfigError, match=r"requests \[1\]"):
        e.add_requests([Request(1, 0.0, 32, 10, tenant="a")])
    assert e.num_waiting == 0 and e.run()["finished"] == 1  # the refused request was never added
    bigger = Engine([Request(0, 0.0, 32, 10, tenant="b"), Request(1, 0.0, 32, 10, tenant="a")],
                    EngineConfig(num_blocks=6, block_size=16, max_model_len=64, prefix_caching=False,
                                 reservations={"a": 2, "b": 2}))
    assert bigger.run(max_steps=1000)["finished"] == 2


def test_preemption_takes_the_most_recently_admitted_request():
    """Three one-block prompts decoding 40 tokens in 5 blocks: growth forces preemptions; the first victim is
    the request admitted last (id 2), which has made the least progress."""
    e = Engine([Request(i, 0.0, 16, 40) for i in range(3)],
               EngineConfig(num_blocks=5, block_size=16, max_model_len=64, prefix_caching=False))
    rec = EventRecorder(e.events, (Preempted,))
    assert e.run()["finished"] == 3
    assert rec.events and rec.events[0].request_id == 2


def test_tpot_is_the_mean_gap_between_output_tokens_of_multi_token_outputs():
    """TPOT divides a request's decode time by its output tokens less one, and a one-token output has none."""
    e = Engine([Request(0, 0.0, 16, 5), Request(1, 0.0, 16, 1)], EngineConfig(num_blocks=64, block_size=16))
    s = e.run()
    r = e.log.requests[0]
    assert r.tpot_steps == 1.0 and r.tpot_s == pytest.approx((r.finish_s - r.first_s) / 4)
    assert s["tpot_mean_s"] == pytest.approx(r.tpot_s) and s["tpot_mean_s"] > 0


def test_usage_by_token_is_averaged_over_busy_steps_only():
    e = Engine([Request(0, 0.0, 40, 8), Request(1, 50.0, 40, 8)], EngineConfig(num_blocks=64, block_size=16))
    s = e.run()
    busy = [m.usage_by_token for m in e.log.steps if m.running]
    assert len(busy) < len(e.log.steps)  # an idle step between the two requests
    assert s["usage_by_token"] == pytest.approx(sum(busy) / len(busy))


def test_an_exact_contiguous_region_is_charged_in_whole_blocks():
    """17 + 3 = 20 token slots at block size 16 hold 2 blocks' worth of memory, and the tenant is charged 2."""
    e = Engine([Request(0, 0.0, 17, 3)], EngineConfig(num_blocks=8, block_size=16, memory="contiguous-exact"))
    e.step()
    assert e.memory.held(e.running[0]) == 2 and dict(e.log.steps[-1].tenant_blocks) == {"default": 2}


def test_a_tenant_exactly_at_its_reservation_is_never_the_victim():
    """Tenant a's two requests hold its 4 reserved blocks, tenant b's one request (admitted last) exactly its 2,
    the whole pool. When a needs a fifth block, both tenants are equally far (zero blocks) above their
    reservations; b is not above its own, so the victim is a's request admitted last, not b's."""
    reqs = [Request(0, 0.0, 31, 20, tenant="a"), Request(1, 0.0, 31, 20, tenant="a"),
            Request(2, 0.001, 17, 15, tenant="b")]  # b arrives a moment later: admitted after a's two
    e = Engine(reqs, EngineConfig(num_blocks=6, block_size=16, max_model_len=64, prefix_caching=False,
                                  reservations={"a": 4, "b": 2}))
    rec = EventRecorder(e.events, (Preempted,))
    assert e.run()["finished"] == 3
    assert [(p.tenant, p.request_id) for p in rec.events] == [("a", 1)]


@pytest.mark.parametrize("memory,req", [("contiguous", Request(0, 0.0, 4, 4)),
                                        ("contiguous-exact", Request(0, 0.0, 40, 4))])
def test_a_request_no_contiguous_region_can_hold_is_refused_up_front(memory, req):
    """One 16-token block of arena: a max-length region of 32 tokens, or an exact one of 44, never fits, so the
    request would wait forever; it is refused when the engine is built (and when added later)."""
    cfg = EngineConfig(memory=memory, num_blocks=1, block_size=16, max_model_len=64 if "exact" in memory else 32)
    with pytest.raises(ConfigError, match=r"requests \[0\] need more blocks"):
        Engine([req], cfg)
    e = Engine([], cfg)
    with pytest.raises(ConfigError, match=r"requests \[0\] need more blocks"):
        e.add_requests([req])
    assert e.run()["requests"] == 0


def test_request_ids_given_twice_are_refused_and_nothing_is_queued():
    a, b = Request(0, 0.0, 20, 5), Request(0, 1.0, 40, 9)
    with pytest.raises(ConfigError, match=r"request ids \[0\] are given more than once"):
        Engine([a, b], EngineConfig(num_blocks=64))
    e = Engine([a], EngineConfig(num_blocks=64))
    e.step()
    for more in ([b], [Request(1, 1.0, 8, 2), Request(1, 2.0, 8, 2)]):
        with pytest.raises(ConfigError, match="given more than once"):
            e.add_requests(more)
    e.add_requests([Request(1, 1.0, 8, 2)])
    assert e.run()["finished"] == 2 and set(e.outputs) == {0, 1}


@pytest.mark.parametrize("bad", [dict(policy=None), dict(policy="LRU"), dict(policy=["lru"]),
                                 dict(prefix_caching=1), dict(prefetch="yes"), dict(prefetch=None),
                                 dict(quotas=None), dict(quotas={5: 3}), dict(quotas={"a": True}),
                                 dict(reservations={"a": 1.0}), dict(reservations=[("a", 1)]), dict(cost="x"),
                                 dict(cost=None)])
def test_engine_config_refuses_settings_of_the_wrong_kind(bad):
    name, value = next(iter(bad.items()))
    with pytest.raises(ConfigError, match=f"EngineConfig.{name}"):
        EngineConfig(**bad)


@pytest.mark.parametrize("name", ["base_s", "token_s", "context_s", "swap_token_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, -1e-9, "a", None, True])
def test_cost_model_refuses_what_is_no_number_of_seconds(name, value):
    with pytest.raises(ConfigError, match=f"CostModel.{name} .*got {value!r}"):
        CostModel(**{name: value})


def test_engine_arguments_of_the_wrong_kind_are_typed_errors():
    for workload in (None, 5, [None], [Request(0, 0.0, 4, 1), "r"]):
        with pytest.raises(ConfigError, match="Request"):
            Engine(workload)
    with pytest.raises(ConfigError, match="no setting 'bogus'"):
        Engine([], bogus=1)
    with pytest.raises(ConfigError, match="must be an EngineConfig"):
        Engine([], "x")
    e = Engine([Request(0, 0.0, 20, 5, tenant="a")], EngineConfig(num_blocks=64, quotas={"q": 8}))
    for tenant in ("nobody", None, ["a"], 5):
        with pytest.raises(ConfigError, match="tenant"):
            e.remove_tenant(tenant)
    assert e.remove_tenant("q") == 0  # named by a quota only: a tenant, with nothing to reclaim
    for steps in (-1, 1.5, True, float("nan"), "2"):
        with pytest.raises(ConfigError, match="max_steps"):
            e.run(max_steps=steps)
    assert e.step_count == 0 and e.run(max_steps=2)["requests"] == 1 and e.step_count == 2


def test_a_model_that_is_no_llama_is_refused_when_the_engine_is_built():
    with pytest.raises(ConfigError, match="model must be a kvlab Llama"):
        Engine([Request(0, 0.0, 4, 1)], model="x")
