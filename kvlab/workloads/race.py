"""Racing eviction policies on a workload: prefix-hit rate against pool size (text §2.2.2's ``evict_block``).

§2.2.2 leaves the choice of victim to a policy. Which policy is best is a question about traffic, so this module
answers it by replaying one workload (a real trace, see :func:`kvlab.load_trace`) through the serving engine
once per (policy, pool size) and reporting the share of prompt tokens served from the prefix cache. Two lines
frame the race: Belady's ``opt`` (it knows the future, no online policy beats it) and the unbounded bound
(:func:`kvlab.prefix_hit_bound`: what a cache that never evicts would serve).

    race = race_policies(make_workload("chat", 300, rate=50.0), sizes=[150, 200, 3000], max_num_seqs=8)
    race.plot()          # hit rate against pool size, one line per policy
    print(race.to_markdown())
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.core.checks import is_int
from kvlab.core.errors import ConfigError
from kvlab.serve.config import EngineConfig
from kvlab.serve.engine import Engine
from kvlab.workloads.traces import prefix_hit_bound
from kvlab.workloads.mixes import Workload

RACE_POLICIES = ("lru", "fifo", "lfu", "random", "clock", "opt")


@dataclass(frozen=True)
class PolicyRace:
    """The outcome of :func:`race_policies`: ``hit_rate[policy][i]`` is prefix-hit tokens / prompt tokens with a
    pool of ``sizes[i]`` blocks; ``bound`` the same share for a cache that never evicts; ``preemptions`` per run
    (a recomputed request looks its prompt up again, so with preemptions a rate may pass the bound: give the
    engine fewer concurrent sequences, ``max_num_seqs``, to race eviction alone)."""

    workload: str
    requests: int
    block_size: int
    sizes: tuple[int, ...]
    hit_rate: dict[str, tuple[float, ...]]
    bound: float
    preemptions: dict[str, tuple[int, ...]]

    def to_markdown(self) -> str:
        """One row per pool size, one column per policy (percent of prompt tokens served from the cache)."""
        names = list(self.hit_rate)
        lines = [f"prefix-hit rate, {self.workload} ({self.requests} requests, block size {self.block_size}); "
                 f"a cache that never evicts: {100 * self.bound:.1f}%", "",
                 "| pool blocks | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
        for i, size in enumerate(self.sizes):
            lines.append(f"| {size:,} | " + " | ".join(f"{100 * self.hit_rate[p][i]:.1f}%" for p in names) + " |")
        return "\n".join(lines)

    def plot(self) -> Any:
        """A matplotlib Figure: hit rate against pool size per policy, the never-evicting bound dotted. The y axis
        runs from 0 to above the largest value: cut to the data's range, small gaps between policies looked
        large."""
        from kvlab.viz.static import MIN_PT, Picture  # a figure that displays as an image in any kernel

        fig = Picture(figsize=(7, 4.2), layout="constrained")
        ax = fig.subplots()
        for name, rates in self.hit_rate.items():
            ax.plot(self.sizes, [100 * r for r in rates], "o-" if name != "opt" else "k^--", label=name)
        ax.axhline(100 * self.bound, color="grey", ls=":", label="从不淘汰 (never evicts)")
        top = 100 * max([self.bound, *(r for rates in self.hit_rate.values() for r in rates)])
        ax.set_ylim(0, min(100.0, top * 1.1) if top > 0 else 1.0)  # headroom over the top line, never past 100%
        ax.set(xscale="log", xlabel="池的大小，块数 (pool size, blocks)", ylabel="由缓存提供的提示 token (%)",
               title=f"淘汰策略在 {self.workload} 上 (eviction policies)，块大小 {self.block_size}")
        ax.set_xticks(self.sizes, [f"{s:,}" for s in self.sizes])  # the sizes raced, not 2x10^2
        ax.set_xticks([], minor=True)
        ax.legend(fontsize=MIN_PT)
        return fig


def race_policies(workload: Workload, sizes: Sequence[int], policies: Sequence[str] = RACE_POLICIES, *,
                  progress: bool = True, **config: Any) -> PolicyRace:
    """Replay ``workload`` through :class:`~kvlab.Engine` (metadata mode, prefix caching on) once per policy and
    pool size in ``sizes`` (blocks); ``config`` sets the other :class:`~kvlab.EngineConfig` fields (block size,
    max_model_len, max_batched_tokens, ...). Returns a :class:`PolicyRace`."""
    if not isinstance(workload, Workload):
        raise ConfigError(f"race_policies needs a Workload, got {workload!r:.80}")
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes \
            or not all(is_int(s) and s >= 1 for s in sizes):
        raise ConfigError(f"sizes must be a non-empty list of pool sizes (ints >= 1), got {sizes!r:.80}")
    if isinstance(policies, (str, bytes)) or not isinstance(policies, Sequence) or not policies \
            or any(p not in RACE_POLICIES for p in policies) or len(set(policies)) != len(policies):
        raise ConfigError(f"policies must be distinct names from {RACE_POLICIES}, got {policies!r:.80}")
    fixed = {"policy", "num_blocks", "prefix_caching", "memory"} & set(config)
    if fixed:
        raise ConfigError(f"race_policies sets {sorted(fixed)} itself (policies= and sizes= choose the runs)")
    unknown = set(config) - {f.name for f in dataclasses.fields(EngineConfig)}
    if unknown:
        raise ConfigError(f"unknown EngineConfig fields {sorted(unknown)}")
    base = EngineConfig(**config)  # bad values fail here, before any run
    prompt = sum(r.prompt_len for r in workload)
    runs = [(p, int(s)) for p in policies for s in sizes]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(runs), unit="run", desc="policy race", disable=None)  # off in logs
    hits: dict[str, list[float]] = {p: [] for p in policies}
    preempted: dict[str, list[int]] = {p: [] for p in policies}
    for policy, size in runs:
        if bar is not None:
            bar.set_postfix_str(f"{policy} {size:,} blocks")
        summary = Engine(workload, dataclasses.replace(base, policy=policy, num_blocks=size)).run()
        hits[policy].append(summary["prefix_hit_tokens"] / prompt if prompt else 0.0)
        preempted[policy].append(summary["preemptions"])
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    bound = prefix_hit_bound(workload, base.block_size) / prompt if prompt else 0.0
    return PolicyRace(workload.name, len(workload), base.block_size, tuple(int(s) for s in sizes),
                      {p: tuple(v) for p, v in hits.items()}, bound, {p: tuple(v) for p, v in preempted.items()})
