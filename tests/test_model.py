"""End to end: greedy generation through the paged cache equals full recomputation, token for token (logits
within 1e-4), for a batch of prompts of different lengths, a forked sequence and a prefix-cache hit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _util import assert_same_state, pool_state
from kvlab import BlockPool, ConfigError, KVSpec, OutOfBlocksError
from kvlab.serve.model import TinyConfig, TinyLlama, rope
from kvlab.core.sequence import SequenceManager

MODEL = TinyLlama(TinyConfig())


def paged(block_size, num_blocks=96, prefix_cache=True):
    pool = BlockPool(num_blocks, spec=MODEL.cfg.kv_spec(block_size=block_size))
    return SequenceManager(pool, prefix_cache=prefix_cache)


def check_step(mgr, seqs, feed):
    """One paged step; its logits must match full recomputation of each sequence's tokens."""
    logits = MODEL.step(mgr, seqs, feed)
    for s, row in zip(seqs, logits):
        torch.testing.assert_close(row, MODEL.forward_full(s.token_ids)[-1], atol=1e-4, rtol=0)
    return logits.argmax(-1).tolist()


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batch_of_prompts_matches_full_recompute(block_size):
    mgr = paged(block_size)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7], list(range(30, 53))]
    seqs = [mgr.create(p) for p in prompts]
    feed, out = prompts, [[] for _ in prompts]
    for _ in range(6):
        nxt = check_step(mgr, seqs, feed)
        for o, t in zip(out, nxt):
            o.append(t)
        feed = [[t] for t in nxt]
    assert out == [MODEL.generate_full(p, 6) for p in prompts]
    mgr.check_invariants()


def test_generate_equals_reference_and_varies():
    mgr = paged(4)
    prompts = [[5, 6, 7], [8] * 11]
    _, out = MODEL.generate(mgr, prompts, 8)
    assert out == [MODEL.generate_full(p, 8) for p in prompts]
    assert len(set(out[0])) > 1  # the model is not degenerate: greedy tokens change


def test_forked_sequence_with_other_continuation():
    mgr = paged(4)
    a = mgr.create([9, 8, 7, 6, 5, 4])
    check_step(mgr, [a], [a_prompt := [9, 8, 7, 6, 5, 4]])
    b = a.fork()  # shares the partly filled tail block: the first append copies it
    feed = [[11], [12]]
    for _ in range(5):
        feed = [[t] for t in check_step(mgr, [a, b], feed)]
    assert a.token_ids[:6] == b.token_ids[:6] == a_prompt and a.token_ids[6] != b.token_ids[6]
    assert a.block_table[0] == b.block_table[0] and a.block_table[1] != b.block_table[1]
    mgr.check_invariants()


def test_prefix_cache_hit_gives_same_tokens():
    mgr = paged(4)
    first = list(range(40, 58))
    (s,), _ = MODEL.generate(mgr, [first], 3)
    s.free()
    second = first[:13] + [1, 2]
    (t,), (out,) = MODEL.generate(mgr, [second], 6)
    assert t.num_cached_tokens == 12 and mgr.prefix_cache.get_stats()["hits"] == 3
    assert out == MODEL.generate_full(second, 6)


def test_swap_between_steps_keeps_generation_exact():
    mgr = paged(4, prefix_cache=False)
    a = mgr.create([1, 2, 3, 4, 5])
    nxt = check_step(mgr, [a], [[1, 2, 3, 4, 5]])
    a.swap_out()
    a.swap_in()
    for _ in range(3):
        nxt = check_step(mgr, [a], [nxt])


def test_rope_is_a_rotation_by_relative_position():
    x, y = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    dot = lambda i, j: (rope(x, torch.tensor([i]), 1e4) * rope(y, torch.tensor([j]), 1e4)).sum()  # noqa: E731
    torch.testing.assert_close(dot(3, 1), dot(10, 8), atol=1e-5, rtol=1e-5)


def test_bad_input():
    mgr = paged(4)
    s = mgr.create([1])
    with pytest.raises(ConfigError, match="token 0 is 101, not an id in 0..100"):
        MODEL.step(mgr, [s], [[MODEL.cfg.vocab_size]])
    with pytest.raises(ConfigError, match="non-empty list of token ids, got \\[\\]"):
        MODEL.step(mgr, [s], [[]])
    other = SequenceManager(BlockPool(4, spec=TinyConfig(num_layers=1).kv_spec()))
    with pytest.raises(ConfigError, match="layers"):
        MODEL.step(other, [other.create([1])], [[1]])
    assert s.num_tokens == 0


def test_a_pool_of_other_kv_heads_is_refused_before_anything_changes():
    mgr = SequenceManager(BlockPool(8, spec=KVSpec(num_layers=2, num_kv_heads=1, head_dim=16, block_size=4,
                                                   device="cpu")))
    s = mgr.create()
    before = pool_state(mgr.pool)
    with pytest.raises(ConfigError, match="1 kv heads .* the model needs 2 layers x 2 kv heads"):
        MODEL.step(mgr, [s], [[1, 2, 3]])
    assert s.num_tokens == 0 and s.block_table == []
    assert_same_state(before, pool_state(mgr.pool))


def _cached_manager():
    """A prefix-cached manager that holds the blocks of a finished 9-token prompt."""
    mgr = paged(4, num_blocks=32)
    (s,), _ = MODEL.generate(mgr, [list(range(9))], 1)
    s.free()
    return mgr


@pytest.mark.parametrize("prompts,max_new_tokens,match", [
    ([list(range(9)) + [999]], 1, "prompt 0: token 9 is 999"), ([list(range(9)), []], 1, "prompt 1 .*got \\[\\]"),
    ([[1, None]], 1, "token 1 is None"), ("abc", 1, "got 'abc'"), ([list(range(9))], None, "got None"),
    ([list(range(9))], 1.5, "got 1.5"), ([list(range(9))], "2", "got '2'"), ([list(range(9))], -1, "got -1")])
def test_generate_refuses_bad_input_before_creating_any_sequence(prompts, max_new_tokens, match):
    mgr = _cached_manager()
    before, stats = pool_state(mgr.pool), mgr.prefix_cache.get_stats()
    with pytest.raises(ConfigError, match=match):
        MODEL.generate(mgr, prompts, max_new_tokens)
    assert len(mgr) == 0 and mgr.prefix_cache.get_stats() == stats
    assert_same_state(before, pool_state(mgr.pool))


@pytest.mark.parametrize("prompt_len,prefix_cache", [(200, True), (15, False)])
def test_generate_out_of_blocks_frees_the_sequences_it_created(prompt_len, prefix_cache):
    """Too long a prompt fails at the first step (after a prefix hit on the cached blocks), 15 tokens in 4 blocks
    at the third (the 17th token needs a fifth block): either way nothing stays referenced."""
    mgr = _cached_manager() if prefix_cache else paged(4, num_blocks=4, prefix_cache=False)
    free, prompt = mgr.pool.num_free_blocks, list(range(9)) + [5] * (prompt_len - 9)
    with pytest.raises(OutOfBlocksError):
        MODEL.generate(mgr, [prompt, [1]] if prefix_cache else [prompt], 3)
    assert len(mgr) == 0 and mgr.pool.num_free_blocks == free
    assert not any(mgr.pool.fields.refcount)
    mgr.check_invariants()


@pytest.mark.parametrize("kw,match", [
    (dict(vocab_size=0), "vocab_size must be a positive int, got 0"), (dict(vocab_size=-5), "got -5"),
    (dict(vocab_size=True), "vocab_size .*got True"), (dict(dim=0), "dim .*got 0"),
    (dict(num_layers=-1), "num_layers .*got -1"), (dict(num_layers=0), "num_layers .*got 0"),
    (dict(ffn_dim=0), "ffn_dim .*got 0"), (dict(num_heads=0), "num_heads .*got 0"),
    (dict(num_kv_heads=0), "num_kv_heads .*got 0"), (dict(eps=float("nan")), "eps .*got nan"),
    (dict(rope_theta=float("nan")), "rope_theta .*got nan"), (dict(rope_theta=-1), "rope_theta .*got -1"),
    (dict(eps="1e-6"), "eps .*got '1e-6'"), (dict(seed="x"), "seed .*got 'x'"),
    (dict(dim=60), "dim=60 does not split into num_heads=4"), (dict(dim=12), "dim=12 .* of an even size"),
    (dict(num_kv_heads=3), "num_heads=4 is not a multiple of num_kv_heads=3")])
def test_a_bad_config_is_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        TinyConfig(**kw)


def test_a_config_takes_numpy_ints_as_ints():
    cfg = TinyConfig(num_layers=np.int64(3))
    assert type(cfg.num_layers) is int and cfg.kv_spec().num_layers == 3


def test_the_model_needs_a_config_and_a_floating_dtype():
    with pytest.raises(ConfigError, match="got None"):
        TinyLlama(None)
    with pytest.raises(ConfigError, match="got torch.int64"):
        TinyLlama(TinyConfig(), torch.int64)


@pytest.mark.parametrize("tokens,match", [([], "got \\[\\]"), (["a"], "token 0 is 'a'"),
                                          ([1, float("nan")], "token 1 is nan"), ([[1]], "token 0 is \\[1\\]"),
                                          ([True], "token 0 is True"), (None, "got None")])
def test_bad_tokens_are_refused_everywhere(tokens, match):
    with pytest.raises(ConfigError, match=match):
        MODEL.forward_full(tokens)
    with pytest.raises(ConfigError, match=match):
        MODEL.generate_full(tokens, 1)
    mgr = paged(4)
    s = mgr.create([1])
    before = pool_state(mgr.pool)
    with pytest.raises(ConfigError, match=match):
        MODEL.step(mgr, [s], [tokens])
    assert s.num_tokens == 0
    assert_same_state(before, pool_state(mgr.pool))


def test_an_empty_step_changes_nothing_and_a_mismatched_batch_is_refused():
    mgr = paged(4)
    s = mgr.create([1])
    before = pool_state(mgr.pool)
    assert MODEL.step(mgr, [], []).shape == (0, MODEL.cfg.vocab_size)
    with pytest.raises(ConfigError, match="got \\[\\] and \\[\\[1\\]\\]"):
        MODEL.step(mgr, [], [[1]])
    with pytest.raises(ConfigError, match="a SequenceManager, got None"):
        MODEL.step(None, [s], [[1]])
    with pytest.raises(ConfigError, match="max_new_tokens .*got -1"):
        MODEL.generate_full([1], -1)
    assert s.num_tokens == 0
    assert_same_state(before, pool_state(mgr.pool))
