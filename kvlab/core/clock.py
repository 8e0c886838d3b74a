"""Clocks. The pool stamps allocations and accesses with a clock; the default is logical (a step counter), so
LRU order, replays and tests are deterministic. Inject :class:`WallClock` to see real seconds instead."""
from __future__ import annotations

import time
from typing import Protocol

from kvlab.core.errors import ConfigError


class Clock(Protocol):
    """Anything with ``now() -> int`` and ``tick() -> int``; ``tick`` advances a logical clock and just reads a
    wall clock. Ints, because the pool keeps its time stamps in int64 arrays."""

    def now(self) -> int: ...

    def tick(self) -> int: ...


class LogicalClock:
    """A step counter: every ``tick()`` is one step later. The pool ticks once per public mutation."""

    __slots__ = ("step",)

    def __init__(self, start: int = 0) -> None:
        if type(start) is not int or start < 0:
            raise ConfigError(f"a logical clock starts at an int >= 0, not {start!r}")
        self.step = start

    def now(self) -> int:
        return self.step

    def tick(self) -> int:
        self.step += 1
        return self.step


class WallClock:
    """Nanoseconds from ``time.perf_counter_ns``; ``tick`` just reads it."""

    __slots__ = ()

    def now(self) -> int:
        return time.perf_counter_ns()

    tick = now
