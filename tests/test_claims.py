"""The §2.2.6 claims report: every claim is measured, stated with its setup, and given a verdict; each verdict
flips exactly at the threshold the text states."""
from __future__ import annotations

import pytest

import kvlab.claims as claims_mod
from kvlab.claims import claims_report, measure_claims, prefetch_effect

NAMES = ["数十个并发用户", "资源利用率提升30%以上", "响应时间减少50%以上", "处理速度提升3倍", "内存使用量减少40%",
         "支持长达10万token以上的序列处理"]


def verdicts(claims) -> dict[str, bool]:
    return {c.text.split(" ")[0]: c.supported for c in claims}


# The simulation is seeded and metadata-only: the same arguments give the same figures on every run and machine.
# Chosen so that several figures sit near the text's thresholds, on either side (mean running requests vs 20,
# latency cut vs 50%, speed vs 3x), so a moved threshold flips a verdict here too.
T, F = True, False


@pytest.mark.parametrize("kwargs, expect", [
    # tight memory (1024 blocks): the contiguous baseline fits 8 requests, paging 63 on average: all six hold
    (dict(requests=300, num_blocks=1024, long_tokens=20_000), [T, T, T, T, T, T]),
    # roomy memory (4096 blocks): the baseline fits 32 requests; latency falls 49% (< 50%), speed 1.77x
    (dict(requests=300, num_blocks=4096, long_tokens=20_000), [T, T, F, F, T, T]),
    # 128 blocks: paging runs 14 requests on average (< 20), the baseline one at a time
    (dict(requests=200, num_blocks=128, long_tokens=2000), [F, T, T, T, T, T]),
    # 64-token blocks: 3.18x (just above 3x)
    (dict(requests=300, num_blocks=256, block_size=64, long_tokens=2000), [T, T, T, T, T, T]),
    # 1536 blocks: 2.59x (below 3x); 3072 blocks: latency falls 53% (just above 50%), 1.95x
    (dict(requests=200, num_blocks=1536, long_tokens=2000), [T, T, T, F, T, T]),
    (dict(requests=300, num_blocks=3072, long_tokens=2000), [T, T, T, F, T, T]),
])
def test_every_verdict_on_fixed_seeds(kwargs, expect):
    claims = measure_claims(**kwargs)
    assert [c.text.split(" ")[0] for c in claims] == NAMES
    assert [c.supported for c in claims] == expect
    again = measure_claims(**kwargs)
    assert [(c.measured, c.supported) for c in again] == [(c.measured, c.supported) for c in claims]


def test_claims_report_measures_each_claim():
    claims = measure_claims(requests=300, num_blocks=1024, long_tokens=20_000)
    assert len(claims) == 6
    by = verdicts(claims)
    assert by == dict.fromkeys(NAMES, True)
    assert "paged 63 (max 190), contiguous 8 (max 8)" in claims[0].measured
    assert "(3.39x)" in claims[3].measured
    text = claims_report(claims)
    for c in claims:
        assert c.text in text and c.measured in text and c.setup in text
    assert text.count("NOT supported") == sum(not c.supported for c in claims)


# ---------------------------------------------------------------------------------------------------- thresholds
LONG, BS = 1000, 16
LONG_BLOCKS = -(-(LONG + 64) // BS) + 8


# Summaries far on the supported side of every claim: a paged run, its contiguous baseline, the long request.
PAGED = dict(mean_running=50.0, max_running=60, utilisation=0.8, internal_waste=0.0, latency_mean_s=1.0,
             ttft_mean_s=0.1, throughput_tok_s=4000.0, prefix_hit_tokens=0, prefix_hit_rate=0.0)
CONTIGUOUS = {**PAGED, "mean_running": 5.0, "max_running": 5, "utilisation": 0.1, "internal_waste": 0.9,
              "latency_mean_s": 5.0, "throughput_tok_s": 100.0}
LONG_RUN = dict(steps=10, finished=1, peak_reserved_slots=LONG + 64)


def fake_engine(paged: dict, contiguous: dict, long: dict):
    """An Engine stand-in returning the summaries above, with the given fields changed."""
    class FakeEngine:
        def __init__(self, workload, cfg):
            self.cfg = cfg

        def run(self):
            if self.cfg.max_model_len == LONG + 64 and self.cfg.max_batched_tokens == 2048:
                return {**LONG_RUN, **long}
            return {**CONTIGUOUS, **contiguous} if self.cfg.memory == "contiguous" else {**PAGED, **paged}
    return FakeEngine


def peak_slots(offset: float) -> int:
    """Peak KV slots ``offset`` (relative) inside the long request's pool (> 0) or past it (< 0); slots are whole,
    so just inside is exactly the pool and just past is one slot more."""
    cap = LONG_BLOCKS * BS
    return cap - int(offset * cap) if offset > 0 else cap + max(1, int(-offset * cap))


# claim index -> the three summaries (paged, contiguous, long request) putting the measured figure ``offset``
# (relative) on the supported side of the text's threshold (> 0) or short of it (< 0)
FIGURES = {
    0: lambda o: ({"mean_running": 20 * (1 + o)}, {"mean_running": 5.0}, {}),  # mean running requests >= 20
    1: lambda o: ({"utilisation": 0.5 * (1 + 0.30 * (1 + o))}, {"utilisation": 0.5}, {}),  # utilisation +30%
    2: lambda o: ({"latency_mean_s": 2.0 * (1 - 0.50 * (1 + o))}, {"latency_mean_s": 2.0}, {}),  # latency -50%
    3: lambda o: ({"throughput_tok_s": 1000.0 * 3.0 * (1 + o)}, {"throughput_tok_s": 1000.0}, {}),  # speed 3x
    4: lambda o: ({"internal_waste": 0.0}, {"internal_waste": 0.40 * (1 + o)}, {}),  # memory per token -40%
    5: lambda o: ({}, {}, {"peak_reserved_slots": peak_slots(o)}),  # the long request fits its pool
}


@pytest.mark.parametrize("offset, supported", [(-0.05, False), (-1e-6, False), (1e-6, True), (0.05, True)],
                         ids=["5%-short", "just-short", "just-past", "5%-past"])
@pytest.mark.parametrize("claim", sorted(FIGURES))
def test_each_verdict_flips_at_the_texts_threshold(monkeypatch, claim, offset, supported):
    paged, contiguous, long = FIGURES[claim](offset)
    monkeypatch.setattr(claims_mod, "Engine", fake_engine(paged, contiguous, long))
    got = measure_claims(requests=5, num_blocks=64, block_size=BS, long_tokens=LONG)
    assert got[claim].supported is supported, (NAMES[claim], offset, got[claim].measured)
    others = [c.supported for i, c in enumerate(got) if i != claim]
    assert others == [True] * 5  # the default summaries support every other claim


def test_the_report_states_each_verdict_at_the_threshold(monkeypatch):
    """What a reader sees: just past each threshold the report says "supported" for all six; just short of one,
    "NOT supported" for that claim alone."""
    for claim in sorted(FIGURES):
        for offset, short in ((1e-6, False), (-1e-6, True)):
            monkeypatch.setattr(claims_mod, "Engine", fake_engine(*FIGURES[claim](offset)))
            text = claims_report(measure_claims(requests=5, num_blocks=64, block_size=BS, long_tokens=LONG))
            lines = [line for line in text.splitlines() if line.startswith("* ")]
            assert [line.endswith("NOT supported by this measurement") for line in lines] == \
                [short and i == claim for i in range(6)], (NAMES[claim], offset)


@pytest.mark.parametrize("long, supported", [
    ({}, True),  # finished within its own pool
    ({"peak_reserved_slots": LONG_BLOCKS * BS}, True),  # every slot of the pool used: still within it
    ({"peak_reserved_slots": LONG_BLOCKS * BS + 1}, False),  # one slot past the pool
    ({"finished": 0}, False),  # did not finish
])
def test_the_long_request_must_finish_within_its_pool(monkeypatch, long, supported):
    monkeypatch.setattr(claims_mod, "Engine", fake_engine({}, {}, long))
    got = measure_claims(requests=5, num_blocks=64, block_size=BS, long_tokens=LONG)
    assert [c.supported for c in got] == [True] * 5 + [supported]


def test_claims_measure_when_memory_holds_one_region_and_a_half():
    claims = measure_claims(requests=50, num_blocks=192, long_tokens=2000)  # 3072 slots, regions of 2048
    assert len(claims) == 6


def test_prefetch_effect_is_measured_on_the_same_workload():
    runs = prefetch_effect(requests=20)
    on, off = runs["prefetch"], runs["no prefetch"]
    assert on["finished"] == off["finished"] == 20 and on["requests"] == off["requests"]
    assert on["prefetched_swap_ins"] > 0 == off["prefetched_swap_ins"]
    assert on["swap_in_stall_s"] < off["swap_in_stall_s"]
