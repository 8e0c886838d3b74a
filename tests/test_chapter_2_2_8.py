"""Chapter 2.2.8 (inside a real model) and the library it teaches from.

* ``kvlab.walk_block_table`` equals attention computed by hand in numpy (one softmax over the contiguous K/V), reads
  only the filled slots, and its steps obey the online-softmax rules;
* ``kvlab.AttentionProbe`` records the queries a layer really gets and changes nothing the model computes;
* ``kvlab.measure_prefix_hit`` counts the tokens a hit leaves to compute;
* the chapter's exercises judge against truths that match formulas derived by hand;
* the chapter's structure (boxes, predictions before reveals, questionnaire), and its printed conclusions, pinned
  against an independent computation on the real model's tokens: a plain-Python simulation of the block
  allocation, copy-on-write counts by formula, the hash chain recomputed with ``hashlib``.
"""
from __future__ import annotations

import hashlib
import math
import re

import nbformat
import numpy as np
import pytest
import torch

import kvlab
from kvlab import BlockPool, ConfigError, KVDataError, KVSpec, SequenceManager, TinyConfig, TinyLlama
from kvlab import exercises as ex
from kvlab.core.walk import text_table
from kvlab.exercises import ch2_2_8
from kvlab.serve.model import rms_norm, rope
from _util import CHAPTERS, conclusions

NAME = "2_2_8_inside_a_real_model.ipynb"
B = 16


# ---------------------------------------------------------------------------------------------- the walk
def _pool_with(seq_len: int, table: list[int], heads: int = 2, dim: int = 8,
               seed: int = 0) -> tuple[BlockPool, torch.Tensor, torch.Tensor]:
    """A pool whose blocks ``table`` hold random K/V for ``seq_len`` positions (the tail slots of the last block and
    every other block hold huge garbage), and those K/V as contiguous ``[seq_len, heads, dim]`` tensors."""
    g = torch.Generator().manual_seed(seed)
    spec = KVSpec(num_layers=2, num_kv_heads=heads, head_dim=dim, block_size=B, dtype=torch.float32, device="cpu")
    pool = BlockPool(max(table) + 2, spec=spec)
    pool.storage.kv.fill_(1e4)  # stale data: a kernel that read it would be far off
    k = torch.randn(seq_len, heads, dim, generator=g)
    v = torch.randn(seq_len, heads, dim, generator=g)
    slots = torch.tensor([table[p // B] * B + p % B for p in range(seq_len)])
    pool.storage.write_slots(1, slots, k, v)
    return pool, k, v


def _dense(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    s = k @ q / math.sqrt(q.shape[0])
    p = np.exp(s - s.max())
    return (p / p.sum()) @ v


@pytest.mark.parametrize("seq_len", [1, 15, 16, 17, 40, 64])
def test_the_walk_equals_one_softmax_over_the_contiguous_kv(seq_len):
    table = [5, 0, 9, 2][:-(-seq_len // B)]
    pool, k, v = _pool_with(seq_len, table)
    q = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))  # 6 query heads over 2 KV heads
    for head in range(6):
        w = kvlab.walk_block_table(q, pool, 1, table, seq_len, head)
        kvh = head // 3
        assert w.kv_head == kvh
        want = _dense(q[head].double().numpy(), k[:, kvh].double().numpy(), v[:, kvh].double().numpy())
        np.testing.assert_allclose(w.output.numpy(), want, atol=1e-5)
        assert [s.physical for s in w.steps] == table
        last = w.steps[-1]
        assert last.tokens == seq_len - (len(table) - 1) * B and last.first_slot == table[-1] * B
        assert sum(w.block_weights()) == pytest.approx(1.0)


def test_the_walk_keeps_the_online_softmax_rules():
    seq_len, table = 70, [3, 1, 4, 0, 2]
    pool, k, v = _pool_with(seq_len, table, seed=3)
    q = torch.randn(2, 8, generator=torch.Generator().manual_seed(4))
    w = kvlab.walk_block_table(q, pool, 1, table, seq_len, 1)
    s = (k[:, 1].double().numpy() @ q[1].double().numpy()) / math.sqrt(8)
    np.testing.assert_allclose(w.scores.numpy(), s, rtol=1e-5, atol=1e-5)
    assert w.steps[0].alpha == 0.0  # nothing summed before the first block
    before = -math.inf
    for st in w.steps:
        part = s[st.first_pos:st.last_pos + 1]
        assert st.block_max == pytest.approx(part.max(), abs=1e-5)
        assert st.block_sum == pytest.approx(np.exp(part - part.max()).sum(), rel=1e-5)
        assert st.running_max == pytest.approx(max(before, part.max()), abs=1e-5)
        if st.logical:
            assert (st.alpha == 1.0) == (part.max() <= before)  # rescaled only when the max grows
        seen = s[:st.last_pos + 1]
        assert st.running_sum == pytest.approx(np.exp(seen - seen.max()).sum(), rel=1e-5)
        before = st.running_max
    mass = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    np.testing.assert_allclose(w.block_weights(), [mass[i * B:(i + 1) * B].sum() for i in range(5)], atol=1e-6)
    assert len(w.table().splitlines()) == 1 + len(table) and str(w) == w.table()


def test_text_tables_align_columns_as_a_notebook_shows_them():
    """A CJK character takes two columns: a bilingual header lines up with the numbers under it."""
    assert text_table(("块 block", "n"), [("7", "12"), ("10", "3")]).splitlines() == \
        ["块 block   n", "       7  12", "      10   3"]
    assert text_table(("块 block", "what"), [("1", "复制"), ("22", "")], free_last=True).splitlines() == \
        ["块 block  what", "       1  复制", "      22"]


def test_the_walk_refuses_bad_arguments():
    pool, _, _ = _pool_with(20, [0, 1])
    q = torch.zeros(2, 8)
    with pytest.raises(ConfigError, match="head"):
        kvlab.walk_block_table(q, pool, 1, [0, 1], 20, 2)
    with pytest.raises(ConfigError):
        kvlab.walk_block_table(q, pool, 1, [0], 20, 0)  # 20 tokens do not fit one block
    with pytest.raises(ConfigError, match="seq_len"):
        kvlab.walk_block_table(q, pool, 1, [0, 1], 0, 0)
    with pytest.raises(KVDataError):
        kvlab.walk_block_table(q[None], pool, 1, [0, 1], 20, 0)


# ---------------------------------------------------------------------------------------------- the probe
def _manager(model: TinyLlama, blocks: int = 32) -> SequenceManager:
    return SequenceManager(BlockPool(blocks, spec=model.cfg.kv_spec(B)))


def test_the_probe_records_the_real_queries_and_changes_nothing():
    model = TinyLlama(TinyConfig())
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3], [2, 7, 1, 8]]
    plain = _manager(model)
    want = model.step(plain, [plain.create(), plain.create()], prompts)
    attention = model.attention
    probed = _manager(model)
    seqs = [probed.create(), probed.create()]
    with kvlab.AttentionProbe(model, 0) as probe:
        got = model.step(probed, seqs, prompts)
        with pytest.raises(kvlab.IllegalTransitionError):
            probe.__enter__()
    assert model.attention is attention and torch.equal(got, want)
    (call,) = probe.calls
    assert call.seq_lens == (18, 4) and call.query_lens == (18, 4)
    assert call.block_tables == tuple(tuple(s.block_table) for s in seqs)
    p = model.layers[0]
    for i, ids in enumerate(prompts):  # layer 0's query of each sequence's last token, by hand
        h = rms_norm(model.embed[torch.tensor(ids)], p["attn_norm"], model.cfg.eps)
        q = rope((h @ p["wq"].T).view(len(ids), 4, -1), torch.arange(len(ids)), model.cfg.rope_theta)
        torch.testing.assert_close(call.query(i), q[-1])
        torch.testing.assert_close(call.query(i, 0), q[0])
    with pytest.raises(ConfigError):
        call.query(2)
    with pytest.raises(ConfigError):
        kvlab.AttentionProbe(model, model.cfg.num_layers)


# ---------------------------------------------------------------------------------------------- the hit
def test_a_prefix_hit_leaves_the_uncached_tail_to_compute():
    model = TinyLlama(TinyConfig())
    earlier = list(range(1, 60))
    prompt = earlier[:37] + [90, 91, 92, 93, 94, 95]  # 37 tokens in common: 2 full blocks
    s = kvlab.measure_prefix_hit(model, prompt, earlier, block_size=B, rounds=2)
    assert (s.prompt_tokens, s.hit_tokens, s.computed_cold, s.computed_hit) == (43, 32, 43, 11)
    assert s.token_ratio == 43 / 11 and s.rounds == 2 and s.seconds_cold > 0 and s.seconds_hit > 0
    whole = kvlab.measure_prefix_hit(model, earlier[:48], earlier[:48], block_size=B, rounds=1)
    assert whole.computed_hit == 16  # the last token is always computed: its whole block is
    with pytest.raises(ConfigError):
        kvlab.measure_prefix_hit(model, prompt, earlier, rounds=0)


# ---------------------------------------------------------------------------------------------- exercises
@pytest.mark.parametrize("prompt, samples, new", [(50, 3, 20), (48, 4, 5), (7, 2, 40)])
def test_the_samples_truth_matches_the_formula(prompt, samples, new):
    per = -(-(prompt + new) // B)
    shared = prompt // B  # full blocks are never written again
    assert ch2_2_8.samples_blocks(prompt, samples, new) == (shared + samples * (per - shared), samples * per)


@pytest.mark.parametrize("prompt", [16, 17, 64, 70])
def test_the_hit_tokens_truth_matches_the_formula(prompt):
    assert ch2_2_8.hit_computed(prompt) == prompt - B * ((prompt - 1) // B)


def test_the_exercises_judge_right_and_wrong_answers():
    assert ex.check("2.2.8-samples", (9, 15)) and ex.check("2.2.8-hit-tokens", 16)
    for key, wrong in (("2.2.8-samples", (15, 15)), ("2.2.8-samples", (12, 15)), ("2.2.8-hit-tokens", 0),
                       ("2.2.8-hit-tokens", 1)):
        assert not ex.check(key, wrong), (key, wrong)
    assert set(ex.list_predictions("2.2.8")) == {"2.2.8-online", "2.2.8-copies", "2.2.8-hashes"}


# ---------------------------------------------------------------------------------------------- structure
def _cells() -> list[nbformat.NotebookNode]:
    return nbformat.read(CHAPTERS / NAME, as_version=4).cells


def test_the_chapter_has_its_boxes_predictions_and_questionnaire():
    cells = _cells()
    text = "\n".join(c.source for c in cells)
    prose = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    assert "扩展" in cells[0].source and "教师栏 (Instructor box)" in prose and "约 40 分钟" in prose
    assert "在 vLLM 里 (In vLLM)" in prose and "本章结论 (What this chapter measured)" in prose
    assert all(c.metadata["slideshow"]["slide_type"] in ("slide", "subslide", "fragment", "-", "skip", "notes")
               for c in cells) and cells[0].metadata["slideshow"]["slide_type"] == "slide"
    for key in ex.list_predictions("2.2.8"):
        predicted, revealed = text.find(f'exercises.predict("{key}"'), text.find(f'exercises.reveal("{key}"')
        assert 0 <= predicted < revealed, key
    for key in ex.list_exercises("2.2.8"):
        assert f'exercises.check("{key}"' in text, key
    quiz = next(c.source for c in cells if c.source.startswith("## 章末问答 (Questionnaire)"))
    assert 6 <= len(re.findall(r"^\d+\. ", quiz, re.M)) <= 10
    assert cells[-1].source.startswith("## 要点 (key takeaways)")
    assert sum("conclusions" in c.metadata.get("tags", []) for c in cells) == 1


# ---------------------------------------------------------------------------------------------- conclusions
# The chapter's prompts, as its setup cell writes them (the test fails if the chapter changes them).
SYSTEM = ("You are a patient teacher of computer science for first-year students. Explain each idea with one "
          "simple, everyday example, avoid jargon and long formulas, and answer in two or three short sentences. "
          "If a question is unclear, say what you assumed. Never invent facts: if you do not know something, say so. "
          "When a student makes a mistake, point to the step that went wrong instead of giving the whole answer. "
          "Use the metric system and write numbers with digits. Keep every code example under five lines, and name "
          "the programming language it is written in.")
QUESTIONS = {"A": ("What does a cache in a computer do?", SYSTEM), "N": ("How many legs does a spider have?",
             "Answer briefly."), "B": ("Why do computers use memory blocks of a fixed size?", SYSTEM)}
SAMPLES, NEW_TOKENS, EDIT = 4, 20, 20


def _chain(tokens: list[int]) -> list[bytes]:
    """The prefix cache's hash chain by hand: 16-byte blake2b of the parent hash and the block's ids as int64."""
    out, parent = [], b""
    for i in range(len(tokens) // B):
        parent = hashlib.blake2b(parent + np.asarray(tokens[i * B:(i + 1) * B], dtype="<i8").tobytes(),
                                 digest_size=16).digest()
        out.append(parent)
    return out


def _tables(lengths: list[int]) -> list[list[int]]:
    """Block tables of sequences prefilled together, one 16-token chunk of each per step, from a fresh pool that
    hands out the lowest free id first (a plain simulation, no kvlab)."""
    tables: list[list[int]] = [[] for _ in lengths]
    nxt = 0
    for at in range(0, max(lengths), B):
        for t, n in zip(tables, lengths):
            if at < n:
                t.append(nxt)
                nxt += 1
    return tables


@pytest.mark.llm
@pytest.mark.notebooks
@pytest.mark.timeout(300)
def test_the_chapter_concludes_what_an_independent_computation_gives(executed, smol):
    source = "\n".join(c.source for c in _cells())
    for question, _ in QUESTIONS.values():
        assert question in source
    assert "Answer briefly." in source and f"NEW_TOKENS = {NEW_TOKENS}" in source and f"EDIT = {EDIT} " in source
    tok = smol.tokenizer
    A, N, Bp = (tok.chat([{"role": "system", "content": s}, {"role": "user", "content": q}])
                for q, s in QUESTIONS.values())
    c = conclusions(executed(CHAPTERS / NAME)[0])
    m = c.pop("magnitudes")
    assert set(c) == {"walk", "cow", "prefix"}

    full, tail = divmod(len(A), B)
    assert tail  # the chapter's story needs a partly filled last block
    table = _tables([len(A), len(N)])[0]
    assert c["walk"] == {"blocks": full + 1, "table": table, "scattered": True, "last_block_tokens": tail,
                         "equals_dense": True, "paged_equals_dense": True, "first_alpha": 0.0}

    per = -(-(len(A) + NEW_TOKENS) // B)
    assert c["cow"] == {"samples": SAMPLES, "copies_first_step": SAMPLES - 1, "copies_later": 0,
                        "shared_full_blocks": full, "full_blocks": full,
                        "blocks_held": full + SAMPLES * (per - full), "blocks_independent": SAMPLES * per,
                        "tails_equal": True, "same_next_token": True, "same_token_copies": SAMPLES - 1}

    hashes = _chain(A)
    assert hashes == [kvlab.PrefixCache.block_hash(h0, A[i * B:(i + 1) * B])
                      for i, h0 in enumerate([None, *hashes[:-1]])]
    edited = list(A)
    kind, calm = tok.encode(" kind")[0], tok.encode(" calm")[0]
    edited[EDIT] = kind if A[EDIT] != kind else calm
    changed = [i for i, (x, y) in enumerate(zip(hashes, _chain(edited))) if x != y]
    assert changed == list(range(EDIT // B, full))
    common = next(i for i, (x, y) in enumerate(zip(A, Bp)) if x != y)
    hit = min(common // B, (len(Bp) - 1) // B)
    assert c["prefix"] == {"full_blocks": full, "edited_block": EDIT // B, "changed": changed, "common_tokens": common,
                           "hit_blocks": hit, "computed_hit": len(Bp) - hit * B, "computed_cold": len(Bp),
                           "hit_same_next_token": True}

    assert max(m["walk_max_abs_diff"], m["paged_max_abs_diff"]) < 1e-5 and m["cow_logit_diff"] < 1e-3
    assert m["hit_logit_diff"] < 1e-3 and m["rounds"] == 3  # fast mode: 3 rounds of the timing
    assert {"seconds_cold", "seconds_hit", "time_ratio"} <= set(m)  # timings: present, never asserted
