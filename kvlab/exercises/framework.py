"""The machinery of :mod:`kvlab.exercises`: the records (predictions, answers, hints, the score), the
comparison of answers by value (:func:`canon`, :func:`same`, :func:`compare_fn`) and the fast-mode switch. The
chapters' modules (``ch2_2_1`` ... ``ch2_2_6``) import it and register their exercises; the package re-exports it.
"""
from __future__ import annotations

import copy
import math
import operator
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvlab.core.block import BlockStatus
from kvlab.core.checks import check_real, show
from kvlab.core.errors import ConfigError, KVLabError
from kvlab.core.pool import BlockPool
from kvlab.core.spec import KVSpec

__all__ = [
    "Canon", "Exercise", "Prediction", "Result", "Summary", "Unreadable", "Verdict", "KINDS", "HINT_STAGES",
    "fast_mode", "sized", "register", "register_prediction", "exercise", "list_exercises", "list_predictions",
    "check", "prompt", "hint", "predict", "reveal", "summary", "reset", "Attempt", "attempts", "history", "record",
    "canon", "same", "compare_fn", "returned", "agrees", "text", "metadata_pool",
]


def fast_mode() -> bool:
    """True when ``KVLAB_FAST`` is set to 1/true/yes: notebooks and demos use small sizes."""
    return os.environ.get("KVLAB_FAST", "").strip().lower() in ("1", "true", "yes", "on")


def sized(full: Any, fast: Any) -> Any:
    """``fast`` in fast mode, else ``full`` (e.g. ``n_requests = sized(2000, 200)``)."""
    return fast if fast_mode() else full


# The marks of a verdict: glyphs that both DejaVu Sans and Noto Sans CJK (the fonts the README installs) draw. The
# ballot X (U+2717) is missing from Noto Sans CJK, the emoji cross, check and bulb (U+274C, U+2705, U+1F4A1) from
# both: they showed as boxes.
RIGHT, WRONG = "✓", "×"

# What an exercise asks of the student; a chapter needs more than "compute".
KINDS = ("compute", "errata", "interpret", "parameter")
HINT_STAGES = ("nudge", "method", "formula")


@dataclass(frozen=True)
class Result:
    """The verdict on one answer or prediction; truthy when right. Shows itself as text or Markdown.

    ``details`` are per-item lines for a tuple/list answer; ``hint`` is the hint of stage ``stage``
    (1 nudge, 2 method, 3 formula; 0 when right or there is none)."""

    exercise: str
    ok: bool
    message: str
    hint: str = ""
    stage: int = 0
    details: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.ok

    def _hint_label(self) -> str:
        return f"提示 {self.stage}/{len(HINT_STAGES)} ({HINT_STAGES[self.stage - 1]})" if self.stage else "提示 (hint)"

    def __str__(self) -> str:
        mark = f"{RIGHT} 正确 (right)" if self.ok else f"{WRONG} 还不对 (not yet)"
        lines = [f"[{self.exercise}] {mark}: {self.message}"] + [f"  {d}" for d in self.details]
        if not self.ok and self.hint:
            lines.append(f"  {self._hint_label()}: {self.hint}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_markdown_(self) -> str:
        mark = f"{RIGHT} **正确 (right)**" if self.ok else f"{WRONG} **还不对 (not yet)**"
        out = f"`{_md(self.exercise)}` {mark}: {_md(self.message)}" + "".join(f"<br>&nbsp;&nbsp;{_md(d)}"
                                                                          for d in self.details)
        if not self.ok and self.hint:
            out += f"<br>**{self._hint_label()}**: {_md(self.hint)}"
        return out


# What Markdown or HTML would read as markup, as character references: a student's answer quoted in a message
# (an <img onerror=...>, a [link](javascript:...), a | that ends a table cell) shows as text, in the notebook and
# in the exported site.
_MARKUP = str.maketrans({c: f"&#{ord(c)};" for c in "&<>\"'`|[]()*_~\\!#"})


def _md(text: str) -> str:
    """``text`` safe to put in Markdown: every character Markdown or HTML gives a meaning, escaped."""
    return str(text).translate(_MARKUP)


Verdict = tuple[bool, str] | tuple[bool, str, tuple[str, ...]]


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``judge(answer) -> (ok, message[, details])`` computes the truth with kvlab and compares.

    ``hints`` are the three stages (nudge, method, formula); ``kind`` is one of :data:`KINDS`."""

    key: str
    prompt: str
    hints: tuple[str, str, str]
    judge: Callable[[Any], Verdict]
    kind: str = "compute"

    @property
    def chapter(self) -> str:
        return self.key.split("-", 1)[0]

    def check(self, answer: Any, stage: int = 1) -> Result:
        """The verdict on ``answer``; a wrong one carries the hint of ``stage`` (1..3)."""
        details: tuple[str, ...] = ()
        try:
            verdict = self.judge(answer)
            ok, msg = verdict[0], verdict[1]
            if len(verdict) == 3:
                details = verdict[2]
        except Unreadable as e:  # an answer of a type the checker does not compare: wrong, and why
            ok, msg = False, str(e)
        except KVLabError:
            raise  # a bug in the scenario itself must not read as a wrong answer
        except Exception as e:  # the student's function crashed: that is a wrong answer, say why
            ok, msg = False, f"你的答案运行时出错 (your answer raised) {type(e).__name__}: {text(e)}"
        if ok is True:
            return Result(self.key, True, msg, details=details)
        stage = min(max(stage, 1), len(HINT_STAGES))
        return Result(self.key, False, msg, self.hints[stage - 1], stage, details)


@dataclass(frozen=True)
class Prediction:
    """A question the student answers before a chapter measures: a value (compared within ``rel_tol``) or one of
    ``choices``."""

    key: str
    question: str
    choices: tuple[str, ...] = ()
    rel_tol: float = 0.0

    @property
    def chapter(self) -> str:
        return self.key.split("-", 1)[0]


EXERCISES: dict[str, Exercise] = {}
PREDICTIONS: dict[str, Prediction] = {}


@dataclass(frozen=True)
class Attempt:
    """One judgement, as :func:`attempts` lists them: the exercise or prediction, what was given (as text), the
    verdict and, for an exercise, the hint stage it reached."""

    key: str
    given: str
    ok: bool
    stage: int = 0


@dataclass
class _Progress:
    """What this kernel has seen: misses per exercise (they drive the hint stage), last verdicts, predictions,
    every judgement (``log``) and the scores that :func:`reset` cleared (``history``)."""

    misses: dict[str, int] = field(default_factory=dict)
    solved: dict[str, bool] = field(default_factory=dict)
    predicted: dict[str, Any] = field(default_factory=dict)
    revealed: dict[str, bool] = field(default_factory=dict)  # a revealed prediction is locked: its verdict
    log: list[Attempt] = field(default_factory=list)
    history: list["Summary"] = field(default_factory=list)


_PROGRESS = _Progress()


def register(key: str, prompt: str, hints: Sequence[str], kind: str = "compute"
             ) -> Callable[[Callable[[Any], Verdict]], Callable[[Any], Verdict]]:
    """Decorator: register ``judge`` as exercise ``key`` (``"<chapter>-<name>"``) with three staged hints."""
    def deco(judge: Callable[[Any], Verdict]) -> Callable[[Any], Verdict]:
        if key in EXERCISES or key in PREDICTIONS:
            raise ConfigError(f"exercise {key!r} is defined twice")
        if len(hints) != len(HINT_STAGES) or not all(hints):
            raise ConfigError(f"exercise {key!r} needs {len(HINT_STAGES)} hints {HINT_STAGES}, got {len(hints)}")
        if kind not in KINDS:
            raise ConfigError(f"exercise {key!r}: kind {kind!r} is not one of {KINDS}")
        EXERCISES[key] = Exercise(key, prompt, (hints[0], hints[1], hints[2]), judge, kind)
        return judge
    return deco


def register_prediction(key: str, question: str, choices: Sequence[str] = (), rel_tol: float = 0.0) -> Prediction:
    """Declare the prediction ``key``: a question answered before a measurement, one of ``choices`` or (without
    choices) a number, matched within ``rel_tol``."""
    if key in PREDICTIONS or key in EXERCISES:
        raise ConfigError(f"prediction {key!r} is defined twice")
    rel_tol = check_real(rel_tol, f"prediction {key!r}: rel_tol", lo=0)
    PREDICTIONS[key] = Prediction(key, question, tuple(choices), rel_tol)
    return PREDICTIONS[key]


def exercise(key: str) -> Exercise:
    """The exercise ``key`` (e.g. ``"2.2.2-lru"``); :class:`ConfigError` lists the known keys otherwise."""
    if not isinstance(key, str) or key not in EXERCISES:  # a list as key is unhashable: no TypeError
        raise ConfigError(f"unknown exercise {show(key)}; known: {', '.join(sorted(EXERCISES))}")
    return EXERCISES[key]


PREDICTION_MAX = 1e18  # a measured quantity: anything larger is a typo (and a huge int cannot even be shown)


def _prediction(key: str) -> Prediction:
    if not isinstance(key, str) or key not in PREDICTIONS:
        raise ConfigError(f"unknown prediction {show(key)}; known: {', '.join(sorted(PREDICTIONS))}")
    return PREDICTIONS[key]


def list_exercises(chapter: str | None = None, kind: str | None = None) -> list[str]:
    """Keys of the exercises, those of ``chapter`` (e.g. ``"2.2.3"``) and of ``kind`` only if given."""
    if kind is not None and kind not in KINDS:
        raise ConfigError(f"kind {kind!r} is not one of {KINDS}")
    return sorted(k for k, e in EXERCISES.items()
                  if (chapter is None or e.chapter == chapter) and (kind is None or e.kind == kind))


def list_predictions(chapter: str | None = None) -> list[str]:
    """Keys of the predictions, those of ``chapter`` only if given."""
    return sorted(k for k, p in PREDICTIONS.items() if chapter is None or p.chapter == chapter)


def check(key: str, answer: Any) -> Result:
    """Check ``answer`` to exercise ``key``. A wrong answer carries a hint that gets more specific with each miss
    (nudge, then method, then formula). ``...`` (the chapters' placeholder, left as it is by Run All) is no
    answer yet: nothing is judged or counted."""
    ex = exercise(key)
    if answer is Ellipsis:
        return Result(key, False, "还没有答案 (no answer yet): 把 ... 换成你的答案 (replace ... with yours)")
    result = ex.check(answer, _PROGRESS.misses.get(key, 0) + 1)
    if not result.ok:
        _PROGRESS.misses[key] = _PROGRESS.misses.get(key, 0) + 1
    _PROGRESS.solved[key] = result.ok
    _PROGRESS.log.append(Attempt(key, text(answer), result.ok, result.stage))
    return result


def prompt(key: str) -> str:
    """The task of exercise ``key`` (or the question of prediction ``key``) in words (Chinese, identifiers in
    English)."""
    if key in PREDICTIONS:
        p = PREDICTIONS[key]
        return p.question + (f"  选项 (choices): {', '.join(p.choices)}" if p.choices else "")
    return exercise(key).prompt


def hint(key: str, stage: int) -> str:
    """Hint ``stage`` (1 nudge, 2 method, 3 formula) of exercise ``key``."""
    if type(stage) is not int or not 1 <= stage <= len(HINT_STAGES):
        raise ConfigError(f"hint stage must be 1..{len(HINT_STAGES)}, got {stage!r}")
    return exercise(key).hints[stage - 1]


def predict(key: str, value: Any) -> str:
    """Record the prediction ``value`` for ``key`` before the chapter measures it; returns what was recorded.

    ``...`` (Ellipsis) means "not predicted yet" and clears an earlier prediction. A value that is not one of
    the question's choices, or not a plain value (see :func:`canon`), is refused with :class:`ConfigError`.
    Once :func:`reveal` has shown the measurement, the prediction is locked (a cell run again keeps it):
    :func:`reset` starts the chapter over."""
    p = _prediction(key)
    if key in _PROGRESS.revealed:
        held = repr(_PROGRESS.predicted[key]) if key in _PROGRESS.predicted else "没有预测 (none)"
        return (f"[{key}] 已揭晓，预测不再改变 (revealed: the prediction stays {held}); "
                "reset 重新开始 (reset starts over)")
    if value is Ellipsis:
        _PROGRESS.predicted.pop(key, None)
        return f"[{key}] 还没有预测 (no prediction yet)"
    try:
        c = canon(value)
    except Unreadable as e:
        raise ConfigError(f"prediction {key!r}: {e}") from None
    if p.choices and c not in p.choices:
        raise ConfigError(f"prediction {key!r}: {show(value)} is not one of the choices {list(p.choices)}")
    if not p.choices and not (isinstance(c, (int, float)) and abs(c) <= PREDICTION_MAX):  # NaN and inf fail too
        # checked before recording: a 5,000-digit int has no repr, and summary() and reveal() show it later
        raise ConfigError(f"prediction {key!r}: expected a finite number of at most {PREDICTION_MAX:.0e} in size, "
                          f"got {show(value)}")
    _PROGRESS.predicted[key] = c
    return f"[{key}] 已记录预测 (prediction recorded): {c!r}"


def reveal(key: str, measured: Any) -> Result:
    """Compare the recorded prediction for ``key`` with ``measured`` (what kvlab just measured). From now on the
    prediction is locked, made or not: the measurement is on the screen."""
    p = _prediction(key)
    truth = canon(measured)
    if p.choices and truth not in p.choices:
        raise ConfigError(f"prediction {key!r}: the measurement {measured!r} is not one of {list(p.choices)}")
    if key not in _PROGRESS.predicted:
        _PROGRESS.revealed[key] = False
        _PROGRESS.log.append(Attempt(key, "", False))
        return Result(key, False, f"没有记录预测 (no prediction recorded); 测得 (measured) {truth!r}")
    guess = _PROGRESS.predicted[key]
    ok = _close(truth, guess, p.rel_tol) if isinstance(truth, (int, float)) else truth == guess
    _PROGRESS.revealed[key] = ok
    _PROGRESS.log.append(Attempt(key, repr(guess), ok))
    tol = f" (±{p.rel_tol:.0%})" if p.rel_tol and isinstance(truth, (int, float)) else ""
    return Result(key, ok, f"你预测 (you predicted) {guess!r}{tol}, 测得 (measured) {truth!r}")


def record(key: str, given: str, ok: bool, stage: int = 0) -> None:
    """Add a judgement to :func:`attempts` (the drawn problems of :mod:`kvlab.exercises.scenarios` use it)."""
    _PROGRESS.log.append(Attempt(key, given, ok, stage))


def attempts(chapter: str | None = None) -> list[Attempt]:
    """Every judgement made in this kernel (of ``chapter`` only if given), in order; :func:`reset` keeps them."""
    return [a for a in _PROGRESS.log if chapter is None or a.key.split("-", 1)[0] == chapter]


def history(chapter: str | None = None) -> list[Summary]:
    """The scores :func:`reset` cleared (of ``chapter`` only if given), oldest first."""
    return [h for h in _PROGRESS.history if chapter is None or h.chapter == chapter]


@dataclass(frozen=True)
class Summary:
    """A chapter's score: exercises right out of all, predictions made and matched; one row per item."""

    chapter: str
    exercises: int
    right: int
    attempted: int
    predictions: int
    predicted: int
    matched: int
    rows: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        head = (f"§{self.chapter}: 练习 (exercises) {self.right}/{self.exercises} 正确 (right), "
                f"{self.attempted} 已尝试 (tried); 预测 (predictions) {self.matched}/{self.predicted} 命中 (matched), "
                f"{self.predicted}/{self.predictions} 已做 (made)")
        return "\n".join([head] + [f"  {k}: {v}" for k, v in self.rows])

    __repr__ = __str__

    def _repr_markdown_(self) -> str:
        rows = "".join(f"| `{_md(k)}` | {_md(v)} |\n" for k, v in self.rows)
        return f"**{_md(str(self).splitlines()[0])}**\n\n| item | state |\n|---|---|\n{rows}"


def summary(chapter: str) -> Summary:
    """The score of ``chapter`` (e.g. ``"2.2.1"``) in this kernel: right answers (and whether the first answer,
    the student's prediction, was right) and matched predictions."""
    keys, preds = list_exercises(chapter), list_predictions(chapter)
    if not keys and not preds:
        chapters = sorted({e.chapter for e in EXERCISES.values()})
        raise ConfigError(f"no exercises for chapter {chapter!r}; known: {', '.join(chapters)}")
    rows = []
    for k in keys:
        misses = _PROGRESS.misses.get(k, 0)
        if k not in _PROGRESS.solved:
            state = "—"
        elif _PROGRESS.solved[k]:  # a first answer is a prediction: say whether it held
            state = f"{RIGHT} 第一次就对 (first try)" if not misses else \
                f"{RIGHT} ({misses} 次未中后 after {misses} misses)"
        else:
            state = f"{WRONG} ({misses} 次未中 misses)"
        rows.append((k, state))
    for k in preds:
        if k not in _PROGRESS.predicted:
            rows.append((k, "未预测 (not predicted)"))
        else:
            seen = _PROGRESS.revealed.get(k)
            shown = "待揭晓 (pending)" if seen is None else "命中 (matched)" if seen else "未命中 (missed)"
            rows.append((k, f"{_PROGRESS.predicted[k]!r}: {shown}"))
    return Summary(chapter, len(keys), sum(_PROGRESS.solved.get(k, False) for k in keys),
                   sum(k in _PROGRESS.solved for k in keys), len(preds),
                   sum(k in _PROGRESS.predicted for k in preds), sum(_PROGRESS.revealed.get(k, False) for k in preds),
                   tuple(rows))


def reset(chapter: str | None = None) -> None:
    """Start over (``chapter`` only if given): answers and predictions are forgotten, unlocked, and each score
    that had anything in it is kept in :func:`history` (every judgement stays in :func:`attempts`)."""
    chapters = {e.chapter for e in EXERCISES.values()} | {p.chapter for p in PREDICTIONS.values()}
    for ch in sorted(chapters if chapter is None else chapters & {chapter}):
        s = summary(ch)
        if s.attempted or s.predicted or any(k in _PROGRESS.revealed for k in list_predictions(ch)):
            _PROGRESS.history.append(s)
    for d in (_PROGRESS.misses, _PROGRESS.solved, _PROGRESS.predicted, _PROGRESS.revealed):
        for k in [k for k in d if chapter is None or k.split("-", 1)[0] == chapter]:
            del d[k]


# ---------------------------------------------------------------------------- helpers for the checkers
# Answers are compared in a canonical form of plain Python values, truth on the left. Only the answer's real type
# is consulted (``type(x)``, never ``isinstance``, which trusts a ``__class__`` property) and its value is read
# through the base type's own methods, so an answer cannot pass by overriding ``__eq__``, ``__iter__`` or
# ``__index__``; anything that is not a number, a string, a BlockStatus or a list/tuple/set/array of those is
# refused with a wrong-answer message rather than compared.
Canon = int | float | str | tuple["Canon", ...] | frozenset["Canon"]

_NUMPY_INTS = frozenset(np.dtype(c).type for c in np.typecodes["AllInteger"])
_NUMPY_FLOATS = frozenset(np.dtype(c).type for c in np.typecodes["Float"])
_MAX_DEPTH = 8  # deeper than any answer here; also stops a list that contains itself


class Unreadable(Exception):
    """An answer (or a value inside it) the checkers do not compare; its message is the wrong-answer text."""


def canon(x: Any, depth: int = 0) -> Canon:
    """``x`` as plain values: ints, floats and strs, BlockStatus members as their names, sequences and arrays as
    tuples, sets as frozensets. Raises :class:`Unreadable` for anything else."""
    t = type(x)
    if t is bool or t is np.bool_:
        raise Unreadable(f"答案里有 True/False，这里要的是数字 (the answer holds a bool {x}, not a number)")
    if t is BlockStatus:
        return BlockStatus(operator.index(x)).name  # the member by its stored value, not by its attributes
    if issubclass(t, int):
        return operator.index(x)  # for an int subclass this copies the stored value; __index__ is not called
    if t in _NUMPY_INTS:
        return operator.index(x)
    if issubclass(t, float):
        return float.__float__(x)  # np.float64 too; a subclass's own __float__ is bypassed
    if t in _NUMPY_FLOATS:
        return float(x)
    if issubclass(t, str):
        return str.__str__(x)  # np.str_ too; an exact copy of the stored text
    if depth >= _MAX_DEPTH:
        raise Unreadable("答案嵌套太深 (the answer is nested too deeply)")
    if issubclass(t, np.ndarray):
        return canon(np.ndarray.tolist(x), depth + 1)  # a 0-d array gives its scalar
    # the base type's own iterator reads the stored items, whatever a subclass's __iter__ says
    if issubclass(t, list):
        return tuple(canon(v, depth + 1) for v in list.__iter__(x))
    if issubclass(t, tuple):
        return tuple(canon(v, depth + 1) for v in tuple.__iter__(x))
    if issubclass(t, set):
        return frozenset(canon(v, depth + 1) for v in set.__iter__(x))
    if issubclass(t, frozenset):
        return frozenset(canon(v, depth + 1) for v in frozenset.__iter__(x))
    raise Unreadable(f"kvlab 不比较 {t.__name__} 类型的值 (kvlab does not compare a value of type "
                     f"{t.__name__}); 请用 int / float / str / list / tuple / set (use one of these)")


def text(x: Any, limit: int = 200) -> str:
    """``str(x)`` for a message, cut to ``limit`` characters; a broken ``__str__`` gives the type's name."""
    try:
        s = str(x)
    except Exception:
        s = f"<{type(x).__name__}>"
    return s if len(s) <= limit else s[:limit - 3] + "..."


def _close(want: Canon, got: Canon, rel_tol: float) -> bool:
    return isinstance(got, (int, float)) and isinstance(want, (int, float)) and \
        math.isclose(want, got, rel_tol=max(rel_tol, 1e-9), abs_tol=1e-9)


def agrees(want: Canon, got: Canon, close: bool) -> bool:
    """Truth on the left; both are canonical, so ``==`` is the plain types' own (numbers within 1e-9 if
    ``close``)."""
    if close and isinstance(want, (int, float)):
        return _close(want, got, 0.0)
    return want == got


def same(answer: Any, truth: Any, what: str, labels: Sequence[str] = (), two_way: Sequence[str] = ()) -> Verdict:
    """Compare ``answer`` with ``truth`` canonically. For a tuple/list truth the verdict says item by item which
    parts are right (named by ``labels`` if given) without giving away the wrong ones. An item named in ``two_way``
    has only two possible answers: marking it wrong would spell out the other, so it is neither marked nor counted
    (the verdict on the whole answer still covers it)."""
    want, got = canon(truth), canon(answer)  # a list answers a tuple question and the other way round
    if want == got:
        return True, f"{what} = {truth!r}"
    if not isinstance(want, tuple):
        return False, f"你的答案 (your answer) {got!r} ≠ kvlab 的结果 (kvlab's result)"
    if not isinstance(got, tuple):
        return False, f"答案应是 {len(want)} 项的列表或元组 (the answer should be a list/tuple of {len(want)} items)"
    if len(got) != len(want):
        return False, f"答案应有 {len(want)} 项，你给了 {len(got)} 项 (expected {len(want)} items, got {len(got)})"
    names = list(labels) if len(labels) == len(want) else [f"第 {i + 1} 项 (item {i + 1})" for i in range(len(want))]
    marked = [(n, w, g) for n, w, g in zip(names, want, got) if n not in two_way]
    details = tuple(f"{RIGHT} {n} = {g!r}" if w == g else f"{WRONG} {n}: {g!r} 不对 (is wrong)" for n, w, g in marked)
    details += tuple(f"· {n}: 二选一，不单独评 (a two-way item is judged only with the whole answer)"
                     for n in names if n in two_way)
    wrong = sum(w != g for _, w, g in marked)
    return False, f"{wrong}/{len(marked)} 项不对 (items wrong)" + (
        f"; 另有 {len(names) - len(marked)} 项二选一 (and two-way items)" if len(marked) < len(names) else ""), details


def returned(fn: Callable[..., Any], args: tuple, call: str) -> Canon:
    """What ``fn(*args)`` returns, canonical; a crash or an unreadable value is a wrong answer naming ``call``.
    The function gets copies, so that it cannot change the case it is judged on."""
    try:
        raw = fn(*copy.deepcopy(args))
    except Exception as e:  # even a KVLabError: it came from the student's code, not from the scenario
        raise Unreadable(f"{call} 运行时出错 (your answer raised) {type(e).__name__}: {text(e)}") from None
    try:
        return canon(raw)
    except Unreadable as e:
        raise Unreadable(f"{call}: {e}") from None


def compare_fn(fn: Any, cases: Iterable[tuple], reference: Callable[..., Any], name: str,
               close: bool = False) -> Verdict:
    """Run ``fn`` and ``reference`` on every case; wrong at the first disagreement, which the message shows."""
    if not callable(fn):
        return False, f"请传入一个函数 (pass a function) {name}(...), 而不是 {type(fn).__name__}"
    n = 0
    for args in cases:
        want = canon(reference(*args))
        got = returned(fn, args, f"{name}{args!r}")
        if not agrees(want, got, close):
            return False, f"{name}{args!r} 返回 (returned) {got!r}, kvlab 得到 (kvlab gets) {want!r}"
        n += 1
    return True, f"{name} 与 kvlab 在 {n} 个用例上一致 (agrees with kvlab on {n} cases)"


def metadata_pool(num_blocks: int, block_size: int, **kw: Any) -> BlockPool:
    """A CPU pool without KV storage (block bookkeeping only), for the checkers' scenarios."""
    return BlockPool(num_blocks, spec=KVSpec(block_size=block_size, device=torch.device("cpu")), with_storage=False,
                     **kw)
