"""Drawn problems (``kvlab.exercises.draw``) and the feedback rules of issue-34's "predict, then see": a seed names
one problem, its truth agrees with an independent computation read off the question, the answer stays hidden
until asked for, and no hint or per-item mark spells out an answer."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from collections import OrderedDict

import pytest

from kvlab import BlockStatus
from kvlab import exercises as ex
from kvlab.core.errors import ConfigError
from kvlab.exercises import ch2_2_1, ch2_2_2, ch2_2_3, ch2_2_4, ch2_2_5, ch2_2_6
from kvlab.exercises.framework import RIGHT, WRONG

SEEDS = range(12)


def _ints(text: str) -> list[int]:
    return [int(x.replace(",", "")) for x in re.findall(r"\d[\d,]*", text)]


def _lru_by_hand(question: str) -> list[int]:
    """An ordered dict of the blocks, least recently touched first, read from the question's numbers."""
    released = [int(x) for x in re.search(r"按 \[([\d, ]+)\] 的顺序 free", question)[1].split(",")]
    reused = [int(x) for x in re.search(r"依次对 \[([\d, ]+)\] 中", question)[1].split(",")]
    order: OrderedDict[int, None] = OrderedDict()
    for b in released + reused:
        order.pop(b, None)
        order[b] = None
    return list(order)


def independent(p: ex.Problem):
    q = p.question
    if p.key == "2.2.1-waste":
        tokens, block = re.search(r"一条 (\d+) token .*block_size=(\d+)", q).groups()
        return (-int(tokens)) % int(block)
    if p.key == "2.2.2-lru":
        return tuple(_lru_by_hand(q))
    if p.key == "2.2.3-sharing":
        users, prefix, own = _ints(q)[:3]
        return users, prefix + users * own
    if p.key == "2.2.4-moves":
        layout = re.search(r"布局 '([A.]+)'", q)[1]
        k = layout.count("A")
        return layout[k:].count("A")
    if p.key == "2.2.5-headroom":
        headroom = float(re.search(r"headroom=([\d.]+)", q)[1])
        reserved = math.ceil(48 * headroom)
        return reserved, 64 - reserved
    if p.key == "2.2.6-long":
        layers, heads, head_dim, dtype, block = re.search(
            r"(\d+) 层、(\d+) 个 KV 头、head_dim (\d+)、每个数 (\d+) 字节、block_size (\d+)", q).groups()
        tokens = int(re.search(r"一条 ([\d,]+) token", q)[1].replace(",", ""))
        blocks = -(-tokens // int(block))
        return blocks, blocks * int(block) * 2 * int(layers) * int(heads) * int(head_dim) * int(dtype)
    raise AssertionError(f"no independent computation for {p.key}")


@pytest.mark.parametrize("key", ex.list_scenarios())
def test_each_drawn_truth_agrees_with_an_independent_computation_read_off_the_question(key):
    problems = [ex.draw(key, s) for s in SEEDS]
    for p in problems:
        assert p.truth == ex.canon(independent(p)), (p.question, p.truth)
    assert len({p.question for p in problems}) >= 5, "the seeds draw different problems"


@pytest.mark.parametrize("key", ex.list_scenarios())
def test_a_seed_names_one_problem_and_the_answer_shows_only_when_asked(key):
    a, b = ex.draw(key, 7), ex.draw(key, 7)
    assert a == b and str(a) == str(b)
    assert "seed=7" in str(a) and "-s 7" in str(a)
    assert repr(a.truth) not in str(a).split("]", 1)[1] or len(repr(a.truth)) < 3
    assert repr(a.truth) in a.solution()
    fresh = ex.draw(key)
    assert fresh == ex.draw(key, fresh.seed)


def test_checking_a_drawn_problem_judges_records_and_hints_without_the_answer():
    p = ex.draw("2.2.3-sharing", 5)
    before = len(ex.attempts())
    assert not p.check(...) and len(ex.attempts()) == before  # Run All's placeholder is no answer
    wrong = [p.check((0, 0)) for _ in range(4)]
    assert [r.stage for r in wrong] == [1, 2, 3, 3]
    assert [r.hint for r in wrong[:3]] == [ex.hint("2.2.3-sharing", s) for s in (1, 2, 3)]
    assert all(str(p.truth[1]) not in r.hint for r in wrong)
    right = p.check(list(p.truth))
    assert right and right.hint == ""
    log = ex.attempts()[before:]
    assert [a.key for a in log] == ["2.2.3-sharing@5"] * 5 and [a.ok for a in log] == [False] * 4 + [True]


@pytest.mark.parametrize("key, seed", [("nope", 1), (3, 1), ("2.2.4-moves", -1), ("2.2.4-moves", 2**31),
                                       ("2.2.4-moves", 1.0), ("2.2.4-moves", True)])
def test_bad_keys_and_seeds_are_refused_by_name(key, seed):
    with pytest.raises(ConfigError, match="seed|drawn"):
        ex.draw(key, seed)


def test_the_command_line_draws_shows_the_answer_on_request_and_refuses_bad_input():
    run = [sys.executable, "-m", "kvlab", "exercise"]
    out = subprocess.run(run + ["2.2.4-moves", "-s", "3"], capture_output=True, text=True)
    assert out.returncode == 0 and "seed=3" in out.stdout and "答案" not in out.stdout
    shown = subprocess.run(run + ["2.2.4-moves", "-s", "3", "-c"], capture_output=True, text=True)
    assert shown.returncode == 0 and f"答案 (answer): {ex.draw('2.2.4-moves', 3).truth!r}" in shown.stdout
    listed = subprocess.run(run, capture_output=True, text=True)
    assert listed.returncode == 0 and listed.stdout.count("\n") == len(ex.list_scenarios())
    for bad in (["nope"], ["2.2.4-moves", "-s", "x"], ["2.2.4-moves", "-s", "-5"]):
        r = subprocess.run(run + bad, capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, bad


# ---------------------------------------------------------------------------------------------- feedback rules
# Each fixed exercise's answer, computed here from the chapters' scenario functions.
ANSWERS = {
    "2.2.1-errata-rule": ch2_2_1.text_rule_at(2047.0),
    "2.2.2-errata-capacity": ch2_2_2.text_block_story(),
    "2.2.2-errata-fragmentation": ch2_2_2.text_fragmentation_story(),
    "2.2.2-lru": ch2_2_2.lru_scenario(),
    "2.2.2-refcount": ch2_2_2.refcount_scenario(),
    "2.2.3-errata-handout": ch2_2_3.text_allocator_story(),
    "2.2.3-errata-retry": ch2_2_3.text_evict_story(),
    "2.2.3-move-users": (ch2_2_3.blocks_saved(5), ch2_2_3.blocks_saved(50)),
    "2.2.3-sharing": ch2_2_3.sharing_scenario(),
    "2.2.3-strategies": ch2_2_3.strategy_scenario(),
    "2.2.4-errata": ch2_2_4.reallocation_scenario(),
    "2.2.4-moves": ch2_2_4.compaction_moves("A..AA.A..A.A"),
    "2.2.5-headroom": ch2_2_5.reserve_scenario(0.5),
    "2.2.5-locks": ch2_2_5.lock_scenario(),
    "2.2.6-long": ch2_2_6.long_sequence_cost(),
}


def _atoms(value, vocabulary: str) -> list[str]:
    """The parts of an answer a hint must not state: numbers of two digits or more, words the question does not
    offer itself (its ``vocabulary``), and whole lists."""
    c = ex.canon(value)
    items = list(c) if isinstance(c, tuple) else [c]
    out = [str(v) for v in items if (isinstance(v, int) and abs(v) >= 10)
           or (isinstance(v, str) and len(v) > 2 and v not in vocabulary)]
    if isinstance(c, tuple) and len(c) > 2:
        out.append(", ".join(map(str, c)))
    return out


@pytest.mark.parametrize("key", sorted(ANSWERS))
def test_the_last_hint_guides_without_stating_the_answer(key):
    last = ex.hint(key, 3)
    for atom in _atoms(ANSWERS[key], ex.prompt(key)):
        assert atom not in last, (key, atom)


def test_a_two_way_item_is_neither_marked_nor_counted():
    ok, message, details = ex.same((1024, 0, "ok"), (1024, 0, "refused"), "story", ("a", "b", "second"),
                                   two_way=("second",))
    assert not ok and message.startswith("0/2 ")
    assert not [d for d in details if "second" in d and (d.startswith(RIGHT) or d.startswith(WRONG))]
    assert "'ok'" not in "".join(details)


def test_set_answers_are_not_marked_member_by_member():
    """Each sweep term rises or not, each pair is legal or not: naming the misjudged ones would give them away."""
    r = ex.exercise("2.2.1-interpret-sweep").check({"waste"})
    assert not r and not r.details and not re.search(r"table entries|alloc calls|prefix loss", r.message)
    t = ex.exercise("2.2.2-transitions").check({(BlockStatus.FREE, BlockStatus.EVICTING)})
    assert not t and "FREE" not in t.message and "EVICTING" not in t.message
