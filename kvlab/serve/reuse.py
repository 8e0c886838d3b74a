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

from kvlab.core.checks import check_positive, check_token_ids
from kvlab.core.errors import ConfigError
from kvlab.core.pool import BlockPool
from kvlab.core.sequence import SequenceManager
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
