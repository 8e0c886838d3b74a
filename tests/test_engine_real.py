"""The engine serving real requests: the model's own tokens through continuous batching (chunked prefill mixed
with decode), sampling, the end-of-turn stop, and wall-clock metrics. The real model's tests are marked ``llm``;
the sampling rules are checked on the tiny model too."""
from __future__ import annotations

import math

import pytest

from kvlab import BlockPool, ConfigError, Engine, EngineConfig, Request, SequenceManager, TinyLlama, torch_threads


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """torch on one thread, as in tests/test_real_model.py: on a 2-core machine that runs anything else, a second
    thread mostly waits for a core (the real model's tests took minutes instead of seconds)."""
    with torch_threads(1):
        yield


QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 2 plus 2?",
             "Write a haiku about the sea.", "Who wrote Romeo and Juliet?"]


def chat_requests(model, max_new: int, arrival_gap: float = 0.0) -> list[Request]:
    ids = [model.tokenizer.chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [Request(i, i * arrival_gap, len(p), max_new, prompt_tokens=tuple(p)) for i, p in enumerate(ids)]


def reference(model, req: Request) -> list[int]:
    """Greedy tokens of one request alone (its own pool), cut at the end-of-turn token as the engine does."""
    mgr = SequenceManager(BlockPool(64, spec=model.cfg.kv_spec(16)), prefix_cache=False)
    (seq,), (out,) = model.generate(mgr, [list(req.prompt_tokens)], req.output_len)
    seq.free()
    eos = model.tokenizer.eos_id
    return out[:out.index(eos)] if eos in out else out


@pytest.mark.llm
def test_engine_serves_real_chat_requests_greedily(smol):
    """Four chat requests with small token budgets per step (prompts split into chunks, decode rows mixed in):
    each answer equals that request run alone, and requests end at the end-of-turn token (12 new tokens at most:
    two answers end sooner)."""
    reqs = chat_requests(smol, 12)[:4]
    eng = Engine(reqs, EngineConfig(num_blocks=64, block_size=16, max_batched_tokens=48, max_model_len=256),
                 model=smol)
    summary = eng.run()
    assert summary["finished"] == len(reqs) and summary["clock"] == "wall"
    for r in reqs:
        assert eng.outputs[r.id] == reference(smol, r), r.id
        assert eng.log.requests[r.id].output_len == len(eng.outputs[r.id])
    assert any(len(eng.outputs[r.id]) < r.output_len for r in reqs)  # someone stopped at the end of its turn
    assert smol.tokenizer.decode(eng.outputs[0]).startswith("The capital of France is Paris")
    mixed = [s for s in eng.log.steps if s.prefill_tokens and s.decode_tokens]
    assert mixed, "chunked prefill never shared a step with decode"
    done = eng.log.finished()
    assert all(r.ttft_s > 0 and math.isfinite(r.tpot_s) for r in done)
    eng.check_invariants()


@pytest.mark.llm
def test_engine_prefix_caching_and_preemption_never_change_a_token(smol):
    """A shared system prompt hits the cache; a pool too small for everyone preempts (recompute). Greedy tokens are
    those of a roomy engine without prefix caching."""
    system = [{"role": "system", "content": "You are a helpful assistant who answers in one short sentence."}]
    ids = [smol.tokenizer.chat(system + [{"role": "user", "content": q}]) for q in QUESTIONS[:4]]
    reqs = [Request(i, 0.0, len(p), 16, prompt_tokens=tuple(p)) for i, p in enumerate(ids)]
    roomy = Engine(reqs, EngineConfig(num_blocks=64, block_size=8, prefix_caching=False, max_model_len=128),
                   model=smol)
    roomy.run()
    tight = Engine(reqs, EngineConfig(num_blocks=14, block_size=8, max_model_len=128), model=smol)
    summary = tight.run()
    assert summary["prefix_hit_tokens"] > 0 and summary["preemptions"] > 0
    assert tight.outputs == roomy.outputs


@pytest.mark.llm
def test_engine_sampling_is_seeded(smol):
    reqs = chat_requests(smol, 12)[:3]

    def run(seed):
        eng = Engine(reqs, EngineConfig(num_blocks=64, max_model_len=128, temperature=1.0, top_p=0.95, seed=seed),
                     model=smol)
        eng.run()
        return eng.outputs

    first = run(1)  # one run of seed 1 serves both checks
    assert run(1) == first
    assert run(2) != first


def test_tiny_model_sampling_and_no_eos():
    """TinyLlama has no tokenizer, hence no end of turn: every request writes its whole output_len; sampling
    with a seed repeats, greedy equals the model's own greedy generation."""
    model = TinyLlama()
    reqs = [Request(i, 0.0, 5 + 3 * i, 6, prompt_tokens=tuple(range(3 + i, 8 + 4 * i))) for i in range(3)]

    def run(**kw):
        eng = Engine(reqs, EngineConfig(num_blocks=32, block_size=4, max_model_len=64, **kw), model=model)
        eng.run()
        assert all(len(v) == 6 for v in eng.outputs.values())
        return eng.outputs

    greedy = run()
    assert greedy == {r.id: model.generate_full(list(r.prompt_tokens), 6) for r in reqs}
    assert run(temperature=2.0, seed=5) == run(temperature=2.0, seed=5) != greedy


@pytest.mark.parametrize("setting,value", [
    ("temperature", -1.0), ("temperature", math.nan), ("temperature", math.inf), ("temperature", True),
    ("temperature", "1"), ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_p", None),
    ("seed", -1), ("seed", 1.5), ("seed", 2 ** 64), ("seed", True), ("stop_at_eos", 1), ("stop_at_eos", None)])
def test_bad_sampling_settings_are_refused(setting, value):
    with pytest.raises(ConfigError, match=setting):
        EngineConfig(**{setting: value})


def test_metadata_mode_says_its_clock_is_simulated():
    eng = Engine([Request(0, 0.0, 20, 4)], EngineConfig(num_blocks=16, max_model_len=64))
    assert eng.run()["clock"] == "simulated"


@pytest.mark.parametrize("bad", [
    Request(9, 0.0, 3, 2, prompt_tokens=(1, 101, 2)),  # TinyLlama's vocabulary is 101 ids: 0..100
    Request(9, 0.0, 600, 2, hash_ids=(0, 0)),  # ids 0..511 in its first hash block: past 100
    Request(9, 0.0, 1, 2, hash_ids=(1,)),  # id 512
], ids=["given ids", "hash ids", "one hash id"])
def test_a_prompt_past_the_vocabulary_is_refused_before_it_runs(bad):
    """Found when the engine is built or the request added, not mid-step after it left its queue (which left the
    engine's accounting broken and every later run() failing); the good requests still finish."""
    model = TinyLlama()
    good = [Request(i, 0.0, 5, 3, prompt_tokens=(1, 2, 3, 4, 100)) for i in range(2)]
    cfg = EngineConfig(num_blocks=256, block_size=4, max_model_len=1024)
    with pytest.raises(ConfigError, match=r"requests \[9\] hold prompt token ids past the model's vocabulary"):
        Engine([*good, bad], cfg, model=model)
    eng = Engine(good, cfg, model=model)
    with pytest.raises(ConfigError, match="past the model's vocabulary"):
        eng.add_requests([bad])
    eng.check_invariants()
    assert eng.run()["finished"] == 2 and sorted(eng.outputs) == [0, 1]
    Engine([bad], cfg).run()  # without a model nothing is tokenized: any id is a metadata key
