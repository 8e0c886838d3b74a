"""The serving engine's settings and its cost model: what :class:`~kvlab.serve.engine.Engine` is told.

:class:`EngineConfig` names the memory (paged, or a contiguous baseline), its size, the scheduler's limits
(sequences and tokens per step), preemption, prefix caching, tenants' quotas and reservations, and sampling.
:class:`CostModel` turns a step's work into simulated seconds (metadata mode has no real time). Both refuse a
bad setting when built, with :class:`~kvlab.core.errors.ConfigError` naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.serve.sampling import check_temperature, check_top_p
from kvlab.core.checks import check_choice, check_flag, check_positive, check_real, check_seed, is_int
from kvlab.core.errors import ConfigError
from kvlab.core.eviction import POLICIES


@dataclass(frozen=True)
class CostModel:
    """Simulated seconds of one step: ``base_s + token_s * tokens + context_s * context`` of compute, plus
    ``swap_token_s`` per token copied between host and device where the copy stalls the step.

    ``tokens`` are the tokens computed this step, ``context`` the cached tokens attention reads. The defaults
    are an assumption in the range of a 7B model on one data-centre GPU (5 ms fixed, 40 µs per computed token,
    0.5 µs per token read, 20 µs per token swapped); change them and the absolute figures change, the
    comparisons much less."""
    base_s: float = 5e-3
    token_s: float = 4e-5
    context_s: float = 5e-7
    swap_token_s: float = 2e-5

    def __post_init__(self) -> None:
        for name in ("base_s", "token_s", "context_s", "swap_token_s"):
            object.__setattr__(self, name, check_real(getattr(self, name), f"CostModel.{name}", lo=0,
                                                      unit=" of seconds"))

    def step_s(self, tokens: int, context: int) -> float:
        return self.base_s + self.token_s * tokens + self.context_s * context

    def swap_s(self, tokens: int) -> float:
        return self.swap_token_s * tokens


@dataclass
class EngineConfig:
    """Engine settings. ``memory="contiguous"`` runs the pre-paging baseline (max-length regions) instead;
    ``memory="contiguous-exact"`` the same with regions of exactly each request's prompt + output length.

    ``shared_prefill`` says what a waiting request does when the block of its prompt that follows its cached
    prefix is being computed right now by a running request (two users sending the same long document within a
    second): ``"wait"`` (default) leaves it queued until that block is cached, then takes it as a hit, so nothing is
    computed twice (SGLang's scheduler holds back such requests too); ``"duplicate"`` admits it at once and
    computes the shared part again, as vLLM does; the rest of its prompt is registered behind the copy that was
    registered first (:meth:`~kvlab.SequenceManager.cache_full_blocks` keeps one copy, vLLM keeps both). With
    ``"wait"`` and a pool that never evicts, the prefix hits equal :func:`kvlab.prefix_hit_bound`."""
    num_blocks: int = 4096
    block_size: int = 16
    policy: str = "lru"
    memory: str = "paged"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_batched_tokens: int = 512
    preemption: str = "recompute"
    prefix_caching: bool = True
    shared_prefill: str = "wait"
    prefetch: bool = True
    quotas: dict[str, int] = field(default_factory=dict)
    reservations: dict[str, int] = field(default_factory=dict)
    cost: CostModel = field(default_factory=CostModel)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_batched_tokens"):
            setattr(self, name, check_positive(getattr(self, name), f"EngineConfig.{name}"))
        for name, options in (("memory", ("paged", "contiguous", "contiguous-exact")),
                              ("preemption", ("recompute", "swap")), ("shared_prefill", ("wait", "duplicate")),
                              ("policy", (*POLICIES, "opt"))):
            check_choice(getattr(self, name), f"EngineConfig.{name}", options)
        self.temperature = check_temperature(self.temperature, "EngineConfig.temperature")
        self.top_p = check_top_p(self.top_p, "EngineConfig.top_p")
        self.seed = check_seed(self.seed, "EngineConfig.seed", optional=True)
        for name in ("prefix_caching", "prefetch", "stop_at_eos"):
            setattr(self, name, check_flag(getattr(self, name), f"EngineConfig.{name}"))
        if not isinstance(self.cost, CostModel):
            raise ConfigError(f"EngineConfig.cost must be a CostModel, got {self.cost!r}")
        for name in ("quotas", "reservations"):
            d = getattr(self, name)
            if not isinstance(d, dict):
                raise ConfigError(f"EngineConfig.{name} must be a dict of tenant -> blocks, got {d!r}")
            bad = {t: v for t, v in d.items() if not isinstance(t, str) or not is_int(v) or v < 0}
            if bad:
                raise ConfigError(f"EngineConfig.{name} maps tenant names (str) to block counts >= 0, got {bad}")
        over = sum(self.reservations.values())
        if over > self.num_blocks:
            raise ConfigError(f"reservations sum to {over} blocks but the pool has {self.num_blocks}")
        low = {t: (q, self.reservations[t]) for t, q in self.quotas.items() if self.reservations.get(t, 0) > q}
        if low:
            raise ConfigError(f"reservation above quota for tenants {low} (quota, reservation)")


__all__ = ["CostModel", "EngineConfig"]
