"""What a prefix-cache hit saves on a real model: the tokens it does not recompute, and the prefill time.

A prompt whose first full blocks are already in the prefix cache (an earlier request computed them) starts with
those blocks in its table (:meth:`kvlab.SequenceManager.create`); only the rest of the prompt goes through the
model. :func:`measure_prefix_hit` runs the same prompt both ways on ``model``, each time in a fresh pool:

* **cold**: no cache, every prompt token is computed;
* **hit**: the pool's cache first holds ``earlier`` (a prompt sharing a prefix with ``prompt``, computed outside
  the timing), then ``prompt`` is looked up and only its uncached tail is computed.

It counts the tokens each way (exact, the same on every machine) and times each prefill (wall seconds, the median
of ``rounds``, cold and hit alternating so a slow spell of a shared machine hits both): the seconds and their
ratio depend on the machine, its load and the thread count (the caller's, :func:`kvlab.torch_threads`).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.core.checks import check_positive, check_token_ids
from kvlab.core.errors import ConfigError
from kvlab.core.events import EventRecorder
from kvlab.core.pool import BlockPool
from kvlab.core.spec import KVSpec
from kvlab.core.sequence import CopiedOnWrite, Sequence as Seq, SequenceManager
from kvlab.core.walk import text_table
from kvlab.serve.model import Llama


@dataclass(frozen=True)
class PrefillSaving:
    """One prompt prefilled cold and with a prefix hit: ``prompt_tokens``; ``hit_tokens`` served by the cache
    (whole blocks, and never the prompt's last token: its logits are needed); ``seconds_cold`` /
    ``seconds_hit``, medians of ``rounds`` wall-clock prefills on this machine."""
    prompt_tokens: int
    hit_tokens: int
    seconds_cold: float
    seconds_hit: float
    rounds: int

    @property
    def computed_cold(self) -> int:
        return self.prompt_tokens

    @property
    def computed_hit(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    @property
    def token_ratio(self) -> float:
        """Tokens computed cold / with the hit (exact)."""
        return self.computed_cold / self.computed_hit

    @property
    def time_ratio(self) -> float:
        """Prefill seconds cold / with the hit (a timing of this machine)."""
        return self.seconds_cold / self.seconds_hit


def measure_prefix_hit(model: Llama, prompt: Sequence[int], earlier: Sequence[int], *, block_size: int = 16,
                       rounds: int = 3) -> PrefillSaving:
    """Prefill ``prompt`` on ``model`` cold and after ``earlier`` filled the prefix cache (see the module
    docstring); ``rounds`` of each."""
    if not isinstance(model, Llama):
        raise ConfigError(f"model must be a kvlab Llama (kvlab.load_model, TinyLlama), got {model!r:.80}")
    vocab = model.cfg.vocab_size
    prompt, earlier = check_token_ids(prompt, "prompt", vocab), check_token_ids(earlier, "earlier", vocab)
    check_positive(block_size, "block_size")
    check_positive(rounds, "rounds")
    spec = model.cfg.kv_spec(block_size, model.dtype, model.device)
    blocks = -(-len(prompt) // block_size) + -(-len(earlier) // block_size) + 1

    def prefill(cached: bool) -> tuple[int, float]:
        manager = SequenceManager(BlockPool(blocks, spec=spec), prefix_cache=cached)
        if cached:  # the earlier request, outside the timing: its full blocks enter the cache
            first = manager.create(earlier)
            model.step(manager, [first], [earlier])
            manager.free(first)
        seq = manager.create(prompt)
        hit = seq.num_tokens
        t0 = time.perf_counter()
        model.step(manager, [seq], [prompt[hit:]])
        return hit, time.perf_counter() - t0

    prefill(True)  # first-use costs (allocations, kernels' warm-up) stay out of the timing
    cold: list[float] = []
    warm: list[float] = []
    hits: set[int] = set()
    for r in range(rounds):
        for cached in ((False, True) if r % 2 == 0 else (True, False)):
            hit, seconds = prefill(cached)
            (warm if cached else cold).append(seconds)
            if cached:
                hits.add(hit)
    (hit,) = hits  # the same cache state each round: the same hit
    return PrefillSaving(len(prompt), hit, statistics.median(cold), statistics.median(warm), rounds)


@dataclass(frozen=True)
class ForkRun:
    """:func:`decode_forks`'s record. ``rows``: per step (step, tokens of sample 0, copies made in the step, distinct
    blocks the samples hold, blocks they would hold as independent copies, what happened); ``answers``: each
    sample's generated token ids; ``texts``: those decoded (empty where the model has no tokenizer); ``logits``: the
    last step's ``[samples, vocab]``. ``str()`` is the table (rows where something happened, and the last) and the
    answers."""
    rows: list[tuple[int, int, int, int, int, str]]
    answers: list[list[int]]
    texts: list[str]
    logits: torch.Tensor

    def __str__(self) -> str:
        n = len(self.answers)
        header = ("步 step", "token 数 tokens", "复制 copies", "占用块 blocks held",
                  f"{n} 份副本要占 {n} copies would hold", "发生了什么 what happened")
        shown = [(*(str(x) for x in r[:5]), r[5]) for r in self.rows if r[5] or r is self.rows[-1]]
        lines = [text_table(header, shown, free_last=True)]
        lines += [f"样本 {i} (sample {i}): {t!r}" for i, t in enumerate(self.texts)]
        return "\n".join(lines)


def decode_forks(model: Llama, manager: SequenceManager, samples: Sequence[Seq], first_tokens: Sequence[int],
                 steps: int) -> ForkRun:
    """Decode forked ``samples`` (sharing blocks in ``manager``'s pool) for ``steps`` steps: sample ``i`` is fed
    ``first_tokens[i]`` first, then greedily its most likely next token. Each step's copy-on-write copies (recorded
    from the pool's events as they happen) and new blocks are noted, with the distinct blocks the samples hold
    against the blocks as many independent sequences would hold. The model's work is ``model.step``'s: nothing here
    changes what is computed."""
    if not isinstance(model, Llama):
        raise ConfigError(f"model must be a kvlab Llama (kvlab.load_model, TinyLlama), got {model!r:.80}")
    if len(first_tokens) != len(samples):
        raise ConfigError(f"one first token per sample: {len(first_tokens)} tokens for {len(samples)} samples")
    check_positive(steps, "steps")
    copies = EventRecorder(manager.pool.events, (CopiedOnWrite,))
    feed = [[int(t)] for t in first_tokens]
    answers: list[list[int]] = [[] for _ in samples]
    rows: list[tuple[int, int, int, int, int, str]] = []
    try:
        for step in range(1, steps + 1):
            before = [len(s.block_table) for s in samples]
            seen = len(copies)
            logits = model.step(manager, samples, feed)
            for out, f in zip(answers, feed):
                out.extend(f)
            new = [(i, b) for i, (s, old) in enumerate(zip(samples, before)) for b in s.block_table[old:]]
            held = len({b for s in samples for b in s.block_table})
            copied = [e for e in copies.events[seen:] if isinstance(e, CopiedOnWrite)]
            moves = [f"样本 {samples.index(manager.seqs[e.seq_id])} 的块 {e.src} -> {e.dst}" for e in copied]
            event = "；".join(f"{what}：{'，'.join(parts)}" for what, parts in
                             (("写时复制 (copied on write)", moves),
                              ("新块 (new blocks)", [f"样本 {i} -> {b}" for i, b in new])) if parts)
            rows.append((step, samples[0].num_tokens, len(copied), held, sum(s.num_blocks for s in samples), event))
            feed = [[t] for t in logits.argmax(-1).tolist()]
    finally:
        copies.close()
    tok = model.tokenizer
    texts = [tok.decode(out) for out in answers] if tok is not None else []
    return ForkRun(rows, answers, texts, logits)


def same_token_copies(samples: int, block_size: int, prompt_tokens: int = 5) -> int:
    """Copies made when ``samples`` forks of one sequence, whose last block holds ``prompt_tokens`` tokens (fewer
    than ``block_size``: a partly filled, shared block), each append the SAME token: a copy is made on writing,
    whatever is written, so ``samples - 1`` of them copy. Block bookkeeping only (no K/V, no model)."""
    check_positive(samples, "samples")
    check_positive(block_size, "block_size")
    check_positive(prompt_tokens, "prompt_tokens")
    if prompt_tokens % block_size == 0:
        raise ConfigError(f"prompt_tokens={prompt_tokens} fills its last block of {block_size}: nothing is shared to "
                          "copy; pick a count that leaves the last block partly filled")
    blocks = -(-prompt_tokens // block_size) * samples + samples
    manager = SequenceManager(BlockPool(blocks, spec=KVSpec(block_size=block_size), with_storage=False))
    tokens = list(range(1, prompt_tokens + 1))
    first = manager.create(tokens)
    first.append(tokens)
    alike = [first] + [first.fork() for _ in range(samples - 1)]
    copies = EventRecorder(manager.pool.events, (CopiedOnWrite,))
    try:
        manager.append_batch(alike, [[7]] * samples)
    finally:
        copies.close()
    return len(copies)


def unshared_logits(model: Llama, spec: KVSpec, token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """The last logits of each token list, each prefilled as its own sequence in a fresh pool of ``spec`` with no
    sharing and no prefix cache: what the model computes without copy-on-write, to compare against."""
    blocks = sum(-(-len(t) // spec.block_size) for t in token_lists) + 1
    manager = SequenceManager(BlockPool(blocks, spec=spec))
    return model.step(manager, [manager.create() for _ in token_lists], [list(t) for t in token_lists])
