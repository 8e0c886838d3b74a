"""What the serving engine reports on its bus, besides the pool's, sequences' and prefix cache's own events and
:class:`~kvlab.serve.metrics.StepMetrics`. Each is an :class:`~kvlab.core.events.EngineEvent`: ``step`` is the
pool clock (engine and pool events interleave in one order), ``engine_step`` the engine's step count."""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.core.events import EngineEvent


@dataclass(slots=True)
class Admitted(EngineEvent):
    """A request entered the running batch; ``cached_tokens`` of its prompt came from the prefix cache."""
    request_id: int
    tenant: str
    cached_tokens: int


@dataclass(slots=True)
class Preempted(EngineEvent):
    """A running request lost its blocks: ``mode`` is ``"recompute"`` or ``"swap"``; ``blocks`` it held."""
    request_id: int
    tenant: str
    mode: str
    blocks: int
    reason: str


@dataclass(slots=True)
class SwappedIn(EngineEvent):
    """A swapped request's ``blocks`` came back; ``prefetched`` when it happened ahead of need."""
    request_id: int
    blocks: int
    prefetched: bool


@dataclass(slots=True)
class Finished(EngineEvent):
    """A request produced its last token and released its blocks."""
    request_id: int
    tenant: str
    ttft_s: float
    tpot_s: float


@dataclass(slots=True)
class TenantReclaimed(EngineEvent):
    """A tenant left: ``requests`` were aborted and ``blocks`` returned to the pool."""
    tenant: str
    requests: int
    blocks: int


__all__ = ["Admitted", "Finished", "Preempted", "SwappedIn", "TenantReclaimed"]
