"""Exercises for the chapters, "predict, then check" (text §2.2.1–§2.2.6 and the extensions 2.2.7, 2.2.8), and the
chapters' fast mode.

Two kinds of record a student makes:

* a **prediction** (:func:`predict`) before a chapter runs a measurement, a value or one of a few choices; the
  chapter then calls :func:`reveal` with what kvlab measured and the two are compared;
* an **answer** to an exercise (:func:`check`): a number, a list, a set, or a small function. The truth is never
  typed in: every checker computes it by running kvlab on a fresh pool, so an exercise stays right when the
  library changes. Function answers are compared with the reference on many seeded cases, chosen so that the
  usual wrong functions fail, and the first disagreeing input is shown.

A wrong answer gets a hint in stages: the first miss a nudge, the second the method, the third and later the
formula. A tuple or list answer is judged item by item, so the student sees which part is wrong.
:func:`draw` gives a chapter's exercise again with fresh numbers from a seed (``kvlab exercise KEY -s SEED``;
the answer on request, ``-c``). :func:`summary` reports a chapter's score (answers right, predictions made and
matched). A prediction is locked once its measurement is revealed; :func:`reset` starts a chapter over and keeps
the score it cleared (:func:`history`); every judgement is kept (:func:`attempts`). ``...``, the chapters'
placeholder, is no answer: Run All leaves it and nothing is counted.

An answer is compared by its value in plain Python form, never through its own ``==``: a tuple answers a list
question and the other way round, numpy scalars and arrays count as their values, a BlockStatus member as its
name. A value of any other kind is a wrong answer that says so (see :func:`canon`).

Each chapter's exercises live in their own module (``kvlab.exercises.ch2_2_1`` ... ``ch2_2_8``; 2.2.7's in
``kvlab.distributed.exercises``) and register through :func:`register` and :func:`register_prediction`
(:mod:`kvlab.exercises.framework`).

:func:`fast_mode` reads ``KVLAB_FAST`` (``1``/``true``/``yes``): the chapters shrink their sizes with
:func:`sized` so that CI executes every notebook in seconds.
"""
from __future__ import annotations

from kvlab.exercises.framework import (HINT_STAGES, KINDS, Attempt, Canon, Exercise, Prediction, Result, Summary,
                                       Unreadable, Verdict, agrees, attempts, canon, check, compare_fn, exercise,
                                       fast_mode, hint, history, list_exercises, list_predictions, metadata_pool,
                                       predict, prompt, record, register, register_prediction, reset, returned,
                                       reveal, same, sized, summary, text)
# The chapters' modules register their exercises on import.
from kvlab.exercises import ch2_2_1, ch2_2_2, ch2_2_3, ch2_2_4, ch2_2_5, ch2_2_6, ch2_2_8  # noqa: F401
from kvlab.exercises.scenarios import Problem, draw, list_scenarios

__all__ = [
    "Canon", "Exercise", "Prediction", "Result", "Summary", "Unreadable", "Verdict", "KINDS", "HINT_STAGES",
    "fast_mode", "sized", "register", "register_prediction", "exercise", "list_exercises", "list_predictions",
    "check", "prompt", "hint", "predict", "reveal", "summary", "reset", "Attempt", "attempts", "history", "canon",
    "record", "Problem", "draw", "list_scenarios",
    "same", "compare_fn", "returned",
    "agrees", "text", "metadata_pool",
]
