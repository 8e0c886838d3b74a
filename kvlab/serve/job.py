"""A request inside the engine (:class:`Job`), and where each fact of its sequence lives: in one place.

The scheduler decides who runs; the memory holds K/V. A job's facts are split between them, each kept once:

* the token ids known so far (the prompt's, then each generated one) are the job's ``tokens``; those it generated
  are ``tokens[req.prompt_len:]``;
* how many of them have their K/V cached is the memory's count, ``kv.num_tokens``. ``kv`` is what the memory
  holds for the job (a paged :class:`~kvlab.core.sequence.Sequence`, a contiguous :class:`~kvlab.serve.memory.Region`,
  or :data:`NO_KV` while it holds nothing), and only the memory changes it: admission (a prefix hit starts it
  above 0), each step's append, release;
* which queue holds it is its ``state``; what its tenant is charged is ``counted``: the blocks it holds plus
  ``pending``, those promised for this step's tokens.

A step feeds ``tokens[kv.num_tokens:kv.num_tokens + n]``; when the KV holds every known token the model samples the
next one, so a request holding memory always has a token left to feed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvlab.serve.metrics import RequestRecord
from kvlab.workloads.mixes import Request

WAITING, RUNNING, SWAPPED, FINISHED = "waiting", "running", "swapped", "finished"


class KV(Protocol):
    """What a memory holds for an admitted request: ``num_tokens`` of its tokens have their K/V there."""
    num_tokens: int


class NoKV:
    """What a request holding no memory holds (waiting, or preempted to be recomputed): no tokens."""
    __slots__ = ()
    num_tokens: int = 0  # a class attribute: setting it on the instance raises AttributeError


NO_KV = NoKV()


@dataclass(slots=True, eq=False)
class Job:
    """A request inside the engine (see the module docstring for where each of its facts lives). The prompt's
    ids are built when the request first comes up for admission (a queue of long prompts would otherwise hold
    them all), so ``tokens`` is empty until then."""
    req: Request
    rec: RequestRecord
    tokens: list[int] = field(default_factory=list)
    kv: KV = NO_KV
    state: str = WAITING
    pending: int = 0
    counted: int = 0

    def decodes(self, n: int) -> bool:
        """Whether feeding ``n`` tokens now is a decode (the one token it generated last) rather than a chunk of
        prefill (its prompt, or what it recomputes after a preemption)."""
        return n == 1 and self.kv.num_tokens + 1 == len(self.tokens) > self.req.prompt_len


__all__ = ["FINISHED", "Job", "KV", "NO_KV", "NoKV", "RUNNING", "SWAPPED", "WAITING"]
