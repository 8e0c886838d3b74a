"""The serving engine: continuous batching over a KV memory, many tenants, long sequences (text §2.2.6).

§2.2.6 lists what a serving system built on fixed-size blocks should do for many users (thread safety,
isolation between users, reclaiming a user's memory when they leave, monitoring) and for long sequences
(splitting them into blocks, caching common blocks, managing memory so it never overflows, prefetching).
:class:`Engine` does each of these and measures the outcome. It only decides *who* runs and *who* yields: every
request is a :class:`~kvlab.serve.job.Job`, and its memory (:mod:`kvlab.serve.memory`: a paged pool with block
tables, swap and a prefix cache, or the contiguous baseline) holds its K/V and answers what admitting it takes.

One step of :meth:`Engine.step`:

1. **arrivals** whose time has come join their tenant's queue (when nothing runs, the clock jumps to the next);
2. **running** requests get their tokens first: one decode token each, then the next chunk of an unfinished
   prompt (chunked prefill: at most ``max_batched_tokens`` per step in all). The blocks a request will need
   are *promised* here (preempting victims if they cannot be) and taken when the batch runs, in one allocation;
3. **swapped** requests come back next (oldest first), before any new request, so none starves;
4. **waiting** requests are admitted round-robin over tenants while sequences, tokens and blocks last
   (a prefix-cache hit skips the cached part of the prompt; :meth:`PrefixCache.peek` prices it first);
5. the batch runs: metadata mode appends token counts (:meth:`SequenceManager.append_tokens`), real mode runs
   the model through the paged KV tensor (:meth:`Llama.step <kvlab.serve.model.Llama.step>`) and samples each
   request's next token (:func:`kvlab.serve.sampling.sample`: greedy, or temperature and top-p with a seeded generator);
   a request ends at its ``output_len`` or, with a real model, when it samples the end-of-turn token;
6. finished requests release their blocks (full blocks stay cached for later prefix hits);
7. with ``prefetch`` swapped requests come back now, while blocks are free (see *Time*).

**Preemption.** When a request needs a block that its tenant's quota or the pool cannot supply, the engine
preempts a victim: among running requests of tenants holding more than their reservation (or of the asking
tenant itself), the tenant furthest above its reservation loses its most recently admitted request (the one that
has made the least progress under first-come-first-served). ``preemption="recompute"`` frees the victim's
sequence and later recomputes its prompt plus what it generated (its registered blocks stay cached, so a
re-admission hits them); ``"swap"`` copies the blocks the victim holds alone to host memory and back; blocks it
shares or that the prefix cache names stay in the pool, so swapping never breaks prefix sharing. Two cases fall
back to recompute, since a swap could not free memory there: a victim holding only shared or cached blocks, and
the oldest swapped request when nothing runs and it cannot come back (swapped requests hold what it needs).

**Tenants.** ``quotas[t]`` caps the blocks tenant ``t`` holds; ``reservations[t]`` are blocks no other tenant
may take while ``t`` holds fewer (isolation: a flood from one tenant cannot starve another). A shared block
counts for every request holding it. :meth:`Engine.remove_tenant` aborts a tenant's requests and reclaims every
block they held.

**Time.** Steps are counted; seconds come from :class:`~kvlab.serve.config.CostModel` in metadata mode (an
explicit, stated assumption: ``summary()["clock"]`` says ``"simulated"``) and from the wall clock in real mode
(``"wall"``). Copies to and from host memory at preemption or at an on-demand swap-in stall the step. A
*prefetched* swap-in (end of the previous step) overlaps the next step's compute and stalls only by what it takes
longer than that compute: this is the effect of prefetching, measured as ``swap_in_stall_s`` (and
``swap_stall_s``, which adds swap-outs) with and without it.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from kvlab.serve.sampling import sample
from kvlab.core.checks import is_int
from kvlab.core.errors import ConfigError
from kvlab.core.events import Event
from kvlab.core.interrupts import atomic
from kvlab.serve.metrics import MetricsLog, RequestRecord, StepMetrics, format_table
from kvlab.serve.model import Llama
from kvlab.workloads.mixes import HASH_BLOCK, Request, Workload
from kvlab.serve.config import EngineConfig
from kvlab.serve.events import Admitted, Finished, Preempted, SwappedIn, TenantReclaimed
from kvlab.serve.job import FINISHED, NO_KV, RUNNING, SWAPPED, WAITING, Job
from kvlab.serve.memory import ContiguousMemory, Memory, PagedMemory


@atomic("step add_requests remove_tenant")
class Engine:
    """Continuous batching of ``workload`` (a :class:`Workload` or requests) on a paged pool or the baseline.

    Drive it with :meth:`step` (one step; False once every request finished) or :meth:`run`. Events
    (:class:`Admitted`, :class:`Preempted`, :class:`SwappedIn`, :class:`Finished`, :class:`TenantReclaimed`,
    :class:`~kvlab.serve.metrics.StepMetrics`, and the pool's, sequences' and prefix cache's own) go to
    :attr:`events`, the pool's bus in paged mode. ``model`` (a :class:`~kvlab.serve.model.TinyLlama`) turns on real
    mode: the KV tensor holds real K/V and the tokens are the model's greedy choices.

    Invariants after every step: every request holding memory has a token left to feed and its memory holds the
    first ``kv.num_tokens`` of its tokens; each tenant holds at most its quota and is charged what its requests
    hold; with every request finished the pool holds only cached prefix blocks (none referenced).
    """

    def __init__(self, workload: Workload | Iterable[Request], config: EngineConfig | None = None, *,
                 model: Any = None, **overrides: Any) -> None:
        cfg = config or EngineConfig()
        if not isinstance(cfg, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, got {cfg!r}")
        if model is not None and not isinstance(model, Llama):
            raise ConfigError(f"model must be a kvlab Llama (TinyLlama, load_model) or None (metadata only), "
                              f"got {model!r:.80}")
        unknown = sorted(set(overrides) - set(cfg.__dict__))
        if unknown:
            raise ConfigError(f"EngineConfig has no setting {unknown[0]!r}")
        # A private copy: remove_tenant edits the tenant tables, never the caller's config.
        cfg = EngineConfig(**{**cfg.__dict__, "quotas": dict(cfg.quotas),
                              "reservations": dict(cfg.reservations), **overrides})
        self.config, self.model = cfg, model
        reqs = self._requests(workload.requests if isinstance(workload, Workload) else workload)
        self._refuse_impossible(reqs, set())
        self._ids = {r.id for r in reqs}  # every id given, to refuse one given again
        self._tenants = {r.tenant for r in reqs} | set(cfg.quotas) | set(cfg.reservations)
        self.caching = cfg.memory == "paged" and cfg.prefix_caching  # admissions look prompts up in a prefix cache
        if cfg.policy == "opt" and not self.caching:
            raise ConfigError("policy 'opt' ranks cached prefix blocks by their next lookup: it needs "
                              "memory='paged' and prefix_caching=True")
        self.memory: Memory = (PagedMemory(cfg, model, reqs) if cfg.memory == "paged"
                               else ContiguousMemory(cfg, model))
        self.events = self.memory.events
        # Real mode samples with its own seeded generator; a model with a tokenizer ends a request at end of turn.
        self.generator = None if cfg.seed is None else torch.Generator().manual_seed(cfg.seed)
        tokenizer = getattr(model, "tokenizer", None)
        self.eos = tokenizer.eos_id if tokenizer is not None and cfg.stop_at_eos else None
        self.log = MetricsLog()
        self.outputs: dict[int, list[int]] = {}  # request id -> the tokens it generated
        self._arrivals = deque(reqs)
        self._queues: dict[str, deque[Job]] = {}
        self._rr: deque[str] = deque()  # tenants in round-robin order
        self.running: list[Job] = []
        self.swapped: deque[Job] = deque()
        self.held: dict[str, int] = {}  # blocks per tenant (held + promised)
        self.promised = 0  # blocks promised to this step's batch, taken when it runs
        self.now_s = 0.0
        self.step_count = 0
        self.preemptions = 0
        # Prompt tokens looked up in the prefix cache and served by it, counted as vLLM 0.34.0 counts them
        # (PrefixCacheStats): a request readmitted after a preemption finds its own blocks again, which saves
        # recomputing them but shares nothing, so those lookups are kept apart from the hit rate.
        self.prefix_query_tokens = self.prefix_hit_tokens = 0
        self.preempted_query_tokens = self.preempted_hit_tokens = 0
        self.finished_count = 0
        self.swap_ins = self.prefetched_ins = 0
        self.swap_in_stall_s = 0.0  # the part of the stall prefetching can hide
        self._sync_out = self._sync_in = self._async_in = 0  # tokens copied this step (out, in, in overlapped)
        self._wall = time.perf_counter

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
        prefill = decode = context = 0
        for job, n in batch:
            context += job.kv.num_tokens
            if job.decodes(n):
                decode += 1
            else:
                prefill += n
            job.pending = 0  # the memory takes the promised blocks now
        self.promised = 0
        logits = self.memory.execute(batch)
        next_ids = None if logits is None else sample(logits, self.config.temperature, self.config.top_p,
                                                      self.generator)
        self.step_count += 1
        cost = self.config.cost
        if self.model is None:
            compute = cost.step_s(prefill + decode, context)
            stall_in = cost.swap_s(self._sync_in) + max(0.0, cost.swap_s(self._async_in) - compute)
            stall = cost.swap_s(self._sync_out) + stall_in
            self.now_s += compute + stall
            self.swap_in_stall_s += stall_in
        else:
            stall = 0.0
            self.now_s += self._wall() - t0
        self._sync_out = self._sync_in = self._async_in = 0
        self._complete(batch, next_ids)
        if self.config.prefetch:
            self._prefetch()
        self._record(prefill, decode, stall)
        return True

    def run(self, progress: bool = False, max_steps: int | None = None) -> dict[str, Any]:
        """Step until every request finished (or until ``max_steps`` steps in all); returns :meth:`summary`."""
        if max_steps is not None and (not is_int(max_steps) or max_steps < 0):
            raise ConfigError(f"max_steps must be an int >= 0 or None, got {max_steps!r}")
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(self.log.requests) + len(self._arrivals), unit="req", desc=self.config.memory,
                       disable=None)  # None: off when stderr is not a terminal (a log, a pipe)
        seen = 0
        while (max_steps is None or self.step_count < max_steps) and self.step():
            if bar is not None and self.step_count % 64 == 0:
                bar.update(self.finished_count - seen)
                seen = self.finished_count
        if bar is not None:
            bar.update(self.finished_count - seen)
            bar.close()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        """Metrics of the run so far (see :meth:`MetricsLog.summary`) plus the setup."""
        out = {"memory": self.config.memory, "block_size": self.config.block_size, "policy": self.config.policy,
               "preemption": self.config.preemption, "clock": "simulated" if self.model is None else "wall"}
        out.update(self.log.summary())
        out["prefix_hit_tokens"] = self.prefix_hit_tokens
        out["preempted_hit_tokens"] = self.preempted_hit_tokens
        out["swap_ins"], out["prefetched_swap_ins"] = self.swap_ins, self.prefetched_ins
        out["swap_in_stall_s"] = self.swap_in_stall_s
        out.update(self.memory.summary())
        return out

    def table(self) -> str:
        return format_table({self.config.memory: self.summary()})

    def add_requests(self, requests: Iterable[Request]) -> None:
        """Submit more requests (arrival times in the engine's seconds; past ones arrive at the next step)."""
        if self.config.policy == "opt":
            raise ConfigError("policy 'opt' was given the whole future when the engine was built: it cannot take "
                              "requests added later")
        reqs = self._requests(requests)
        self._refuse_impossible(reqs, self._ids)
        self._ids.update(r.id for r in reqs)
        self._tenants.update(r.tenant for r in reqs)
        self._arrivals = deque(sorted([*self._arrivals, *reqs], key=lambda r: (r.arrival, r.id)))

    def remove_tenant(self, tenant: str) -> int:
        """Abort every request of ``tenant`` (waiting, running, swapped, not yet arrived) and reclaim its blocks;
        returns the number of blocks returned. Its quota and reservation are dropped too. :class:`ConfigError`
        for a tenant no request or setting ever named."""
        if not isinstance(tenant, str) or tenant not in self._tenants:
            raise ConfigError(f"no request or quota ever named tenant {tenant!r}")
        jobs = [j for j in (*self.running, *self.swapped, *self._queues.get(tenant, ())) if j.req.tenant == tenant]
        blocks = self.held.get(tenant, 0)
        for job in jobs:
            if job.state == RUNNING:
                self.running.remove(job)
            elif job.state == SWAPPED:
                self.swapped.remove(job)
            self.memory.release(job)
            self._account(job)
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
        if self.events:
            self.events.publish(TenantReclaimed(self._now(), self.step_count, tenant, len(jobs) + len(left),
                                                blocks))
        return blocks

    def check_invariants(self) -> None:
        """Raise AssertionError if the memory, a request or the tenant accounting drifted."""
        holding, mem, per = (*self.running, *self.swapped), self.memory, dict[str, int]()
        mem.check_invariants(holding)
        assert self.promised == 0, f"{self.promised} blocks promised outside a step"
        for j in holding:
            assert j.counted == mem.held(j) + j.pending, f"request {j.req.id}: charged {j.counted} blocks"
            assert j.kv.num_tokens < len(j.tokens), f"request {j.req.id} holds memory with no token left to feed"
            per[j.req.tenant] = per.get(j.req.tenant, 0) + j.counted
        assert all(j.kv is NO_KV for q in self._queues.values() for j in q), "a waiting request holds memory"
        assert {t: n for t, n in self.held.items() if n} == {t: n for t, n in per.items() if n}, \
            f"tenant accounting {self.held} != blocks held by their requests {per}"
        for t, q in self.config.quotas.items():
            assert self.held.get(t, 0) <= q, f"tenant {t} holds {self.held[t]} blocks, quota {q}"

    # -------------------------------------------------------------------------------- requests given
    @staticmethod
    def _requests(requests: Any) -> list[Request]:
        """``requests`` in arrival order (ties by id), or :class:`ConfigError` for what is no iterable of them."""
        try:
            reqs = list(requests)
        except TypeError:
            raise ConfigError(f"expected a Workload or an iterable of Requests, got {requests!r}") from None
        odd = [r for r in reqs if not isinstance(r, Request)]
        if odd:
            raise ConfigError(f"the engine runs Request objects, got {odd[0]!r}")
        return sorted(reqs, key=lambda r: (r.arrival, r.id))

    def _refuse_impossible(self, reqs: list[Request], known: set[int]) -> None:
        """:class:`ConfigError` for an id given twice (here, or already in ``known``) and for requests that could
        never finish: longer than ``max_model_len``, or needing more blocks than their tenant may ever
        hold: its quota, and the pool less every other tenant's reservation (a contiguous region of
        ``max_model_len`` tokens, or of exactly its length, counts as the blocks it spans). Admitted, such a request
        would wait (or be preempted and readmitted) forever."""
        cfg = self.config
        seen, again = set(known), []
        for r in reqs:
            if r.id in seen:
                again.append(r.id)
            seen.add(r.id)
        if again:
            raise ConfigError(f"request ids {again[:5]} are given more than once")
        too_long = [r.id for r in reqs if r.total_len > cfg.max_model_len]
        if too_long:
            raise ConfigError(f"requests {too_long[:5]} exceed max_model_len={cfg.max_model_len} tokens")
        vocab = self.model.cfg.vocab_size if self.model is not None else None
        past = [r.id for r in reqs if vocab is not None and _top_token(r) >= vocab]
        if past:  # found now, not mid-step after the request left its queue
            raise ConfigError(f"requests {past[:5]} hold prompt token ids past the model's vocabulary "
                              f"({vocab} ids)")
        reserved = sum(cfg.reservations.values())
        cap = {t: min(cfg.num_blocks - reserved + cfg.reservations.get(t, 0), cfg.quotas.get(t, cfg.num_blocks))
               for t in dict.fromkeys(r.tenant for r in reqs)}
        fixed = cfg.max_model_len if cfg.memory == "contiguous" else None  # every region is max_model_len long
        never = [r.id for r in reqs if -(-(fixed or r.total_len) // cfg.block_size) > cap[r.tenant]]
        if never:
            what = f"a region of max_model_len={fixed} tokens" if fixed else "its tokens"
            raise ConfigError(f"requests {never[:5]} need more blocks than their tenant may ever hold ({what} at "
                              f"{cfg.block_size} tokens a block; the most a tenant may hold is its quota, and the "
                              f"pool less the other tenants' reservations: {cap})")

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
            q.append(Job(r, rec))

    def _schedule(self) -> list[tuple[Job, int]]:
        cfg, mem = self.config, self.memory
        budget, bs = cfg.max_batched_tokens, cfg.block_size
        batch: list[tuple[Job, int]] = []
        earlier = len(self.swapped)  # a request this step's placement swaps out comes back in a later step
        # Decode tokens first (they keep TPOT low), then continuing prompt chunks.
        for job in sorted(self.running, key=lambda j: len(j.tokens) - j.kv.num_tokens > 1):
            if job.state != RUNNING or not budget:
                continue
            n = min(len(job.tokens) - job.kv.num_tokens, budget)
            need = mem.blocks_for(job, n) if n > -job.kv.num_tokens % bs else 0  # past its last block's free slots
            if need:
                try:
                    self._promise(job, need)
                except _Preempt:
                    continue
            batch.append((job, n))
            budget -= n
        # Preempting a later request may have removed one already placed in the batch.
        batch = [(j, n) for j, n in batch if j.state == RUNNING]
        budget = cfg.max_batched_tokens - sum(n for _, n in batch)
        while earlier and len(self.running) < cfg.max_num_seqs:  # (swapping it straight back in made no progress)
            earlier -= 1
            job = self.swapped.popleft()
            if self._fits(job.req.tenant, mem.swap_need(job)):
                self._sync_in += self._swap_in(job, prefetched=False)
            elif not self.running:  # only swapped requests hold memory: this one is recomputed instead
                self._requeue(job)
                self._event(Preempted(self._now(), self.step_count, job.req.id, job.req.tenant,
                                      "recompute", job.counted, "swapped requests hold the memory it needs"))
                self._account(job)
            else:
                self.swapped.appendleft(job)
                break
        if not self.swapped:
            self._admit(batch, budget)
        return batch

    def _admit(self, batch: list[tuple[Job, int]], budget: int) -> None:
        cfg, mem, tried = self.config, self.memory, 0
        wait_shared = cfg.prefix_caching and cfg.shared_prefill == "wait"
        while budget and len(self.running) < cfg.max_num_seqs and tried < len(self._rr):
            tenant = self._rr[0]
            self._rr.rotate(-1)
            q = self._queues[tenant]
            if not q:
                tried += 1
                continue
            job = q[0]
            if not job.tokens:  # its turn has come: build its prompt
                job.tokens = mem.prompt_ids(job.req)
            # Price the hits only when the memory's bound on what admission takes does not fit (a cache walk
            # hashes every full block of the prompt).
            hits: list[int] | None = None
            if not self._fits(tenant, mem.admission_bound(job)):
                hits = mem.lookup(job)
                n = min(len(job.tokens) - len(hits) * cfg.block_size, budget)
                if not self._fits(tenant, mem.admission_need(job, hits, n)):
                    tried += 1
                    continue
            if wait_shared and mem.prefill_in_flight(job, self.running, hits):
                tried += 1  # its next prompt block is being computed: take it as a hit next step
                continue
            tried = 0
            q.popleft()
            mem.admit(job)
            cached = job.kv.num_tokens
            n = min(len(job.tokens) - cached, budget)
            if self.caching:
                self._count_lookup(job, cached)
            job.state = RUNNING
            self.running.append(job)
            job.pending = mem.blocks_for(job, n)
            self.promised += job.pending
            self._account(job)
            batch.append((job, n))
            budget -= n
            if self.events:
                self.events.publish(Admitted(self._now(), self.step_count, job.req.id, tenant, cached))

    def _fits(self, tenant: str, need: int) -> bool:
        """Whether ``tenant`` may take ``need`` more blocks: within its quota, and leaving every other tenant's
        unused reservation and this step's promises untouched."""
        cfg = self.config
        quota = cfg.quotas.get(tenant)
        if quota is not None and self.held.get(tenant, 0) + need > quota:
            return False
        owed = sum(max(0, r - self.held.get(t, 0)) for t, r in cfg.reservations.items() if t != tenant)
        return need <= self.memory.available() - self.promised - owed

    def _promise(self, job: Job, need: int) -> None:
        """Promise ``need`` blocks to running ``job`` for this step, preempting victims as the rule says;
        raises :class:`_Preempt` when ``job`` itself had to go."""
        tenant = job.req.tenant
        while not self._fits(tenant, need):
            victim = self._victim(tenant, job, need)
            self._preempt(victim, "quota" if tenant in self.config.quotas and victim.req.tenant == tenant
                          else "out of blocks")
            if victim is job:
                raise _Preempt
        job.pending += need
        self.promised += need
        self._account(job)

    def _victim(self, tenant: str, asking: Job, need: int) -> Job:
        """The documented rule: the tenant furthest above its reservation (the asking tenant always qualifies;
        under its own quota only its own requests do) loses its most recently admitted running request."""
        cfg = self.config
        quota = cfg.quotas.get(tenant)
        own_quota = quota is not None and self.held.get(tenant, 0) + need > quota
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
        mem = self.memory
        blocks = job.counted
        self.promised -= job.pending
        job.pending = 0
        mode = self.config.preemption
        if mode == "swap" and not mem.swappable(job):
            mode = "recompute"  # all it holds is shared or cached: a swap would free nothing
        if mode == "swap":
            self._sync_out += mem.swap_out(job)
            job.state = SWAPPED
            self.swapped.append(job)
        else:
            self._requeue(job)
        self._account(job)
        job.rec.preemptions += 1
        self.preemptions += 1
        self._event(Preempted(self._now(), self.step_count, job.req.id, job.req.tenant, mode, blocks, reason))

    def _requeue(self, job: Job) -> None:
        """Recompute ``job`` later: free its memory (registered blocks stay cached for its return) and put it
        first in its tenant's queue."""
        self.memory.release(job)
        job.state = WAITING
        self._queues[job.req.tenant].appendleft(job)

    def _now(self) -> int:
        """The memory's clock, which every event carries as ``step`` (the engine step is ``engine_step``)."""
        return self.memory.clock.now()

    def _event(self, event: Event) -> None:
        if self.events:
            self.events.publish(event)

    def _swap_in(self, job: Job, prefetched: bool) -> int:
        tokens = self.memory.swap_in(job)
        job.state = RUNNING
        self.running.append(job)
        self._account(job)
        self.swap_ins += 1
        self.prefetched_ins += prefetched
        if self.events:
            self.events.publish(SwappedIn(self._now(), self.step_count, job.req.id, self.memory.held(job),
                                          prefetched))
        return tokens

    def _prefetch(self) -> None:
        """Bring swapped requests back ahead of need while blocks are free (the copy overlaps the next step)."""
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            job = self.swapped[0]
            # Keep one block per running request free for its next decode token.
            if not self._fits(job.req.tenant, self.memory.swap_need(job) + len(self.running)):
                return
            self.swapped.popleft()
            self._async_in += self._swap_in(job, prefetched=True)

    def _account(self, job: Job) -> None:
        """Tenant bookkeeping: ``job`` is now charged what it holds plus what it was promised."""
        t, now = job.req.tenant, self.memory.held(job) + job.pending
        self.held[t] = self.held.get(t, 0) + now - job.counted
        job.counted = now

    # -------------------------------------------------------------------------------- completion and metrics
    def _complete(self, batch: list[tuple[Job, int]], next_ids: list[int] | None) -> None:
        """After the batch ran (the memory counted its tokens): sample where a request's known tokens are all in
        the KV, and finish the requests that are done."""
        step, now, mem = self.step_count, self.now_s, self.memory
        for i, (job, _) in enumerate(batch):
            if job.kv.num_tokens < len(job.tokens):
                continue
            rec, stopped, generated = job.rec, False, len(job.tokens) - job.req.prompt_len
            if generated < job.req.output_len:
                token = next_ids[i] if next_ids is not None else (job.req.id * 7919 + generated) % 32000
                if rec.first_step < 0:
                    rec.first_step, rec.first_s = step, now
                stopped = token == self.eos  # the model ended its turn: done, and the end token is not kept
                if not stopped:
                    job.tokens.append(token)
                    generated += 1
            if stopped or generated == job.req.output_len:
                if rec.first_step < 0:  # nothing to generate: the prompt's last step is its first "token"
                    rec.first_step, rec.first_s = step, now
                rec.output_len = generated  # what it generated: fewer than asked when the model stopped
                rec.finish_step, rec.finish_s = step, now
                self.outputs[job.req.id] = job.tokens[job.req.prompt_len:]
                self.running.remove(job)
                mem.release(job)
                self._account(job)
                job.state = FINISHED
                self.finished_count += 1
                if self.events:
                    self.events.publish(Finished(self._now(), step, job.req.id, job.req.tenant, rec.ttft_s,
                                                 rec.tpot_s))

    def _count_lookup(self, job: Job, cached: int) -> None:
        """An admission's prefix-cache lookup: a first one is a query with ``cached`` hits; a readmission after a
        preemption (vLLM's preempted_queries and preempted_hits) finds the request's own blocks again."""
        if job.rec.preemptions:
            self.preempted_query_tokens += len(job.tokens)
            self.preempted_hit_tokens += cached
            job.rec.preempted_hit_tokens += cached
        else:
            self.prefix_query_tokens += len(job.tokens)
            self.prefix_hit_tokens += cached
            job.rec.prefix_hit_tokens = cached

    def _record(self, prefill: int, decode: int, stall: float) -> None:
        mem = self.memory
        g = mem.gauges()
        hit_rate = self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        m = StepMetrics(self._now(), self.step_count, self.now_s, len(self.running), self.num_waiting,
                        len(self.swapped), prefill, decode, mem.capacity_slots, g.reserved_slots, g.token_slots,
                        g.fragmentation, g.evictions, self.preemptions, hit_rate, self.finished_count,
                        tuple(sorted((t, n) for t, n in self.held.items() if n)), stall, g.used_slots,
                        g.used_tokens, self.prefix_query_tokens, self.prefix_hit_tokens)
        self.log.steps.append(m)
        if self.events:
            self.events.publish(m)


def _top_token(r: Request) -> int:
    """The largest token id of ``r``'s prompt without building it (prompts are built at admission): given ids,
    or those its hash ids make (``h * HASH_BLOCK + offset``); ids derived from a vocabulary fit it by making."""
    if r.prompt_tokens is not None:
        return max(r.prompt_tokens)
    if r.hash_ids is not None:
        last = r.prompt_len - (len(r.hash_ids) - 1) * HASH_BLOCK  # tokens in the last hash block
        return max((h + 1) * HASH_BLOCK - 1 if i < len(r.hash_ids) - 1 else h * HASH_BLOCK + last - 1
                   for i, h in enumerate(r.hash_ids))
    return -1


class _Preempt(Exception):
    """Internal: the request being scheduled was itself chosen as the victim."""


def run_workload(workload: Workload, **config: Any) -> dict[str, Any]:
    """Convenience: run ``workload`` to the end with an :class:`EngineConfig` built from ``config``."""
    try:
        return Engine(workload, EngineConfig(**config)).run()
    except TypeError as e:
        raise ConfigError(f"unknown engine setting: {e}") from None


__all__ = ["Engine", "run_workload"]
