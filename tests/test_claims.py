"""The §2.2.6 claims report: every claim is measured, stated with its setup, and given a verdict."""
from __future__ import annotations

from kvlab.claims import claims_report, measure_claims, prefetch_effect


def test_claims_report_measures_each_claim():
    claims = measure_claims(requests=300, num_blocks=1024, long_tokens=20_000)
    assert len(claims) == 6
    by = {c.text.split(" ")[0]: c for c in claims}
    assert by["支持长达10万token以上的序列处理"].supported  # the long request finished within its pool
    assert by["资源利用率提升30%以上"].supported  # max-length regions waste most of their slots
    text = claims_report(claims)
    for c in claims:
        assert c.text in text and c.measured in text and c.setup in text
    assert text.count("NOT supported") == sum(not c.supported for c in claims)


def test_prefetch_effect_is_measured_on_the_same_workload():
    runs = prefetch_effect(requests=20)
    on, off = runs["prefetch"], runs["no prefetch"]
    assert on["finished"] == off["finished"] == 20 and on["requests"] == off["requests"]
    assert on["prefetched_swap_ins"] > 0 == off["prefetched_swap_ins"]
    assert on["swap_in_stall_s"] < off["swap_in_stall_s"]
