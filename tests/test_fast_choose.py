"""``kvlab.fast.choose``: the one place that picks each fast twin or its reference, and the engine and the model
give the same results either way (the twins' own equality is in tests/test_perf.py and tests/test_attention.py)."""
from __future__ import annotations

import pytest

from kvlab import (BlockPool, ConfigError, Engine, EngineConfig, FastBlockPool, PrefixCache, SequenceManager,
                   TinyConfig, TinyLlama, make_workload)
from kvlab.core.attention import paged_attention as reference_attention
from kvlab.fast import PARTS, choose
from kvlab.fast.attention import paged_attention as fast_attention
from kvlab.fast.pool import FastPrefixCache, FastSequenceManager


def test_every_part_is_fast_by_default_and_reference_when_named(monkeypatch):
    monkeypatch.delenv("KVLAB_REFERENCE", raising=False)
    assert tuple(choose()) == (FastBlockPool, FastSequenceManager, FastPrefixCache, fast_attention)
    assert tuple(choose("all")) == (BlockPool, SequenceManager, PrefixCache, reference_attention)
    fast, reference = choose(), choose("all")
    for i, part in enumerate(PARTS):  # the named part runs its reference, every other part its fast twin (which,
        # in a pure-Python install, may be the reference itself: FastPrefixCache is PrefixCache without the C parts)
        assert list(choose([part])) == [reference[j] if j == i else fast[j] for j in range(len(PARTS))], part
    monkeypatch.setenv("KVLAB_REFERENCE", " prefix, decode ")
    assert choose()[2:] == (PrefixCache, reference_attention) and choose()[0] is FastBlockPool


@pytest.mark.parametrize("bad", [["pools"], ["pool", "x"], "Pool", [""]], ids=repr)
def test_an_unknown_part_is_refused_naming_it(bad):
    with pytest.raises(ConfigError, match="no part"):
        choose(bad)


def test_the_engine_gives_the_same_run_on_every_reference_part(monkeypatch):
    """Metadata mode (the pool, the append loop, the prefix cache): the same summary and per-request record
    whichever parts run on the reference."""
    w = make_workload("dialogue", 40, seed=3, rate=50.0, prefix_share=0.5)
    cfg = dict(num_blocks=160, block_size=8, max_batched_tokens=256, max_model_len=2048)
    runs = {}
    for ref in ("", "pool", "append", "prefix", "all"):
        monkeypatch.setenv("KVLAB_REFERENCE", ref)
        e = Engine(w, EngineConfig(**cfg))
        summary = e.run()
        runs[ref] = (summary, list(e.log.requests.values()))
        assert type(e.memory.pool) is (BlockPool if ref in ("pool", "all") else FastBlockPool)
    assert all(run == runs[""] for run in runs.values())


def test_the_model_decodes_the_same_tokens_with_the_reference_attention(monkeypatch):
    """With a model the engine's attention is chosen too: the reference's gather + SDPA and the fast twin's
    kernel generate the same tokens."""
    out = {}
    for ref in ("", "decode"):
        monkeypatch.setenv("KVLAB_REFERENCE", ref)
        model = TinyLlama(TinyConfig(), device="cpu")  # weights from the config's seed
        assert (model.attention is reference_attention) is (ref == "decode")
        pool = BlockPool(64, spec=model.cfg.kv_spec(8, model.dtype, model.device))
        _, out[ref] = model.generate(SequenceManager(pool), [[1, 2, 3, 4, 5], [6, 7, 8]], max_new_tokens=12)
    assert out[""] == out["decode"] and len(out[""][0]) == 12
