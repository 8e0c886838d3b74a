"""The exercise framework: staged hints, per-item feedback, predictions compared with measurements, scores."""
from __future__ import annotations

import copy

import pytest

from kvlab import ConfigError
from kvlab import exercises as ex
import kvlab.exercises.framework as fw
from kvlab.exercises.framework import EXERCISES, PREDICTIONS


@pytest.fixture(autouse=True)
def fresh_progress(monkeypatch):
    """A kernel's record as a fresh kernel has it (the tests' own, put back after)."""
    monkeypatch.setattr(fw, "_PROGRESS", fw._Progress())


def test_every_exercise_has_three_distinct_hint_stages_and_a_kind():
    for key in ex.list_exercises():
        e = ex.exercise(key)
        assert len(set(e.hints)) == 3 and e.kind in ex.KINDS, key
        assert [ex.hint(key, s) for s in (1, 2, 3)] == list(e.hints)


def test_hints_escalate_with_each_miss_and_stop_at_the_formula():
    hints = ex.exercise("2.2.2-lru").hints
    seen = [ex.check("2.2.2-lru", [0, 1, 2, 3]) for _ in range(4)]
    assert [r.stage for r in seen] == [1, 2, 3, 3]
    assert [r.hint for r in seen] == [hints[0], hints[1], hints[2], hints[2]]
    assert "1/3 (nudge)" in str(seen[0]) and "3/3 (formula)" in seen[3]._repr_markdown_()
    right = ex.check("2.2.2-lru", [2, 3, 1, 0])
    assert right.ok and right.stage == 0 and "提示" not in str(right)
    ex.reset("2.2.2")
    assert ex.check("2.2.2-lru", [0, 1, 2, 3]).stage == 1  # a reset starts the stages again


def test_tuple_answers_are_judged_item_by_item_without_giving_away_the_wrong_ones():
    r = ex.check("2.2.2-refcount", (0, "ALLOCATED"))
    assert not r.ok and "1/2" in r.message
    assert r.details[0].startswith("× reference_count") and "1" not in r.details[0].split(":")[1]
    assert r.details[1] == "✓ status = 'ALLOCATED'"
    r = ex.check("2.2.2-lru", [2, 3, 0, 1])
    assert [d[0] for d in r.details] == ["✓", "✓", "×", "×"]
    assert "4" in ex.check("2.2.2-lru", [2, 3]).message  # wrong length: says how many items are wanted
    assert ex.check("2.2.2-refcount", 1).details == ()


def test_a_prediction_is_compared_with_the_measurement_that_follows():
    key = ex.list_predictions("2.2.1")[0]
    p = PREDICTIONS[key]
    options = p.choices or (1.0,)
    assert "还没有" in ex.predict(key, ...)
    missed = ex.reveal(key, options[0])
    assert not missed.ok and "no prediction" in missed.message
    assert "revealed" in ex.predict(key, options[0])  # the measurement is on the screen: too late
    assert key not in fw._PROGRESS.predicted
    ex.reset("2.2.1")
    ex.predict(key, options[0])
    assert ex.reveal(key, options[0]).ok
    if p.choices and len(p.choices) > 1:
        r = ex.reveal(key, p.choices[1])
        assert not r.ok and repr(p.choices[0]) in r.message and repr(p.choices[1]) in r.message


def test_bad_predictions_are_refused_and_leave_the_record_as_it_was():
    key = next(k for k in ex.list_predictions() if PREDICTIONS[k].choices)
    first = PREDICTIONS[key].choices[0]
    ex.predict(key, first)
    with pytest.raises(ConfigError, match="not one of the choices"):
        ex.predict(key, "certainly not a choice")
    with pytest.raises(ConfigError, match="object"):
        ex.predict(key, object())
    with pytest.raises(ConfigError, match="unknown prediction 'nope'"):
        ex.predict("nope", 1)
    assert ex.reveal(key, first).ok  # the refused calls changed nothing
    numeric = next(k for k in ex.list_predictions() if not PREDICTIONS[k].choices)
    with pytest.raises(ConfigError, match="expected a finite number"):
        ex.predict(numeric, "lots")


@pytest.mark.parametrize("value", [10**5000, -(10**19), 10.0**19, float("nan"), float("inf"), -float("inf"),
                                   "x" * 10**5, [1], object()],
                         ids=["5000 digits", "-1e19 int", "1e19", "nan", "inf", "-inf", "long str", "list", "object"])
@pytest.mark.parametrize("which", ["numeric", "choice"])
def test_a_refused_prediction_records_nothing_and_the_record_still_shows(value, which):
    """Checked before it is recorded: a 5,000-digit int (which has no repr) or a NaN used to be recorded, then
    every summary and reveal failed until a reset. The refusal is one short line naming the key."""
    key = next(k for k in ex.list_predictions() if bool(PREDICTIONS[k].choices) == (which == "choice"))
    good = PREDICTIONS[key].choices[0] if which == "choice" else 20
    ex.predict(key, good)
    before = copy.deepcopy(fw._PROGRESS)
    with pytest.raises(ConfigError) as got:
        ex.predict(key, value)
    assert key in str(got.value) and len(str(got.value)) < 400
    assert fw._PROGRESS == before
    assert ex.reveal(key, good).ok and ex.summary(PREDICTIONS[key].chapter).matched >= 1


@pytest.mark.parametrize("key", [["2.2.2-lru"], None, 3, b"2.2.2-lru", ("a",)])
def test_a_key_that_is_no_str_is_an_unknown_key(key):
    before = copy.deepcopy(fw._PROGRESS)
    for call in (lambda: ex.predict(key, 1), lambda: ex.check(key, 1), lambda: ex.reveal(key, 1)):
        with pytest.raises(ConfigError, match="unknown (prediction|exercise)"):
            call()
    assert fw._PROGRESS == before


def test_a_numeric_prediction_matches_within_its_tolerance():
    key = "2.2.1-azure-ratio"  # within 30%
    ex.predict(key, 20)
    assert ex.reveal(key, 23.1).ok and not ex.reveal(key, 30.0).ok
    ex.reset("2.2.1")
    ex.predict(key, 5)
    assert not ex.reveal(key, 23.1).ok


def test_a_revealed_prediction_is_locked_and_a_reset_keeps_what_it_cleared():
    """Predict, then see: once the measurement is shown, neither a new value nor ``...`` changes the prediction
    (a cell run again says so); a reveal with no prediction locks it too. ``reset`` unlocks the chapter and
    keeps its score in ``history``; every judgement stays in ``attempts``."""
    key = "2.2.1-waste-trend"
    ex.predict(key, "上升 (rises)")
    assert ex.reveal(key, "上升 (rises)").ok
    for later in ("下降 (falls)", ...):
        assert "the prediction stays '上升 (rises)'" in ex.predict(key, later)
    s = ex.summary("2.2.1")
    assert (s.predicted, s.matched) == (1, 1)
    other = "2.2.1-azure-ratio"
    assert not ex.reveal(other, 20.0).ok  # no prediction: the answer is out now
    assert "stays 没有预测 (none)" in ex.predict(other, 20.0) and ex.summary("2.2.1").matched == 1
    ex.check("2.2.1-utilisation", 0.5)
    ex.reset("2.2.1")
    (kept,) = ex.history("2.2.1")
    assert (kept.predicted, kept.matched, kept.attempted) == (1, 1, 1) and ex.history("2.2.2") == []
    assert ex.summary("2.2.1").predicted == 0 and "recorded" in ex.predict(key, "下降 (falls)")
    assert [(a.key, a.ok) for a in ex.attempts("2.2.1")] == [(key, True), (other, False),
                                                             ("2.2.1-utilisation", False)]
    assert ex.attempts("2.2.1")[0].given == "'上升 (rises)'" and ex.attempts("2.2.1")[2].stage == 1
    ex.reset("2.2.1")
    assert len(ex.history("2.2.1")) == 2  # the second reset cleared a prediction too
    ex.reset("2.2.1")
    assert len(ex.history("2.2.1")) == 2  # nothing to keep: an empty score is not history


def test_the_placeholder_left_by_run_all_is_no_answer_and_no_miss():
    """A chapter's answer cell says ``answer = ...`` until the student writes one; Run All checks it. That is
    not a wrong answer: no miss, no attempt, no hint stage used up."""
    key = "2.2.2-lru"
    r = ex.check(key, ...)
    assert not r.ok and "no answer yet" in r.message and not r.hint
    s = ex.summary("2.2.2")
    assert s.attempted == 0 and dict(s.rows)[key] == "—" and ex.attempts("2.2.2") == []
    assert ex.check(key, [0, 1, 2, 3]).stage == 1  # the first real miss gets the first hint


def test_summary_counts_right_answers_and_matched_predictions():
    s = ex.summary("2.2.2")
    assert (s.right, s.attempted, s.predicted, s.matched) == (0, 0, 0, 0) and s.exercises >= 3
    ex.check("2.2.2-lru", [0, 1, 2, 3])
    ex.check("2.2.2-refcount", (1, "ALLOCATED"))
    keys = ex.list_predictions("2.2.2")
    for k in keys:
        p = PREDICTIONS[k]
        ex.predict(k, p.choices[0] if p.choices else 0)
    s = ex.summary("2.2.2")
    assert (s.right, s.attempted, s.predicted) == (1, 2, len(keys))
    rows = dict(s.rows)
    assert rows["2.2.2-refcount"] == "✓ 第一次就对 (first try)" and rows["2.2.2-lru"].startswith("×")
    assert rows["2.2.2-transitions"] == "—"
    ex.check("2.2.2-lru", [2, 3, 1, 0])
    assert dict(ex.summary("2.2.2").rows)["2.2.2-lru"] == "✓ (1 次未中后 after 1 misses)"
    assert "1/" in str(s) and "| `2.2.2-lru` |" in s._repr_markdown_()
    with pytest.raises(ConfigError, match="2.2.1"):
        ex.summary("9.9")


def test_registration_refuses_duplicates_and_incomplete_hints():
    with pytest.raises(ConfigError, match="defined twice"):
        ex.register("2.2.2-lru", "again", ("a", "b", "c"))(lambda a: (True, ""))
    with pytest.raises(ConfigError, match="3 hints"):
        ex.register("2.2.9-new", "x", ("only one",))(lambda a: (True, ""))
    with pytest.raises(ConfigError, match="kind"):
        ex.register("2.2.9-new", "x", ("a", "b", "c"), kind="essay")(lambda a: (True, ""))
    with pytest.raises(ConfigError, match="rel_tol"):
        ex.register_prediction("2.2.9-p", "x", rel_tol=-1)
    assert "2.2.9-new" not in EXERCISES and "2.2.9-p" not in PREDICTIONS
    with pytest.raises(ConfigError):
        ex.hint("2.2.2-lru", 4)


EVIL = ['<img src=x onerror="alert(1)">', "[click](javascript:alert(1))", "a | b", "<script>x</script>",
        "**bold** `code` _i_"]


@pytest.mark.parametrize("answer", EVIL + [EVIL[:2], tuple(EVIL[2:4])])
def test_an_answer_shows_as_text_never_as_markup(answer):
    """A message may quote the student's answer; rendered as Markdown (as Jupyter and the exported site render
    it) it stays text: no tag, no link, no table cell break, in any exercise's result or the summary."""
    import mistune

    for key in ex.list_exercises():
        md = ex.check(key, answer)._repr_markdown_()
        html = mistune.html(md)
        assert "<img" not in html and "<script" not in html and "href" not in html, (key, html)
    for chapter in sorted({e.chapter for e in EXERCISES.values()}):
        html = mistune.html(ex.summary(chapter)._repr_markdown_())
        assert "<img" not in html and "<script" not in html and "href" not in html
        assert html.count("<tr>") == 1 + len(ex.list_exercises(chapter)) + len(ex.list_predictions(chapter))
