"""The serving engine: continuous batching over a block pool, many tenants, long sequences (text §2.2.6).

§2.2.6 lists what a serving system built on fixed-size blocks should do for many users (thread safety,
isolation between users, reclaiming a user's memory when they leave, monitoring) and for long sequences
(splitting them into blocks, caching common blocks, managing memory so it never overflows, prefetching).
:class:`Engine` does each of these on a :class:`~kvlab.BlockPool` and measures the outcome.

One step of :meth:`Engine.step`:

1. **arrivals** whose time has come join their tenant's queue (when nothing runs, the clock jumps to the next);
2. **running** requests get their tokens first: one decode token each, then the next chunk of an unfinished
   prompt (chunked prefill: at most ``max_batched_tokens`` per step in all);
3. **swapped** requests come back next (oldest first), before any new request, so none starves;
4. **waiting** requests are admitted round-robin over tenants while sequences, tokens and blocks last
   (a prefix-cache hit skips the cached part of the prompt);
5. the batch runs (metadata mode only counts; real mode runs the tiny decoder through the paged cache);
6. finished requests release their blocks (full prompt blocks stay cached for later prefix hits).

**Preemption.** When a request needs a block that its tenant's quota or the pool cannot supply, the engine
preempts a victim: among running requests of tenants holding more than their reservation (or of the asking
tenant itself), the tenant furthest above its reservation loses its most recently admitted request (the one that
has made the least progress under first-come-first-served). ``preemption="recompute"`` drops the victim's blocks
and later recomputes its prompt plus what it generated (prefix-cache hits soften that); ``"swap"`` moves its
blocks to host memory and back. With ``prefetch=True`` a swapped request is brought back at the end of a step,
when blocks are free, so the copy overlaps the next step's compute instead of stalling it.

**Tenants.** ``quotas[t]`` caps the blocks tenant ``t`` holds; ``reservations[t]`` are blocks no other tenant
may take while ``t`` holds fewer (isolation: a flood from one tenant cannot starve another).
:meth:`Engine.remove_tenant` aborts a tenant's requests and reclaims every block they held.

**Time.** Steps are counted; seconds come from :class:`CostModel` in metadata mode (an explicit, stated
assumption) and from the wall clock in real mode.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .events import Event
from .pool import BlockPool
from .spec import KVSpec
from .baseline import ContiguousMemory
from .metrics import MetricsLog, RequestRecord, StepMetrics, format_table
from .workloads import Request, Workload

WAITING, RUNNING, SWAPPED, FINISHED = "waiting", "running", "swapped", "finished"


# ---------------------------------------------------------------------------------------------------- events
@dataclass(frozen=True, slots=True)
class Admitted(Event):
    """A request entered the running batch; ``cached_tokens`` of its prompt came from the prefix cache."""
    request_id: int
    tenant: str
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Preempted(Event):
    """A running request lost its blocks: ``mode`` is ``"recompute"`` or ``"swap"``."""
    request_id: int
    tenant: str
    mode: str
    blocks: int
    reason: str


@dataclass(frozen=True, slots=True)
class SwappedIn(Event):
    """A swapped request's blocks came back; ``prefetched`` when it happened ahead of need."""
    request_id: int
    blocks: int
    prefetched: bool


@dataclass(frozen=True, slots=True)
class Finished(Event):
    """A request produced its last token and released its blocks."""
    request_id: int
    tenant: str
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class TenantReclaimed(Event):
    """A tenant left: ``requests`` were aborted and ``blocks`` returned to the pool."""
    tenant: str
    requests: int
    blocks: int


# ---------------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class CostModel:
    """Simulated seconds of one step: ``base_s + token_s * tokens + context_s * context + swap_token_s * swapped``.

    ``tokens`` are the tokens computed this step, ``context`` the cached tokens attention reads, ``swapped``
    the tokens copied between host and device outside the step's compute. The defaults are an assumption in the
    range of a 7B model on one data-centre GPU (5 ms fixed, 40 µs per computed token, 0.5 µs per token read,
    20 µs per token swapped); change them and the absolute figures change, the comparisons much less."""
    base_s: float = 5e-3
    token_s: float = 4e-5
    context_s: float = 5e-7
    swap_token_s: float = 2e-5

    def step_s(self, tokens: int, context: int, swapped: int = 0) -> float:
        return self.base_s + self.token_s * tokens + self.context_s * context + self.swap_token_s * swapped


@dataclass
class EngineConfig:
    """Engine settings. ``memory="contiguous"`` runs the pre-paging baseline (max-length regions) instead."""
    num_blocks: int = 4096
    block_size: int = 16
    policy: str = "lru"
    memory: str = "paged"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_batched_tokens: int = 512
    preemption: str = "recompute"
    prefix_caching: bool = True
    prefetch: bool = True
    quotas: dict[str, int] = field(default_factory=dict)
    reservations: dict[str, int] = field(default_factory=dict)
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"EngineConfig.{name} must be a positive int, got {v!r}")
        if self.memory not in ("paged", "contiguous"):
            raise ConfigError(f"EngineConfig.memory must be 'paged' or 'contiguous', got {self.memory!r}")
        if self.preemption not in ("recompute", "swap"):
            raise ConfigError(f"EngineConfig.preemption must be 'recompute' or 'swap', got {self.preemption!r}")
        bad = {t: v for d in (self.quotas, self.reservations) for t, v in d.items() if not isinstance(v, int) or v < 0}
        if bad:
            raise ConfigError(f"tenant quotas/reservations must be block counts >= 0, got {bad}")
        over = sum(self.reservations.values())
        if over > self.num_blocks:
            raise ConfigError(f"reservations sum to {over} blocks but the pool has {self.num_blocks}")
        low = {t: (q, self.reservations[t]) for t, q in self.quotas.items() if self.reservations.get(t, 0) > q}
        if low:
            raise ConfigError(f"reservation above quota for tenants {low} (quota, reservation)")

# ---------------------------------------------------------------------------------------------------- memory
@dataclass(slots=True, eq=False)
class Job:
    """A request inside the engine. ``tokens`` are the tokens known so far (prompt, then each generated one);
    the KV cache holds the first ``computed`` of them. A step feeds ``tokens[computed:computed + n]``; when that
    reaches the end, the model samples the next token. ``blocks`` is what its memory holds now, ``counted`` what
    its tenant was charged for."""
    req: Request
    rec: RequestRecord
    tokens: list[int]
    computed: int = 0
    generated: int = 0
    state: str = "waiting"
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    blocks: int = 0
    counted: int = 0
    host: Any = None


class PagedMemory:
    """The paged KV cache behind the engine: a :class:`~kvlab.BlockPool` (metadata-only unless a model runs),
    one block table per job, and prefix caching by hash chains over full blocks (block ``i``'s key hashes block
    ``i - 1``'s key and its own token ids, so equal keys mean equal prefixes)."""

    def __init__(self, cfg: "EngineConfig", model: Any = None) -> None:
        spec = model.spec if model is not None else KVSpec(block_size=cfg.block_size)
        if spec.block_size != cfg.block_size:
            raise ConfigError(f"the model's KVSpec has block_size {spec.block_size}, the engine {cfg.block_size}")
        self.pool = BlockPool(cfg.num_blocks, spec=spec, eviction_policy=cfg.policy, with_storage=model is not None)
        self.events = self.pool.events
        self.model, self.bs, self.caching = model, cfg.block_size, cfg.prefix_caching
        self.capacity_slots = cfg.num_blocks * cfg.block_size
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self.pool.evict_hooks.append(self._forget)
        self.queried = self.hit = 0
        self._pending_hits: list[int] = []

    @property
    def evictions(self) -> int:
        return self.pool._counts["evictions"]

    def prompt_ids(self, req: Request) -> list[int]:
        if self.caching or self.model is not None:
            return req.prompt_token_ids(self.model.vocab_size if self.model is not None else 32000)
        return [0] * req.prompt_len  # the ids matter to nobody: skip deriving them

    def next_token(self, job: Job) -> int:
        if self.model is not None:
            return job.host_next  # set by execute
        return (job.req.id * 7919 + job.generated) % 32000  # deterministic stand-in for a sampled token

    def available(self) -> int:
        return self.pool.num_free_blocks + self.pool.num_cached_blocks

    def blocks_for(self, job: Job, n: int) -> int:
        return max(0, -(-(job.computed + n) // self.bs) - len(job.table))

    def lookup(self, job: Job) -> int:
        """Tokens of ``job``'s prompt found in the prefix cache (full blocks; at least one token stays to
        compute, since the step that computes it yields the first output token)."""
        hits, h = [], 0
        if self.caching:
            toks, bs = job.tokens, self.bs
            for i in range((len(toks) - 1) // bs):
                h = hash((h, *toks[i * bs:(i + 1) * bs]))
                b = self._by_hash.get(h)
                if b is None:
                    break
                hits.append(b)
        self._pending_hits = hits
        return len(hits) * self.bs

    def blocks_for_admission(self, job: Job, cached: int, n: int) -> int:
        refs = self.pool._refs
        revived = sum(1 for b in self._pending_hits if not refs[b])  # cached hits stop being evictable
        return -(-(cached + n) // self.bs) - len(self._pending_hits) + revived

    def admit(self, job: Job, cached: int) -> None:
        hits = self._pending_hits
        if self.caching:
            self.queried += (len(job.tokens) - 1) // self.bs
            self.hit += len(hits)
        if hits:
            self.pool.incref(hits)
            job.table = list(hits)
            job.hashes = [self._hash_of[b] for b in hits]
        job.computed = cached
        job.blocks = len(job.table)

    def grow(self, job: Job, n: int) -> None:
        k = self.blocks_for(job, n)
        if k:
            job.table.extend(self.pool.allocate(k, owner=job.req.id))
            job.blocks = len(job.table)

    def execute(self, batch: list[tuple[Job, int]]) -> None:
        """Write this step's tokens: real KV through the model, or just the blocks' token counts."""
        if self.model is not None:
            self.model.engine_step(self.pool, batch)
        tokens, bs, caching = self.pool._tokens, self.bs, self.caching
        for job, n in batch:
            start, end = job.computed, job.computed + n
            table = job.table
            if n == 1:  # decode: one slot of one block
                tokens[table[start // bs]] = start % bs + 1
            else:
                for i in range(start // bs, -(-end // bs)):
                    tokens[table[i]] = min(bs, end - i * bs)
            if caching and end % bs < n and end // bs > len(job.hashes):  # a block filled up this step
                self._register(job, end // bs)

    def _register(self, job: Job, full: int) -> None:
        """Publish ``job``'s newly filled blocks in the prefix cache (the first block with a given key wins)."""
        toks, bs, h = job.tokens, self.bs, job.hashes[-1] if job.hashes else 0
        fresh = []
        for i in range(len(job.hashes), min(full, len(toks) // bs)):
            h = hash((h, *toks[i * bs:(i + 1) * bs]))
            job.hashes.append(h)
            b = job.table[i]
            if h not in self._by_hash and b not in self._hash_of:
                self._by_hash[h], self._hash_of[b] = b, h
                fresh.append(b)
        if fresh:
            self.pool.mark_reusable(fresh)

    def _forget(self, b: int) -> None:
        h = self._hash_of.pop(b, None)
        if h is not None:
            del self._by_hash[h]

    def release(self, job: Job, abort: bool) -> None:
        """Drop ``job``'s references, tail first: private blocks become FREE, registered ones stay cached."""
        if job.table:
            self.pool.free(job.table[::-1])
        job.table, job.hashes, job.blocks = [], [], 0

    def swap_out(self, job: Job) -> None:
        """Move ``job``'s KV to host memory: private blocks go ALLOCATED -> EVICTING -> FREE, shared ones are
        only released (their other holders keep them)."""
        pool, refs = self.pool, self.pool._refs
        data = pool.storage.gather_blocks(job.table).cpu() if pool.storage is not None else None
        counts = [pool._tokens[b] for b in job.table]
        private = [b for b in job.table if refs[b] == 1]
        shared = [b for b in job.table if refs[b] > 1]
        for b in private:
            self._forget(b)
        if private:
            pool.begin_eviction(private)
            pool.finish_eviction(private)
        if shared:
            pool.free(shared)
        job.host = (data, counts)
        job.table, job.hashes, job.blocks = [], [], 0  # a swapped job holds no pool block

    def swap_in(self, job: Job) -> None:
        """Bring ``job``'s KV back into fresh blocks: reserved PENDING, data copied, then committed."""
        data, counts = job.host
        ids = self.pool.reserve(len(counts), owner=job.req.id)
        if data is not None:
            self.pool.storage.scatter_blocks(ids, data)
        self.pool.commit(ids)
        for b, c in zip(ids, counts):
            self.pool._tokens[b] = c
        job.table, job.host, job.blocks = ids, None, len(ids)

    def swap_need(self, job: Job) -> int:
        return len(job.host[1])

    def gauges(self) -> tuple[int, int, float]:
        """(reserved slots, token slots, fragmentation) right now."""
        pool = self.pool
        reserved = (pool.num_blocks - pool.num_free_blocks) * self.bs
        return reserved, int(pool.tokens_np.sum()), pool.calculate_fragmentation() / 100

    def hit_rate(self) -> float:
        return self.hit / self.queried if self.queried else 0.0

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        for b, h in self._hash_of.items():
            assert self._by_hash[h] == b and self.pool._status[b] != 0, f"prefix entry of block {b} is stale"


class _Preempt(Exception):
    """Internal: the request being scheduled was itself chosen as the victim."""


# ---------------------------------------------------------------------------------------------------- engine
class Engine:
    """Continuous batching of ``workload`` (a :class:`Workload` or requests) on a paged pool or the baseline.

    Drive it with :meth:`step` (one step; False once every request finished) or :meth:`run`. Events
    (:class:`Admitted`, :class:`Preempted`, :class:`SwappedIn`, :class:`Finished`, :class:`TenantReclaimed`,
    :class:`~kvlab.metrics.StepMetrics`) go to :attr:`events`, the pool's own bus in paged mode.

    Invariants after every step: every running request's KV holds exactly its ``computed`` tokens; each
    tenant holds at most its quota; with every request finished the pool holds only cached prefix blocks
    (none referenced) and passes ``check_invariants``.
    """

    def __init__(self, workload: Workload | Iterable[Request], config: EngineConfig | None = None, *,
                 model: Any = None, **overrides: Any) -> None:
        cfg = config or EngineConfig()
        if overrides:
            cfg = EngineConfig(**{**cfg.__dict__, **overrides})
        self.config = cfg
        reqs = sorted(workload.requests if isinstance(workload, Workload) else workload,
                      key=lambda r: (r.arrival, r.id))
        too_long = [r.id for r in reqs if r.total_len > cfg.max_model_len]
        if too_long:
            raise ConfigError(f"requests {too_long[:5]} exceed max_model_len={cfg.max_model_len} tokens")
        self.memory: PagedMemory | ContiguousMemory = (PagedMemory(cfg, model) if cfg.memory == "paged" else ContiguousMemory(cfg, model))
        self.events = self.memory.events
        self._paged = cfg.memory == "paged"
        self.model = model
        self.log = MetricsLog()
        self._arrivals = deque(reqs)
        self._queues: dict[str, deque[Job]] = {}
        self._rr: deque[str] = deque()  # tenants in round-robin order
        self.running: list[Job] = []
        self.swapped: deque[Job] = deque()
        self.held: dict[str, int] = {}  # blocks per tenant
        self.now_s = 0.0
        self.step_count = 0
        self.preemptions = 0
        self.swap_stall_tokens = 0
        self.finished_count = 0
        self._wall = time.perf_counter

    # -------------------------------------------------------------------------------- public API
    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def done(self) -> bool:
        return not (self._arrivals or self.running or self.swapped or self.num_waiting)

    def step(self) -> bool:
        """Run one engine step; returns False (doing nothing) once every request has finished."""
        if self.done:
            return False
        self._arrive()
        if not (self.running or self.swapped or self.num_waiting):
            self.now_s = self._arrivals[0].arrival  # idle: jump to the next arrival
            self._arrive()
        t0 = self._wall()
        batch = self._schedule()
        stall = self.swap_stall_tokens
        self.swap_stall_tokens = 0
        prefill = decode = context = 0
        for job, n in batch:
            context += job.computed
            if job.computed + n < len(job.tokens) or job.generated or n > 1:
                prefill += n
            else:
                decode += n
        self.memory.execute(batch)
        self.step_count += 1
        if self.model is None:
            self.now_s += self.config.cost.step_s(prefill + decode, context, stall)
        else:
            self.now_s += self._wall() - t0
        self._complete(batch)
        if self.config.prefetch:
            self._prefetch()
        self._record(prefill, decode)
        return True

    def run(self, progress: bool = False, max_steps: int | None = None) -> dict[str, Any]:
        """Step until every request finished (or ``max_steps``); returns :meth:`summary`."""
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(self.log.requests) + len(self._arrivals), unit="req", desc=self.config.memory)
        seen = 0
        while (max_steps is None or self.step_count < max_steps) and self.step():
            if bar is not None and len(self.log.steps) % 64 == 0:
                n = self.finished_count
                bar.update(n - seen)
                seen = n
        if bar is not None:
            bar.update(self.finished_count - seen)
            bar.close()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        """Metrics of the run so far (see :meth:`MetricsLog.summary`) plus the setup."""
        out = {"memory": self.config.memory, "block_size": self.config.block_size, "policy": self.config.policy,
               "preemption": self.config.preemption}
        out.update(self.log.summary())
        out["prefix_hit_tokens"] = sum(r.prefix_hit_tokens for r in self.log.requests.values())
        return out

    def table(self) -> str:
        return format_table({self.config.memory: self.summary()})

    def add_requests(self, requests: Iterable[Request]) -> None:
        """Submit more requests (arrival times in the engine's seconds; past ones arrive at the next step)."""
        merged = sorted([*self._arrivals, *requests], key=lambda r: (r.arrival, r.id))
        self._arrivals = deque(merged)

    def remove_tenant(self, tenant: str) -> int:
        """Abort every request of ``tenant`` (waiting, running, swapped, not yet arrived) and reclaim its blocks;
        returns the number of blocks returned. Its quota and reservation are dropped too."""
        jobs = [j for j in (*self.running, *self.swapped, *self._queues.get(tenant, ())) if j.req.tenant == tenant]
        blocks = self.held.get(tenant, 0)
        for job in jobs:
            if job.state == RUNNING:
                self.running.remove(job)
            elif job.state == SWAPPED:
                self.swapped.remove(job)
            self.memory.release(job, abort=True)
            self._account(job, 0)
            job.state = FINISHED
        self._queues.pop(tenant, None)
        if tenant in self._rr:
            self._rr.remove(tenant)
        left = [r for r in self._arrivals if r.tenant == tenant]
        self._arrivals = deque(r for r in self._arrivals if r.tenant != tenant)
        self.config.quotas.pop(tenant, None)
        self.config.reservations.pop(tenant, None)
        assert self.held.get(tenant, 0) == 0, f"tenant {tenant} still holds {self.held[tenant]} blocks"
        self.held.pop(tenant, None)
        if self.events.subscribers:
            self.events.publish(TenantReclaimed(self.step_count, tenant, len(jobs) + len(left), blocks))
        return blocks

    def check_invariants(self) -> None:
        """Raise AssertionError if the memory or the tenant accounting drifted."""
        self.memory.check_invariants()
        live = [*self.running, *self.swapped]
        per: dict[str, int] = {}
        for j in live:
            per[j.req.tenant] = per.get(j.req.tenant, 0) + j.blocks
        assert {t: n for t, n in self.held.items() if n} == {t: n for t, n in per.items() if n}, \
            f"tenant accounting {self.held} != blocks held by their requests {per}"
        for t, q in self.config.quotas.items():
            assert self.held.get(t, 0) <= q, f"tenant {t} holds {self.held[t]} blocks, quota {q}"

    # -------------------------------------------------------------------------------- scheduling
    def _arrive(self) -> None:
        arr, now = self._arrivals, self.now_s
        while arr and arr[0].arrival <= now:
            r = arr.popleft()
            rec = RequestRecord(r.id, r.tenant, r.arrival, r.output_len, arrival_step=self.step_count)
            self.log.requests[r.id] = rec
            q = self._queues.get(r.tenant)
            if q is None:
                q = self._queues[r.tenant] = deque()
                self._rr.append(r.tenant)
            q.append(Job(r, rec, self.memory.prompt_ids(r)))

    def _schedule(self) -> list[tuple[Job, int]]:
        cfg = self.config
        budget = cfg.max_batched_tokens
        batch: list[tuple[Job, int]] = []
        # Decode tokens first (they keep TPOT low), then continuing prompt chunks.
        paged, bs = self._paged, cfg.block_size
        for job in sorted(self.running, key=lambda j: len(j.tokens) - j.computed > 1):
            if job.state != RUNNING or not budget:
                continue
            n = min(len(job.tokens) - job.computed, budget)
            if paged and job.computed + n > len(job.table) * bs:  # only a job crossing a block boundary allocates
                try:
                    self._grow(job, n)
                except _Preempt:
                    continue
            batch.append((job, n))
            budget -= n
        # Preempting a later request may have removed one already placed in the batch.
        batch = [(j, n) for j, n in batch if j.state == RUNNING]
        budget = cfg.max_batched_tokens - sum(n for _, n in batch)
        while self.swapped and len(self.running) < cfg.max_num_seqs:
            job = self.swapped[0]
            if not self._fits(job.req.tenant, self.memory.swap_need(job)):
                break
            self.swapped.popleft()
            self._swap_in(job, prefetched=False)
        if self.swapped:
            return batch
        self._admit(batch, budget)
        return batch

    def _admit(self, batch: list[tuple[Job, int]], budget: int) -> None:
        cfg, tried = self.config, 0
        while budget and len(self.running) < cfg.max_num_seqs and tried < len(self._rr):
            tenant = self._rr[0]
            self._rr.rotate(-1)
            q = self._queues[tenant]
            if not q:
                tried += 1
                continue
            job = q[0]
            cached = self.memory.lookup(job)
            n = min(len(job.tokens) - cached, budget)
            need = self.memory.blocks_for_admission(job, cached, n)
            if not self._fits(tenant, need):
                tried += 1
                continue
            tried = 0
            q.popleft()
            self.memory.admit(job, cached)
            job.rec.prefix_hit_tokens += cached
            job.state = RUNNING
            self.running.append(job)
            self.memory.grow(job, n)
            self._account(job, job.blocks)
            batch.append((job, n))
            budget -= n
            if self.events.subscribers:
                self.events.publish(Admitted(self.step_count, job.req.id, tenant, cached))

    def _fits(self, tenant: str, need: int) -> bool:
        """Whether ``tenant`` may take ``need`` more blocks: within its quota, and leaving every other tenant's
        unused reservation untouched."""
        cfg = self.config
        held = self.held.get(tenant, 0)
        quota = cfg.quotas.get(tenant)
        if quota is not None and held + need > quota:
            return False
        owed = sum(max(0, r - self.held.get(t, 0)) for t, r in cfg.reservations.items() if t != tenant)
        return need <= self.memory.available() - owed

    def _grow(self, job: Job, n: int) -> None:
        """Make room for ``n`` more tokens of running ``job``, preempting victims as the rule says; raises
        :class:`_Preempt` when ``job`` itself had to go."""
        tenant = job.req.tenant
        need = self.memory.blocks_for(job, n)
        while need and not self._fits(tenant, need):
            victim = self._victim(tenant, job)
            self._preempt(victim, "quota" if tenant in self.config.quotas and victim.req.tenant == tenant
                          else "out of blocks")
            if victim is job:
                raise _Preempt
        self.memory.grow(job, n)
        self._account(job, job.blocks)

    def _victim(self, tenant: str, asking: Job) -> Job:
        """The documented rule: the tenant furthest above its reservation (the asking tenant always qualifies;
        under its own quota only its own requests do) loses its most recently admitted running request."""
        cfg = self.config
        quota = cfg.quotas.get(tenant)
        own_quota = quota is not None and self.held.get(tenant, 0) + self.memory.blocks_for(asking, 1) > quota
        best, best_key = asking, None
        for i, j in enumerate(self.running):
            t = j.req.tenant
            if own_quota and t != tenant:
                continue
            over = self.held.get(t, 0) - cfg.reservations.get(t, 0)
            if t != tenant and over <= 0:
                continue
            key = (over, i)
            if best_key is None or key > best_key:
                best, best_key = j, key
        return best

    def _preempt(self, job: Job, reason: str) -> None:
        self.running.remove(job)
        blocks = job.blocks
        mode = self.config.preemption
        if mode == "swap":
            self.memory.swap_out(job)
            job.state = SWAPPED
            self.swapped.append(job)
        else:
            self.memory.release(job, abort=False)
            job.computed = 0
            job.state = WAITING
            self._queues[job.req.tenant].appendleft(job)
        self._account(job, job.blocks)
        job.rec.preemptions += 1
        self.preemptions += 1
        if self.events.subscribers:
            self.events.publish(Preempted(self.step_count, job.req.id, job.req.tenant, mode, blocks, reason))

    def _swap_in(self, job: Job, prefetched: bool) -> None:
        self.memory.swap_in(job)
        job.state = RUNNING
        self.running.append(job)
        self._account(job, job.blocks)
        if not prefetched:
            self.swap_stall_tokens += job.computed
        if self.events.subscribers:
            self.events.publish(SwappedIn(self.step_count, job.req.id, job.blocks, prefetched))

    def _prefetch(self) -> None:
        """Bring swapped requests back ahead of need while blocks are free (the copy overlaps the next step)."""
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            job = self.swapped[0]
            # Keep one block per running request free for its next decode token.
            if not self._fits(job.req.tenant, self.memory.swap_need(job) + len(self.running)):
                return
            self.swapped.popleft()
            self._swap_in(job, prefetched=True)

    def _account(self, job: Job, blocks: int) -> None:
        """Tenant bookkeeping: ``job`` now holds ``blocks`` (it held ``job.counted``)."""
        t = job.req.tenant
        self.held[t] = self.held.get(t, 0) + blocks - job.counted
        job.counted = blocks

    # -------------------------------------------------------------------------------- completion and metrics
    def _complete(self, batch: list[tuple[Job, int]]) -> None:
        step, now, mem = self.step_count, self.now_s, self.memory
        for job, n in batch:
            job.computed += n
            if job.computed < len(job.tokens):
                continue
            rec = job.rec
            if job.generated < job.req.output_len:
                job.tokens.append(mem.next_token(job))
                job.generated += 1
                if rec.first_step < 0:
                    rec.first_step, rec.first_s = step, now
            if job.generated == job.req.output_len:
                if rec.first_step < 0:  # nothing to generate: the prompt's last step is its first "token"
                    rec.first_step, rec.first_s = step, now
                rec.finish_step, rec.finish_s = step, now
                self.running.remove(job)
                mem.release(job, abort=False)
                self._account(job, 0)
                job.state = FINISHED
                self.finished_count += 1
                if self.events.subscribers:
                    self.events.publish(Finished(step, job.req.id, job.req.tenant, rec.ttft_s, rec.tpot_s))

    def _record(self, prefill: int, decode: int) -> None:
        mem = self.memory
        reserved, tokens, frag = mem.gauges()
        m = StepMetrics(self.step_count, self.now_s, len(self.running), self.num_waiting, len(self.swapped),
                        prefill, decode, mem.capacity_slots, reserved, tokens, frag, mem.evictions,
                        self.preemptions, mem.hit_rate(), self.finished_count,
                        tuple(sorted((t, n) for t, n in self.held.items() if n)))
        self.log.steps.append(m)
        if self.events.subscribers:
            self.events.publish(m)


def run_workload(workload: Workload, **config: Any) -> dict[str, Any]:
    """Convenience: run ``workload`` to the end with an :class:`EngineConfig` built from ``config``."""
    try:
        return Engine(workload, EngineConfig(**config)).run()
    except TypeError as e:
        raise ConfigError(f"unknown engine setting: {e}") from None


__all__ = ["Admitted", "CostModel", "Engine", "EngineConfig", "Finished", "Job", "PagedMemory", "Preempted",
           "SwappedIn", "TenantReclaimed", "run_workload"]
