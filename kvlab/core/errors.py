"""Typed errors. Every rejected call raises a subclass of :class:`KVLabError` and leaves the pool unchanged.

The message always names the block, state or value at fault, so a student reading a traceback learns what
went wrong without opening the source.
"""
from __future__ import annotations


class KVLabError(Exception):
    """Base class of every error kvlab raises on purpose."""


class OutOfBlocksError(KVLabError):
    """The pool has too few FREE (or evictable) blocks for the request."""


class UnknownBlockError(KVLabError, KeyError):
    """A block id outside the pool, or not the head of a block."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DoubleFreeError(KVLabError):
    """A block was released while already FREE (or released twice in one batch)."""


class RefcountUnderflowError(KVLabError):
    """A reference was dropped from a block whose refcount is already 0."""


class IllegalTransitionError(KVLabError):
    """A state change the block state machine does not allow (see :mod:`kvlab.core.block`)."""


class KVDataError(KVLabError, ValueError):
    """KV data of the wrong shape, dtype or device, or more tokens than a block holds."""


class ConfigError(KVLabError, ValueError):
    """An invalid argument to a constructor or function (sizes, names, budgets)."""


class TraceFormatError(KVLabError, ValueError):
    """A malformed line in a workload trace file; ``path`` and ``line`` (1-based) say where."""

    def __init__(self, path: str, line: int, problem: str) -> None:
        # Cut: a hostile file must not make a message of millions of characters (the path, or a value quoted).
        path = path if len(path) <= 200 else path[:200] + "..."
        problem = problem if len(problem) <= 500 else f"{problem[:500]}... ({len(problem):,} characters)"
        super().__init__(f"{path}, line {line}: {problem}")
        self.path, self.line, self.problem = path, line, problem

    def __reduce__(self):  # keep it picklable (e.g. across multiprocessing) despite the custom signature
        return type(self), (self.path, self.line, self.problem)


class ModelFileError(KVLabError, ValueError):
    """A model file kvlab cannot run: truncated, not GGUF, or an architecture or tokenizer it does not implement.
    The message names the file or the value at fault; nothing is loaded."""


class KVEventError(KVLabError, ValueError):
    """A KV event message kvlab cannot take (:mod:`kvlab.kvevents`): frames other than ``[topic, 8-byte seq,
    payload]``, a payload over the size cap, or bytes that are no KV event batch. The message names the value."""


class NoEventsError(KVLabError, TimeoutError):
    """No KV event arrived from an endpoint in the time given; the message says what to check (who binds)."""
