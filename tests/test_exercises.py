"""kvlab.exercises: right answers pass, wrong ones fail with a hint, and the truth matches hand-derived answers."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvlab import BlockStatus, ConfigError, KVSpec
from kvlab import exercises as ex
from kvlab.exercises import ch2_2_4, ch2_2_6

S = BlockStatus


def _frag(free: np.ndarray, top: int) -> int:
    """An independent reading of the exercise text."""
    k = 1 << top
    whole = free[:len(free) // k * k].reshape(-1, k).all(axis=1).sum() * k
    return 0 if not free.sum() else round(100 * (1 - whole / free.sum()))


RIGHT = {
    "2.2.1-waste": lambda t, bs: -t % bs,
    "2.2.1-utilisation": lambda ls, bs: sum(ls) / sum(math.ceil(n / bs) * bs for n in ls),
    "2.2.2-transitions": {(S.FREE, S.PENDING), (S.FREE, S.ALLOCATED), (S.PENDING, S.ALLOCATED),
                          (S.PENDING, S.FREE), (S.ALLOCATED, S.EVICTING), (S.ALLOCATED, S.FREE),
                          (S.EVICTING, S.FREE)},
    "2.2.2-lru": [2, 3, 1, 0],  # released 2,0,3,1 then 0 touched again
    "2.2.2-refcount": (1, "ALLOCATED"),  # 1 + 2 - 1 - 1
    "2.2.3-sharing": (5, 3 + 5 * 2),
    "2.2.3-strategies": ["split", "exact", "split", "exact"],
    "2.2.1-errata-rule": (512, 1024),  # p95 2047: memory_efficient 512 (2047 // 4 = 511, floored), balanced 1024
    "2.2.1-move-block": 31,  # chat, 500 requests: waste at 256 minus waste at 16, in points
    "2.2.1-interpret-sweep": {"waste", "prefix loss", "attention slots"},
    "2.2.2-errata-capacity": (1024, 0, "refused"),
    "2.2.2-errata-fragmentation": (75, 0),
    "2.2.2-move-cache": 9,  # LRU 32 -> 64 blocks, 5000 Zipf requests
    "2.2.2-interpret-gap": 8,  # OPT - LRU shrinks as the cache grows
    "2.2.3-errata-handout": [0, 0, 0],
    "2.2.3-errata-retry": (2, 0, "None"),
    "2.2.3-move-users": (12, 147),  # (users - 1) x 3 prefix blocks
    "2.2.4-fragmentation": _frag,
    "2.2.4-moves": 3,  # 6 allocated; positions 6.. hold A at 6, 9, 11
    "2.2.5-locks": (200, 2),
    "2.2.6-long": (6250, 6250 * 16 * 2 * 32 * 8 * 128 * 2),
}

WRONG = {
    "2.2.1-waste": lambda t, bs: bs - t % bs,  # forgets the exactly-full last block
    "2.2.1-utilisation": lambda ls, bs: sum(ls) / (len(ls) * bs),
    "2.2.2-transitions": RIGHT["2.2.2-transitions"] | {(S.EVICTING, S.ALLOCATED)},
    "2.2.2-lru": [2, 0, 3, 1],
    "2.2.2-refcount": (0, "FREE"),
    "2.2.3-sharing": (5, 5 * 5),
    "2.2.3-strategies": ["split", "split", "split", "split"],
    "2.2.1-errata-rule": (2048, 1024),  # the text's memory_efficient read as "larger is better"
    "2.2.1-move-block": 15,
    "2.2.1-interpret-sweep": {"waste", "table entries"},
    "2.2.2-errata-capacity": (4096, 4096, "ok"),  # capacity as a fixed property: what it should be
    "2.2.2-errata-fragmentation": (0, 0),  # the text's formula is not 0 on four equal free blocks
    "2.2.2-move-cache": 0,
    "2.2.2-interpret-gap": 128,
    "2.2.3-errata-handout": [0, 1, 2],  # what a correct allocator would hand out
    "2.2.3-errata-retry": (2, 2, "found"),
    "2.2.3-move-users": (12, 12),  # thinks the saving does not grow with users
    "2.2.4-fragmentation": lambda free, top: 0,
    "2.2.4-moves": 6,
    "2.2.5-locks": (2, 2),
    "2.2.6-long": (6250, 6250 * 16 * 2 * 32 * 8 * 128 * 4),
}


EARLY = ("2.2.1", "2.2.2", "2.2.3")  # the chapters this file covers whole; later ones add their own cases


def test_every_early_exercise_is_covered():
    early = {k for c in EARLY for k in ex.list_exercises(c)}
    assert early <= set(RIGHT) and early <= set(WRONG)
    assert set(RIGHT) == set(WRONG) and set(RIGHT) <= set(ex.list_exercises())
    assert {"2.2.4-fragmentation", "2.2.4-moves"} <= set(ex.list_exercises("2.2.4"))


def test_every_early_chapter_has_errata_interpretation_or_parameter_exercises_and_predictions():
    for chapter in EARLY:
        beyond = [k for kind in ("errata", "interpret", "parameter") for k in ex.list_exercises(chapter, kind)]
        assert len(beyond) >= 2 and ex.list_exercises(chapter, "errata"), chapter
        assert len(ex.list_predictions(chapter)) >= 2, chapter


@pytest.mark.parametrize("key", sorted(RIGHT))
def test_right_answer_passes(key):
    r = ex.check(key, RIGHT[key])
    assert r.ok and bool(r), str(r)
    assert "✓" in str(r) and key in r._repr_markdown_()


@pytest.mark.parametrize("key", sorted(WRONG))
def test_wrong_answer_fails_with_hint(key):
    r = ex.check(key, WRONG[key])
    assert not r.ok and not bool(r)
    assert r.hint and "提示" in str(r)


def test_function_answers_report_the_failing_case():
    r = ex.check("2.2.1-waste", WRONG["2.2.1-waste"])
    assert "waste(1, 1)" in r.message
    r = ex.check("2.2.4-fragmentation", WRONG["2.2.4-fragmentation"])
    assert "calculate_fragmentation" in r.message


def test_a_crashing_answer_is_wrong_not_an_error():
    r = ex.check("2.2.1-waste", lambda t, bs: 1 // 0)
    assert not r.ok and "ZeroDivisionError" in r.message
    assert not ex.check("2.2.1-waste", 42).ok  # not a function
    assert not ex.check("2.2.2-transitions", 7).ok  # not a set of pairs


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(ConfigError, match="2.2.2-lru"):
        ex.check("2.2.9-nope", 1)
    assert "pool.evict()" in ex.prompt("2.2.2-lru")


def test_long_sequence_truth_matches_the_spec():
    spec = KVSpec(**ch2_2_6.LONG_SPEC, dtype=__import__("torch").float16, device="cpu")
    blocks, nbytes = ch2_2_6.long_sequence_cost()
    assert blocks == math.ceil(100_000 / spec.block_size) and nbytes == blocks * spec.bytes_per_block


def test_fragmentation_cases_exercise_both_extremes():
    values = {ch2_2_4.fragmentation_case(s)[2] for s in range(40)}
    assert 0 in values and max(values) > 0  # the checker would not catch a constant answer otherwise


@pytest.mark.parametrize("value, fast", [("1", True), ("true", True), ("YES", True), ("0", False), ("", False)])
def test_fast_mode(monkeypatch, value, fast):
    monkeypatch.setenv("KVLAB_FAST", value)
    assert ex.fast_mode() is fast
    assert ex.sized(1000, 10) == (10 if fast else 1000)


# Plausible wrong functions a student writes; each must meet a case that exposes it.
DISCRIMINATING = {
    "2.2.1-waste": [lambda t, bs: bs - t % bs,  # a full last block counted as empty
                    lambda t, bs: t % bs,  # used slots, not empty ones
                    lambda t, bs: (t // bs + 1) * bs - t,  # one block too many when t is a multiple
                    lambda t, bs: max(bs - t, 0)],  # only right for one-block sequences
    "2.2.1-utilisation": [lambda ls, bs: sum(ls) / (math.ceil(sum(ls) / bs) * bs),  # sequences glued together
                          lambda ls, bs: sum(ls) / sum((n // bs + 1) * bs for n in ls),  # floor + 1, not ceil
                          lambda ls, bs: sum(ls) / (len(ls) * bs),  # one block per sequence
                          lambda ls, bs: sum(n / (math.ceil(n / bs) * bs) for n in ls) / len(ls)],  # mean of ratios
}


@pytest.mark.parametrize("key, i", [(k, i) for k, fns in DISCRIMINATING.items() for i in range(len(fns))])
def test_plausible_wrong_functions_fail(key, i):
    r = ex.check(key, DISCRIMINATING[key][i])
    assert not r.ok and "kvlab" in r.message, str(r)


def test_the_utilisation_checker_refuses_an_answer_off_by_one_part_in_ten_thousand():
    def right(lengths, bs):
        return sum(lengths) / sum(math.ceil(n / bs) * bs for n in lengths)
    assert ex.check("2.2.1-utilisation", right).ok
    assert not ex.check("2.2.1-utilisation", lambda lengths, bs: right(lengths, bs) * (1 + 1e-4)).ok
