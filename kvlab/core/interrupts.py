"""Interrupts never land inside a mutation: a call either completes or never started.

Jupyter's "interrupt kernel" sends SIGINT, and Python raises :class:`KeyboardInterrupt` at whatever bytecode the
main thread is running: between a block table's switch and the copy that should follow it, say. kvlab marks its
mutating methods *atomic* (:func:`atomic`, one line a class or function) and handles SIGINT itself
(:func:`install`): when the signal comes while an atomic method is on the main thread's stack, it is held, and
raised as the outermost one returns, so the caller sees a clean ``KeyboardInterrupt`` after a complete call (and
never gets its return value: a caller that must not lose what a call made passes a list for it to fill, as
:mod:`kvlab.distributed.disagg` does). Elsewhere it is raised at once, as Python's own handler does. Long
loops (``Engine.run``) are not atomic: an interrupt stops them between steps.

Nothing is paid until a signal comes: marking keeps a set of code objects, and only the handler walks the stack.
Holding the signal sets a trace function on the outermost atomic frame (chained to any tracer already there,
a debugger's or coverage's). IPython resets SIGINT to Python's handler before each cell, so kvlab installs its
handler again before each cell (``pre_run_cell``).
"""
from __future__ import annotations

import signal
import sys
import threading
from inspect import CO_COROUTINE, CO_GENERATOR
from collections.abc import Callable
from types import CodeType, FrameType, FunctionType
from typing import Any, TypeVar

ATOMIC: set[CodeType] = set()  # the code of every atomic method
T = TypeVar("T")
_held: list[FrameType] = []  # the frame whose return raises the held interrupt (at most one)


def atomic(names: str | None = None) -> Callable[[T], T]:
    """Decorator: a function, or a class's own public methods (or those ``names``, space-separated, private ones
    too), run to the end when an interrupt comes."""
    def mark(obj: T) -> T:
        if isinstance(obj, FunctionType):
            fns: list[Any] = [obj]
        else:
            chosen = names.split() if names is not None else [n for n in vars(obj) if not n.startswith("_")]
            fns = [getattr(vars(obj)[n], "__func__", vars(obj)[n]) for n in chosen]  # a static/classmethod's
        for fn in fns:
            code = getattr(fn, "__code__", None)  # a property, a C method: nothing to mark
            if code is not None and not code.co_flags & (CO_GENERATOR | CO_COROUTINE):  # they return at each yield
                ATOMIC.add(code)
        return obj
    return mark


def install() -> bool:
    """Handle SIGINT as described above, if this is the main thread and SIGINT has Python's own handler (a
    handler someone else installed is left alone). Returns whether kvlab's handler is the one now."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGINT)
    if current is _on_sigint:
        return True
    if current is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, _on_sigint)
    return True


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    outer, f = None, frame
    while f is not None:
        if f.f_code in ATOMIC:
            outer = f
        f = f.f_back
    if outer is None:
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as Python's handler does
    if _held:  # one interrupt is already held: a second press changes nothing more
        return
    assert outer is not None
    _hold(outer)


def _hold(outer: FrameType) -> None:
    """Raise KeyboardInterrupt when ``outer`` returns (normally or by an exception)."""
    _held.append(outer)
    local, global_ = outer.f_trace, sys.gettrace()

    def tracer(fr: FrameType, event: str, arg: Any) -> Any:
        if local is not None:  # the frame's own tracer sees every event; this one must see the return
            local(fr, event, arg)
        if event == "return":
            _held.clear()
            fr.f_trace = local
            if global_ is None:
                sys.settrace(None)
            raise KeyboardInterrupt
        return tracer

    outer.f_trace = tracer
    if local is None:
        outer.f_trace_lines = False  # only the return matters here
    if global_ is None:  # frames get their events only while some trace function is set
        sys.settrace(_quiet)


def _quiet(frame: FrameType, event: str, arg: Any) -> None:
    """A global trace function that traces nothing new (the held frame keeps its own)."""
    return None


def install_for_ipython() -> None:
    """Install before every IPython cell (IPython puts Python's handler back before running one)."""
    ipython = sys.modules.get("IPython")  # only where IPython already runs: kvlab never imports it
    ip = ipython.get_ipython() if ipython is not None else None
    if ip is not None and getattr(ip, "events", None) is not None:
        try:
            ip.events.unregister("pre_run_cell", _pre_run_cell)
        except ValueError:
            pass
        ip.events.register("pre_run_cell", _pre_run_cell)


def _pre_run_cell(*_args: Any) -> None:
    install()
