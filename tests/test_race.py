"""Racing eviction policies: the sweep's numbers are the engine's, a pool that keeps everything reaches the
never-evicting bound under every policy, and bad arguments are refused before anything runs."""
from __future__ import annotations

import pytest

from kvlab import ConfigError, Engine, EngineConfig, make_workload, prefix_hit_bound
from kvlab.workloads.race import RACE_POLICIES, PolicyRace, race_policies
from kvlab.workloads.mixes import Workload

CONFIG = dict(block_size=16, max_num_seqs=8)  # few sequences at once: the pool's pressure is eviction, not preemption
SIZES = [150, 200, 3000]  # 3,000 blocks keep every block of the workload (5,137 at most, far fewer distinct)


@pytest.fixture(scope="module")
def trace() -> Workload:
    return make_workload("chat", 300, 0, rate=50.0)


@pytest.fixture(scope="module")
def race(trace) -> PolicyRace:
    return race_policies(trace, SIZES, RACE_POLICIES, progress=False, **CONFIG)


def test_each_cell_is_the_engines_hit_rate(trace, race):
    prompt = sum(r.prompt_len for r in trace)
    for policy in ("lru", "opt"):
        s = Engine(trace, EngineConfig(policy=policy, num_blocks=150, **CONFIG)).run()
        assert race.hit_rate[policy][0] == s["prefix_hit_tokens"] / prompt
        assert race.preemptions[policy][0] == s["preemptions"] == 0
    assert race.bound == prefix_hit_bound(trace, 16) / prompt


def test_a_pool_that_keeps_everything_reaches_the_bound_under_every_policy(race):
    assert {p: r[-1] for p, r in race.hit_rate.items()} == {p: race.bound for p in RACE_POLICIES}
    assert all(race.hit_rate[p][0] < race.bound for p in ("lru", "fifo", "clock"))  # 150 blocks must evict
    assert all(n == 0 for runs in race.preemptions.values() for n in runs)


def test_opt_is_the_ceiling_at_every_size(race):
    """Belady's policy knows every future lookup: on this workload no online policy serves more."""
    for i in range(len(SIZES)):
        assert race.hit_rate["opt"][i] == max(r[i] for r in race.hit_rate.values())
    assert race.hit_rate["opt"][0] > race.hit_rate["lru"][0]


def test_the_race_is_deterministic(trace, race):
    again = race_policies(trace, SIZES[:1], ("random", "clock"), progress=False, **CONFIG)
    assert again.hit_rate == {"random": race.hit_rate["random"][:1], "clock": race.hit_rate["clock"][:1]}


def test_table_and_figure(race):
    md = race.to_markdown()
    assert md.splitlines()[2] == "| pool blocks | " + " | ".join(RACE_POLICIES) + " |"
    assert f"| 150 | {100 * race.hit_rate['lru'][0]:.1f}%" in md
    fig = race.plot()
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.get_lines()] == [*RACE_POLICIES, "从不淘汰 (never evicts)"]
    assert list(ax.get_lines()[0].get_xdata()) == SIZES


@pytest.mark.parametrize("kwargs, word", [
    (dict(sizes=[]), "sizes"), (dict(sizes=[0]), "sizes"), (dict(sizes=[1.5]), "sizes"), (dict(sizes="12"), "sizes"),
    (dict(sizes=[10], policies=["belady"]), "policies"), (dict(sizes=[10], policies=["lru", "lru"]), "policies"),
    (dict(sizes=[10], policies="lru"), "policies"), (dict(sizes=[10], policy="lru"), "policy"),
    (dict(sizes=[10], num_blocks=5), "num_blocks"), (dict(sizes=[10], warp=9), "warp"),
    (dict(sizes=[10], block_size=0), "block_size"),
])
def test_bad_arguments_are_refused_before_any_run(trace, kwargs, word):
    with pytest.raises(ConfigError, match=word):
        race_policies(trace, progress=False, **kwargs)


def test_a_workload_is_required():
    with pytest.raises(ConfigError, match="Workload"):
        race_policies([1, 2], [10], progress=False)


def test_the_race_bound_is_computed_at_the_races_block_size():
    w = make_workload("chat", 30, seed=0)
    assert prefix_hit_bound(w, 32) != prefix_hit_bound(w, 16)  # so the test tells the two apart
    r = race_policies(w, [2000], ["lru"], progress=False, block_size=32)
    assert r.bound == pytest.approx(prefix_hit_bound(w, 32) / sum(q.prompt_len for q in w))
