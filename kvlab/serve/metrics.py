"""Serving metrics for the engine (text §2.2.6 "性能监控"): per-step gauges, per-request latency, a summary.

Each engine step yields one :class:`StepMetrics` event (published on the pool's event bus when someone listens,
always kept in :class:`MetricsLog`). Definitions, the same for the paged engine and the contiguous baseline:

* ``utilisation`` -- token states held (cached blocks' included) / token slots of the whole memory: how much of
  the KV memory does work;
* ``usage_by_block`` and ``usage_by_token`` side by side -- the memory held by running requests, counted by the
  blocks (vLLM's ``kv_cache_usage``: blocks in use / all blocks; cached blocks count as free, since any request
  may take them) and by the tokens in those blocks (/ all token slots). Seventeen-token prompts at block size
  16 take two blocks each for 17 tokens: the two figures part by the half-empty last blocks;
* ``internal_waste`` -- reserved slots that hold no token / reserved slots (the half-empty last block of a paged
  sequence; the never-used tail of a max-length contiguous region);
* ``fragmentation`` -- free slots that the next request cannot use / free slots (0 for a uniform paged pool,
  where every free block serves any request);
* ``stall_s`` -- seconds the step waited on copies between host and device memory (swap preemption);
* per request: ``ttft`` (arrival to first output token) and ``tpot`` (mean time between later output tokens), in
  engine steps and in seconds (simulated seconds from the engine's :class:`~kvlab.serve.config.CostModel`, or wall
  seconds in real mode);
* per cached block, in pool clock ticks (the pool's clock ticks once per pool mutation, several times a step):
  its *lifetime* (allocation to eviction) and its *idle time before eviction* (last access to eviction), both
  gathered by a pool evict hook (:class:`BlockLifetimes`), and the *reuse gap* of every prefix-cache hit that
  revived a cached block (how long it had been idle), measured by the cache when it takes the reference. Each
  is summarised by :func:`distribution` (count, mean, p50, p90, max).
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlab.core.errors import ConfigError
from kvlab.core.events import EngineEvent

if TYPE_CHECKING:
    from kvlab.core.pool import BlockPool


@dataclass(slots=True)
class StepMetrics(EngineEvent):
    """Gauges after engine step ``engine_step`` (``time_s`` is the engine clock in seconds)."""
    time_s: float
    running: int
    waiting: int
    swapped: int
    prefill_tokens: int
    decode_tokens: int
    capacity_slots: int
    reserved_slots: int
    token_slots: int
    fragmentation: float
    evictions: int
    preemptions: int
    prefix_hit_rate: float  # prompt tokens served by the prefix cache / looked up, so far (first admissions)
    finished: int
    tenant_blocks: tuple[tuple[str, int], ...] = ()
    stall_s: float = 0.0
    used_slots: int = 0  # slots of the blocks (or regions) running requests hold
    used_tokens: int = 0  # tokens in them
    prefix_query_tokens: int = 0  # prompt tokens looked up at first admission so far (vLLM's queries)
    prefix_hit_tokens: int = 0  # of those, served by the prefix cache (vLLM's hits)

    @property
    def utilisation(self) -> float:
        return self.token_slots / self.capacity_slots

    @property
    def usage_by_block(self) -> float:
        return self.used_slots / self.capacity_slots

    @property
    def usage_by_token(self) -> float:
        return self.used_tokens / self.capacity_slots

    @property
    def internal_waste(self) -> float:
        return 1 - self.token_slots / self.reserved_slots if self.reserved_slots else 0.0


#: what :meth:`MetricsLog.series` reads: every number a step records, and the ratios derived from them
GAUGES = (*(f.name for f in fields(StepMetrics) if f.type in ("int", "float", int, float)),
          *(name for name, v in vars(StepMetrics).items() if isinstance(v, property)))


@dataclass(slots=True)
class RequestRecord:
    """Life of one request; the times are ``(step, seconds)`` pairs, -1 until they happen."""
    id: int
    tenant: str
    arrival_s: float
    output_len: int
    arrival_step: int = -1
    first_step: int = -1
    first_s: float = -1.0
    finish_step: int = -1
    finish_s: float = -1.0
    preemptions: int = 0
    prefix_hit_tokens: int = 0  # of its prompt, served by the prefix cache when it was first admitted
    preempted_hit_tokens: int = 0  # its own blocks found again when readmitted after preemptions (not sharing)

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.arrival_s

    @property
    def ttft_steps(self) -> int:
        return self.first_step - self.arrival_step

    @property
    def tpot_s(self) -> float:
        return (self.finish_s - self.first_s) / (self.output_len - 1) if self.output_len > 1 else 0.0

    @property
    def tpot_steps(self) -> float:
        return (self.finish_step - self.first_step) / (self.output_len - 1) if self.output_len > 1 else 0.0

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s


def distribution(values: Sequence[float] | np.ndarray, name: str, unit: str) -> dict[str, float]:
    """``{name}_count``, and ``{name}_{mean,p50,p90,max}_{unit}`` of ``values`` (all 0 when there are none)."""
    try:
        x = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: values must be numbers, got {values!r:.80}") from None
    stats = (x.mean(), np.percentile(x, 50), np.percentile(x, 90), x.max()) if x.size else (0.0,) * 4
    return {f"{name}_count": int(x.size),
            **{f"{name}_{k}_{unit}": float(v) for k, v in zip(("mean", "p50", "p90", "max"), stats)}}


class BlockLifetimes:
    """Lifetime (allocation to eviction) and idle time before eviction of every cached block ``pool`` evicts, in
    pool clock ticks: one evict hook, two appends per eviction, nothing on any other path."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.lifetime = array("q")
        self.idle = array("q")
        pool.evict_hooks.append(self._on_evict)

    def _on_evict(self, b: int) -> None:
        f, now = self.pool.fields, self.pool.clock.now()
        self.lifetime.append(now - f.created[b])
        self.idle.append(now - f.last_access[b])

    def summary(self) -> dict[str, float]:
        """:func:`distribution` of both, as ``block_lifetime_*_ticks`` and ``idle_before_evict_*_ticks``."""
        return {**distribution(self.lifetime, "block_lifetime", "ticks"),
                **distribution(self.idle, "idle_before_evict", "ticks")}


def _pcts(x: np.ndarray, name: str, unit: str) -> dict[str, float]:
    if not x.size:
        return {}
    return {f"{name}_mean_{unit}": float(x.mean()), f"{name}_p50_{unit}": float(np.median(x)),
            f"{name}_p99_{unit}": float(np.percentile(x, 99))}


@dataclass
class MetricsLog:
    """All step gauges and request records of one run, and their summary."""
    steps: list[StepMetrics] = field(default_factory=list)
    requests: dict[int, RequestRecord] = field(default_factory=dict)

    def series(self, name: str) -> np.ndarray:
        """One gauge (:data:`GAUGES`) over the steps, e.g. ``series("utilisation")`` or ``series("waiting")``."""
        if not (isinstance(name, str) and name in GAUGES):
            raise ConfigError(f"unknown gauge {name!r:.80}; choose one of {', '.join(GAUGES)}")
        return np.array([getattr(s, name) for s in self.steps], dtype=float)

    def finished(self) -> list[RequestRecord]:
        return [r for r in self.requests.values() if r.finish_step >= 0]

    def summary(self) -> dict[str, Any]:
        """Totals, means of the gauges over busy steps, and latency percentiles of finished requests."""
        done = self.finished()
        last = self.steps[-1] if self.steps else None
        busy = [s for s in self.steps if s.running]
        out: dict[str, Any] = {
            "requests": len(self.requests), "finished": len(done), "steps": len(self.steps),
            "time_s": last.time_s if last else 0.0,
            "output_tokens": sum(r.output_len for r in done),
            "preemptions": last.preemptions if last else 0, "evictions": last.evictions if last else 0,
            "prefix_hit_rate": last.prefix_hit_rate if last else 0.0,
            "mean_running": float(np.mean([s.running for s in busy])) if busy else 0.0,
            "max_running": max((s.running for s in self.steps), default=0),
            "mean_waiting": float(np.mean([s.waiting for s in self.steps])) if self.steps else 0.0,
            "utilisation": float(np.mean([s.utilisation for s in busy])) if busy else 0.0,
            "internal_waste": float(np.mean([s.internal_waste for s in busy])) if busy else 0.0,
            "fragmentation": float(np.mean([s.fragmentation for s in busy])) if busy else 0.0,
            "usage_by_block": float(np.mean([s.usage_by_block for s in busy])) if busy else 0.0,
            "usage_by_token": float(np.mean([s.usage_by_token for s in busy])) if busy else 0.0,
            "peak_usage_by_block": max((s.usage_by_block for s in self.steps), default=0.0),
            "peak_usage_by_token": max((s.usage_by_token for s in self.steps), default=0.0),
            "prefix_cache_queries": last.prefix_query_tokens if last else 0,
            "prefix_cache_hits": last.prefix_hit_tokens if last else 0,
            "peak_reserved_slots": max((s.reserved_slots for s in self.steps), default=0),
            "swap_stall_s": sum(s.stall_s for s in self.steps),
            "stall_steps": sum(1 for s in self.steps if s.stall_s),
        }
        out["throughput_tok_s"] = out["output_tokens"] / out["time_s"] if out["time_s"] else 0.0
        for name, unit, values in (("ttft", "s", [r.ttft_s for r in done]),
                                   ("ttft", "steps", [r.ttft_steps for r in done]),
                                   ("tpot", "s", [r.tpot_s for r in done if r.output_len > 1]),
                                   ("tpot", "steps", [r.tpot_steps for r in done if r.output_len > 1]),
                                   ("latency", "s", [r.latency_s for r in done])):
            out.update(_pcts(np.asarray(values, dtype=float), name, unit))
        return out


def format_table(rows: dict[str, dict[str, Any]], keys: list[str] | None = None) -> str:
    """A plain-text table: one column per run in ``rows`` (name -> summary), one line per metric."""
    names = list(rows)
    keys = keys or list(next(iter(rows.values()), {}))
    def cell(v: Any) -> str:
        return f"{v:,.4g}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)

    width = max(len(k) for k in keys) if keys else 0
    cols = [max(len(n), *(len(cell(rows[n].get(k, ""))) for k in keys)) for n in names]
    lines = ["  ".join([" " * width, *(n.rjust(c) for n, c in zip(names, cols))])]
    lines += ["  ".join([k.ljust(width), *(cell(rows[n].get(k, "")).rjust(c) for n, c in zip(names, cols))])
              for k in keys]
    return "\n".join(lines)
