"""kvlab.exercises compares canonical values: every spelling of the right answer passes, and no object that
lies about equality (``__eq__``, ``__ne__``, ``__iter__``, ``__index__``, ``__class__``) passes a wrong one."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvlab import BlockStatus
from kvlab import exercises as ex

S = BlockStatus


class AlwaysEqual:
    """Equal to everything, unequal to nothing, orders both ways."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    def __lt__(self, other):
        return True

    __le__ = __gt__ = __ge__ = __lt__

    def __hash__(self):
        return 0


class EqInt(int):
    """An int whose comparisons all say yes and whose __index__/__int__ lie."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    def __index__(self):
        return 3

    __int__ = __index__

    def __hash__(self):
        return 0


class NeverEqInt(int):
    """An int that denies being equal to anything: its value still counts."""

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    def __hash__(self):
        return 0


class EqFloat(float):
    def __eq__(self, other):
        return True

    def __float__(self):
        return 0.5


class LyingList(list):
    """Stores one thing, iterates as another, and is equal to everything."""

    def __init__(self, stored, shown):
        super().__init__(stored)
        self.shown = shown

    def __iter__(self):
        return iter(self.shown)

    def __len__(self):
        return len(self.shown)

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = None


class LyingSet(set):
    def __init__(self, stored, shown):
        super().__init__(stored)
        self.shown = shown

    def __iter__(self):
        return iter(self.shown)

    def __eq__(self, other):
        return True


class FakeInt:
    """Claims to be an int through ``__class__``, with an ``__index__`` of its choice."""

    def __init__(self, value):
        self.value = value

    @property
    def __class__(self):
        return int

    def __index__(self):
        return self.value

    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0


class Pairs:
    """Iterates the right pairs, but is no list, tuple or set."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def __iter__(self):
        return iter(self.pairs)


def _frag(free, top):
    k = 1 << top
    whole = free[:len(free) // k * k].reshape(-1, k).all(axis=1).sum() * k
    return 0 if not free.sum() else round(100 * (1 - whole / free.sum()))


def _frag_np(free, top):
    """The same in numpy: an np.float64 from np.round, or an np.int64 0."""
    total = free.sum()
    if not total:
        return np.int64(0)
    k = 1 << top
    usable = free[:len(free) // k * k].reshape(-1, k).all(axis=1).sum() * k
    return np.round(100 * (1 - usable / total))


def _util(ls, bs):
    return sum(ls) / sum(math.ceil(n / bs) * bs for n in ls)


TRANSITIONS = [(S.FREE, S.PENDING), (S.FREE, S.ALLOCATED), (S.PENDING, S.ALLOCATED), (S.PENDING, S.FREE),
               (S.ALLOCATED, S.EVICTING), (S.ALLOCATED, S.FREE), (S.EVICTING, S.FREE)]
NAMES = [(o.name, n.name) for o, n in TRANSITIONS]
INTS = [(int(o), int(n)) for o, n in TRANSITIONS]
LONG = (6250, 6250 * 16 * 2 * 32 * 8 * 128 * 2)

# Every spelling of the right answer, per exercise.
FORMS = {
    "2.2.1-waste": {
        "int": lambda t, bs: -t % bs,
        "numpy int64": lambda t, bs: np.int64(-t % bs),
        "numpy uint16": lambda t, bs: np.uint16(-t % bs),
        "float": lambda t, bs: float(-t % bs),
        "numpy float64": lambda t, bs: np.float64(-t % bs),
        "0-d array": lambda t, bs: np.array(-t % bs),
        "int subclass that denies equality": lambda t, bs: NeverEqInt(-t % bs),
    },
    "2.2.1-utilisation": {
        "float": _util,
        "numpy float64": lambda ls, bs: np.float64(_util(ls, bs)),
        "numpy longdouble": lambda ls, bs: np.longdouble(_util(ls, bs)),
        "0-d array": lambda ls, bs: np.array(_util(ls, bs)),
        "numpy arithmetic": lambda ls, bs: np.sum(ls) / np.sum(-(-np.array(ls) // bs) * bs),
    },
    "2.2.2-transitions": {
        "set of members": set(TRANSITIONS),
        "frozenset": frozenset(TRANSITIONS),
        "list of tuples": list(TRANSITIONS),
        "tuple of lists": tuple(list(p) for p in TRANSITIONS),
        "names": set(NAMES),
        "numpy str names": {(np.str_(o), np.str_(n)) for o, n in NAMES},
        "ints": set(INTS),
        "numpy ints": {(np.int8(o), np.int64(n)) for o, n in INTS},
        "int array": np.array(INTS),
        "name array": np.array(NAMES),
        "mixed": [(S.FREE, "PENDING"), (0, S.ALLOCATED), *TRANSITIONS[2:], TRANSITIONS[0]],
    },
    "2.2.2-lru": {
        "list": [2, 3, 1, 0],
        "tuple": (2, 3, 1, 0),
        "int64 array": np.array([2, 3, 1, 0]),
        "int8 array": np.array([2, 3, 1, 0], dtype=np.int8),
        "numpy scalars": [np.int64(2), np.int32(3), np.uint8(1), np.int16(0)],
        "floats": [2.0, 3.0, 1.0, 0.0],
        "int subclass that denies equality": [NeverEqInt(2), NeverEqInt(3), NeverEqInt(1), NeverEqInt(0)],
    },
    "2.2.2-refcount": {
        "tuple": (1, "ALLOCATED"),
        "list": [1, "ALLOCATED"],
        "member": (1, S.ALLOCATED),
        "numpy": (np.int64(1), np.str_("ALLOCATED")),
        "object array": np.array([1, "ALLOCATED"], dtype=object),
    },
    "2.2.3-sharing": {
        "tuple": (5, 13),
        "list": [5, 13],
        "array": np.array([5, 13]),
        "numpy scalars": (np.int32(5), np.int64(13)),
        "floats": (5.0, np.float64(13)),
    },
    "2.2.3-strategies": {
        "list": ["split", "exact", "split", "exact"],
        "tuple": ("split", "exact", "split", "exact"),
        "str array": np.array(["split", "exact", "split", "exact"]),
        "numpy str": [np.str_("split"), "exact", np.str_("split"), "exact"],
    },
    "2.2.1-errata-rule": {"tuple": (512, 1024), "floats": (512.0, 1024.0), "array": np.array([512, 1024])},
    "2.2.1-move-block": {"int": 31, "numpy int64": np.int64(31), "float": 31.0, "0-d array": np.array(31)},
    "2.2.1-interpret-sweep": {"set": {"waste", "prefix loss", "attention slots"},
                              "frozenset": frozenset({"waste", "prefix loss", "attention slots"}),
                              "list": ["attention slots", "prefix loss", "waste"],
                              "str array": np.array(["waste", "prefix loss", "attention slots"])},
    "2.2.2-errata-capacity": {"tuple": (1024, 0, "refused"), "list": [1024, 0, "refused"],
                              "numpy": (np.int64(1024), np.int8(0), np.str_("refused"))},
    "2.2.2-errata-fragmentation": {"tuple": (75, 0), "array": np.array([75, 0]), "floats": (75.0, 0.0)},
    "2.2.2-move-cache": {"int": 9, "numpy int64": np.int64(9), "float": 9.0},
    "2.2.2-interpret-gap": {"int": 8, "numpy uint8": np.uint8(8), "0-d array": np.array(8)},
    "2.2.3-errata-handout": {"list": [0, 0, 0], "tuple": (0, 0, 0), "array": np.zeros(3, dtype=np.int64)},
    "2.2.3-errata-retry": {"tuple": (2, 0, "None"), "list": [2, 0, "None"]},
    "2.2.3-move-users": {"tuple": (12, 147), "array": np.array([12, 147]), "floats": (12.0, 147.0)},
    "2.2.4-fragmentation": {
        "int": _frag,
        "numpy round": lambda free, top: _frag_np(free, top),
        "numpy int": lambda free, top: np.int64(_frag(free, top)),
        "float": lambda free, top: float(_frag(free, top)),
    },
    "2.2.4-moves": {
        "int": 3,
        "numpy int64": np.int64(3),
        "numpy uint8": np.uint8(3),
        "float": 3.0,
        "numpy float32": np.float32(3),
        "0-d array": np.array(3),
        "int subclass that denies equality": NeverEqInt(3),
    },
    "2.2.5-locks": {
        "tuple": (200, 2),
        "list": [200, 2],
        "array": np.array([200, 2], dtype=np.int32),
        "numpy scalars": (np.int64(200), np.uint8(2)),
    },
    "2.2.6-long": {
        "tuple": LONG,
        "list": list(LONG),
        "array": np.array(LONG),
        "numpy scalars": (np.int32(LONG[0]), np.int64(LONG[1])),
        "float": (float(LONG[0]), float(LONG[1])),
    },
}

# A plainly wrong answer, per exercise, in a numpy spelling (the plain ones are in test_exercises.py).
WRONG = {
    "2.2.1-waste": lambda t, bs: np.int64(bs - t % bs),
    "2.2.1-utilisation": lambda ls, bs: np.float64(sum(ls) / (len(ls) * bs)),
    "2.2.2-transitions": np.array(INTS[:-1]),
    "2.2.2-lru": np.array([2, 0, 3, 1]),
    "2.2.2-refcount": (np.int64(0), S.FREE),
    "2.2.3-sharing": np.array([5, 25]),
    "2.2.3-strategies": np.array(["split"] * 4),
    "2.2.1-errata-rule": np.array([2048, 1024]),
    "2.2.1-move-block": np.int64(15),
    "2.2.1-interpret-sweep": np.array(["waste"]),
    "2.2.2-errata-capacity": (np.int64(4096), 4096, np.str_("ok")),
    "2.2.2-errata-fragmentation": np.array([0, 0]),
    "2.2.2-move-cache": np.float64(0),
    "2.2.2-interpret-gap": np.int64(128),
    "2.2.3-errata-handout": np.arange(3),
    "2.2.3-errata-retry": (np.int64(2), 2, "found"),
    "2.2.3-move-users": np.array([12, 12]),
    "2.2.4-fragmentation": lambda free, top: np.int64(0),
    "2.2.4-moves": np.int64(6),
    "2.2.5-locks": np.array([2, 2]),
    "2.2.6-long": np.array([LONG[0], 2 * LONG[1]]),
}

FUNCTIONS = {"2.2.1-waste", "2.2.1-utilisation", "2.2.4-fragmentation"}


def _as_answer(key, value):
    """``value`` as the exercise takes it: returned by a function for the function exercises."""
    return (lambda *args: value) if key in FUNCTIONS else value


def _shape_of(key):
    """How many items the answer holds (None: a single value), to build lying answers of the right shape."""
    return {"2.2.1-errata-rule": 2, "2.2.2-errata-capacity": 3, "2.2.2-errata-fragmentation": 2,
            "2.2.3-errata-handout": 3, "2.2.3-errata-retry": 3, "2.2.3-move-users": 2,
            "2.2.1-interpret-sweep": 3, "2.2.2-lru": 4, "2.2.2-refcount": 2, "2.2.3-sharing": 2, "2.2.3-strategies": 4,
            "2.2.5-locks": 2, "2.2.6-long": 2, "2.2.2-transitions": 7}.get(key)


def _liars(key):
    """Objects that would pass a checker that trusts ``==``, ``__iter__``, ``__index__`` or ``__class__``."""
    n = _shape_of(key)
    out = {"always-equal": AlwaysEqual(), "int subclass, always equal": EqInt(12345),
           "float subclass, always equal": EqFloat(12345.0), "__class__ says int": FakeInt(3),
           "object array of always-equal": np.array([AlwaysEqual()] * (n or 1), dtype=object)}
    if n:
        out["list of always-equal"] = [AlwaysEqual()] * n
        out["tuple of always-equal ints"] = tuple(EqInt(12345) for _ in range(n))
    right = FORMS[key].get("list") or FORMS[key].get("tuple") or FORMS[key].get("list of tuples")
    if n and right is not None:
        out["list storing junk, iterating the truth"] = LyingList([12345] * n, list(right))
    return {name: _as_answer(key, v) for name, v in out.items()}


def test_every_exercise_has_forms_and_a_wrong_answer():
    early = {k for c in ("2.2.1", "2.2.2", "2.2.3") for k in ex.list_exercises(c)}
    assert early <= set(FORMS) and set(FORMS) == set(WRONG) and set(FORMS) <= set(ex.list_exercises())


@pytest.mark.parametrize("key, form", [(k, f) for k in sorted(FORMS) for f in FORMS[k]])
def test_every_canonical_form_of_the_right_answer_passes(key, form):
    r = ex.check(key, FORMS[key][form])
    assert r.ok is True, str(r)


@pytest.mark.parametrize("key, liar", [(k, name) for k in sorted(FORMS) for name in _liars(k)])
def test_an_object_that_lies_about_equality_fails(key, liar):
    r = ex.check(key, _liars(key)[liar])
    assert r.ok is False and not r, str(r)
    assert r.message and "提示" in str(r)


@pytest.mark.parametrize("key", sorted(WRONG))
def test_a_wrong_answer_in_numpy_form_fails(key):
    r = ex.check(key, WRONG[key])
    assert r.ok is False, str(r)


def test_transitions_refuse_lying_containers_and_bare_iterables():
    right = set(TRANSITIONS)
    assert not ex.check("2.2.2-transitions", LyingSet(set(), right)).ok  # stores nothing, iterates the truth
    assert not ex.check("2.2.2-transitions", Pairs(right)).ok  # not a list, tuple, set or array
    assert not ex.check("2.2.2-transitions", {(AlwaysEqual(), AlwaysEqual())}).ok
    r = ex.check("2.2.2-transitions", set(NAMES) | {("FREE", "CACHED")})
    assert not r.ok and "CACHED" in r.message
    r = ex.check("2.2.2-transitions", {(o, n, 0) for o, n in TRANSITIONS})
    assert not r.ok and "(old, new)" in r.message


def test_refused_values_are_named_not_raised():
    for value in (1 + 0j, {"refcount": 1}, b"ALLOCATED", None, object(), range(3)):
        r = ex.check("2.2.2-refcount", value)
        assert r.ok is False and type(value).__name__ in r.message, r.message
    r = ex.check("2.2.4-moves", True)  # True == 1, but a bool is no count
    assert not r.ok and "bool" in r.message
    loop: list = []
    loop.append(loop)
    assert not ex.check("2.2.2-lru", loop).ok  # a list that contains itself: refused, no RecursionError


def test_a_function_answer_returning_a_liar_names_the_case():
    r = ex.check("2.2.1-waste", lambda t, bs: AlwaysEqual())
    assert not r.ok and "waste(1, 1)" in r.message and "AlwaysEqual" in r.message
    r = ex.check("2.2.4-fragmentation", lambda free, top: [AlwaysEqual()])
    assert not r.ok and "fragmentation(free=" in r.message


def test_a_function_answer_gets_copies_of_the_case():
    def waste(tokens, block_size):
        return -tokens % block_size

    def greedy(lengths, block_size):
        out = sum(lengths) / sum(-(-n // block_size) * block_size for n in lengths)
        lengths.clear()  # vandalises its argument: the reference must not see that
        return out

    assert ex.check("2.2.1-waste", waste).ok
    assert ex.check("2.2.1-utilisation", greedy).ok


def test_a_kvlab_error_from_the_students_function_is_a_wrong_answer():
    from kvlab import ConfigError

    def boom(tokens, block_size):
        raise ConfigError("student's own mistake")

    r = ex.check("2.2.1-waste", boom)
    assert not r.ok and "ConfigError" in r.message and "waste(1, 1)" in r.message
