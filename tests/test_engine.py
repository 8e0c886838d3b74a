"""Engine: determinism, completion without leaks, preemption by recompute and swap, tenant quotas, baseline."""
from __future__ import annotations

import pytest

from kvlab.baseline import ContiguousAllocator
from kvlab.engine import Engine, EngineConfig, Preempted, TenantReclaimed
from kvlab.errors import ConfigError, DoubleFreeError, OutOfBlocksError
from kvlab.events import EventRecorder
from kvlab.metrics import StepMetrics
from kvlab.workloads import Request, make_workload


def _drained(e: Engine, aborted: str = "") -> None:
    """Every request finished: no referenced block is left, only cached prefix blocks."""
    e.check_invariants()
    pool = e.memory.pool
    assert not pool.refs_np.any(), "a block is still referenced after every request finished"
    assert pool.num_free_blocks + pool.num_cached_blocks == pool.num_blocks
    assert all(r.finish_step >= 0 for r in e.log.requests.values() if r.tenant != aborted)


def test_same_seed_same_metrics():
    w = make_workload("chat", 200, seed=3, rate=100)
    a, b = Engine(w, num_blocks=512).run(), Engine(w, num_blocks=512).run()
    assert a == b and a["finished"] == 200


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_completes_every_request(mode):
    w = make_workload("document", 60, seed=1, rate=50)
    e = Engine(w, num_blocks=400, max_model_len=8192, preemption=mode)
    rec = EventRecorder(e.events, (Preempted,))
    s = e.run()
    assert s["finished"] == 60 and s["preemptions"] > 0 and len(rec) == s["preemptions"]
    assert {ev.mode for ev in rec} == {mode}
    _drained(e)


def test_no_prefix_caching_frees_everything():
    e = Engine(make_workload("chat", 100, seed=2, rate=80), num_blocks=256, prefix_caching=False)
    e.run()
    _drained(e)
    assert e.memory.pool.num_free_blocks == 256


def test_prefix_cache_saves_prefill():
    w = make_workload("chat", 150, seed=4, rate=60)
    on, off = Engine(w, num_blocks=1024).run(), Engine(w, num_blocks=1024, prefix_caching=False).run()
    assert on["prefix_hit_tokens"] > 0 and off["prefix_hit_tokens"] == 0 and on["prefix_hit_rate"] > 0.3


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
    e.memory.check_invariants()
    assert e.memory.arena.reserved == 0 and e.memory._tokens == 0
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
