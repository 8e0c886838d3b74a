"""The memory behind the engine: one protocol (:class:`Memory`), answered by the paged KV cache and the baseline.

The scheduler (:class:`~kvlab.serve.engine.Engine`) never touches a block or a region. It asks its memory what
admitting a request would take, and to admit, run, swap and release it; a job holds only ``kv``, what its memory
gave it (see :mod:`kvlab.serve.job`). Counts are in blocks on both memories (a contiguous region counts as the
blocks it spans), so quotas and reservations mean the same on each. Two memories answer:

* :class:`PagedMemory`: fixed-size blocks of a :class:`~kvlab.BlockPool`, one :class:`~kvlab.core.sequence.Sequence`
  (a block table) per request and a :class:`~kvlab.core.prefix.PrefixCache` for shared prompts. A request takes a
  block only when its last one is full, so memory follows the tokens actually produced;
* :class:`ContiguousMemory`: the pre-paging baseline, one region of an arena per request, reserved up front
  (``max_model_len`` slots, or exactly its length) and never grown, so a request never needs memory later.

Invariants (:meth:`Memory.check_invariants`, given the jobs that hold memory): the memory's records are exactly
those jobs' (no sequence or region outlives its request), each job's ``kv`` holds the first ``kv.num_tokens`` of
its tokens, and the structures underneath (pool, sequences, arena) pass their own checks.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast

import torch

from kvlab.memory.baseline import ContiguousAllocator
from kvlab.core.clock import Clock, LogicalClock
from kvlab.core.errors import ConfigError
from kvlab.core.events import EventBus
from kvlab.core.eviction import FutureUses, OPTPolicy
from kvlab.memory.fragmentation import unusable_free_percent
from kvlab.serve.metrics import BlockLifetimes, distribution
from kvlab.fast import choose
from kvlab.core.prefix import PrefixCache
from kvlab.core.sequence import Sequence, SwapState
from kvlab.core.spec import KVSpec
from kvlab.workloads.mixes import Request
from kvlab.serve.config import EngineConfig
from kvlab.serve.job import NO_KV, Job


class Gauges(NamedTuple):
    """A memory at the end of a step, as :class:`~kvlab.serve.metrics.StepMetrics` records it."""
    reserved_slots: int  # slots no new request can take (cached blocks count)
    token_slots: int  # tokens in them
    fragmentation: float  # free memory no request can use, in [0, 1]
    used_slots: int  # slots of the blocks (or regions) requests hold
    used_tokens: int  # tokens in them
    evictions: int  # cached blocks evicted so far


class Memory(Protocol):
    """What the scheduler asks of a memory, and nothing more."""
    events: EventBus  # where the memory's own events go; the engine publishes on it too
    clock: Clock  # stamps every event (``step``)
    capacity_slots: int

    def prompt_ids(self, req: Request) -> list[int]:
        """The ids ``req``'s prompt is fed as (labels in metadata mode; zeros where only counts matter)."""

    def available(self) -> int:
        """Blocks an admission or a growth may take now."""

    def held(self, job: Job) -> int:
        """Blocks ``job`` holds (0 when it holds none)."""

    def blocks_for(self, job: Job, n: int) -> int:
        """New blocks ``n`` more tokens of resident ``job`` need: none while they fit the free slots of the block
        its tokens reach (``-kv.num_tokens % block_size``), which the scheduler checks before asking."""

    def lookup(self, job: Job) -> list[int]:
        """The prefix cache's blocks for ``job``'s prompt, taken by nothing yet."""

    def admission_bound(self, job: Job) -> int:
        """At most what admitting ``job`` takes, known without a cache lookup."""

    def admission_need(self, job: Job, hits: list[int], n: int) -> int:
        """What admitting ``job`` with its first ``n`` tokens to compute takes from :meth:`available`."""

    def prefill_in_flight(self, job: Job, running: Iterable[Job], hits: list[int] | None = None) -> bool:
        """Whether waiting a step would turn the next block of ``job``'s prompt into a cache hit."""

    def admit(self, job: Job) -> None:
        """Give ``job`` its ``kv`` (holding the cached prefix of its prompt, if any)."""

    def execute(self, batch: list[tuple[Job, int]]) -> torch.Tensor | None:
        """Append each ``(job, n)``'s next ``n`` tokens; in real mode the logits of every row's last token."""

    def release(self, job: Job) -> None:
        """Free what ``job`` holds (its ``kv`` becomes ``NO_KV``)."""

    def swappable(self, job: Job) -> int:
        """Blocks swapping resident ``job`` out would free."""

    def swap_out(self, job: Job) -> int:
        """Move ``job``'s private blocks to host memory; returns the tokens copied."""

    def swap_need(self, job: Job) -> int:
        """Blocks swapping ``job`` back in takes."""

    def swap_in(self, job: Job) -> int:
        """Bring ``job``'s blocks back from host memory; returns the tokens copied."""

    def gauges(self) -> Gauges:
        """The gauges right now."""

    def summary(self) -> dict[str, Any]:
        """The memory's own figures for the engine's summary."""

    def check_invariants(self, jobs: Collection[Job]) -> None:
        """Raise AssertionError unless the memory holds exactly what ``jobs`` (all that hold memory) hold."""


# ---------------------------------------------------------------------------------------------------- paged
class PagedMemory:
    """The paged KV cache: a :class:`~kvlab.BlockPool` (metadata-only unless a model runs), a
    :class:`~kvlab.SequenceManager` whose sequences are the jobs' ``kv``, and a :class:`~kvlab.PrefixCache`.
    With ``policy="opt"`` the pool evicts by Belady's rule, with the prompts of ``requests`` as its future."""

    def __init__(self, cfg: EngineConfig, model: Any = None, requests: Iterable[Request] = ()) -> None:
        spec = (model.cfg.kv_spec(cfg.block_size, model.dtype, model.device) if model is not None
                else KVSpec(block_size=cfg.block_size))
        self.vocab = model.cfg.vocab_size if model is not None else None  # metadata mode: ids are labels
        self.future: FutureUses | None = None
        policy: str | OPTPolicy = cfg.policy
        if cfg.policy == "opt":  # Belady's: the whole workload's prompts, hashed as the cache will look them up
            reqs = list(requests)
            self.future = PrefixCache.future_uses([r.prompt_token_ids(self.vocab) for r in reqs], cfg.block_size,
                                                  [r.tenant for r in reqs])
            self.arrival_index = {r.id: i for i, r in enumerate(reqs)}
            policy = OPTPolicy(self._next_use)
        fast = choose()  # the fast twins (KVLAB_REFERENCE names parts to run on the reference instead)
        self.pool = fast.pool(cfg.num_blocks, spec=spec, eviction_policy=policy, with_storage=model is not None)
        self.manager = fast.manager(self.pool, prefix_cache=fast.prefix_cache(self.pool) if cfg.prefix_caching
                                    else None)
        self.cache: PrefixCache | None = self.manager.prefix_cache
        self.lifetimes = BlockLifetimes(self.pool)
        self.events, self.clock = self.pool.events, self.pool.clock
        self.model, self.bs = model, cfg.block_size
        self.track_ids = self.cache is not None or model is not None  # else only counts matter
        self.capacity_slots = cfg.num_blocks * cfg.block_size

    @staticmethod
    def sequence(job: Job) -> Sequence:
        """``job``'s sequence: its ``kv`` once admitted, until released."""
        seq = job.kv
        assert isinstance(seq, Sequence), f"request {job.req.id} holds no sequence"
        return seq

    def prompt_ids(self, req: Request) -> list[int]:
        return req.prompt_token_ids(self.vocab) if self.track_ids else [0] * req.prompt_len

    def available(self) -> int:
        """Blocks FREE or cached (evictable)."""
        return self.pool.num_free_blocks + self.pool.num_cached_blocks

    def held(self, job: Job) -> int:
        """Pool blocks ``job`` holds a reference to (its resident table entries)."""
        seq = job.kv
        if not isinstance(seq, Sequence):
            return 0
        return len(seq.block_table) - (len(seq.swapped.positions) if seq.swapped is not None else 0)

    def blocks_for(self, job: Job, n: int) -> int:
        """The last block's free slots come first."""
        seq = job.kv
        assert isinstance(seq, Sequence), f"request {job.req.id} holds no sequence"
        return max(0, -(-(seq.num_tokens + n) // self.bs) - len(seq.block_table))

    # -------------------------------------------------------------------------------- admission
    def lookup(self, job: Job) -> list[int]:
        """Cached blocks of ``job``'s prompt (full blocks; one token at least stays to compute, since the step
        that computes it yields the first output token). Nothing is taken yet."""
        if self.cache is None:
            return []
        return self.cache.peek(job.tokens, job.req.tenant, (len(job.tokens) - 1) // self.bs)

    def admission_bound(self, job: Job) -> int:
        """Its whole prompt's blocks."""
        return -(-len(job.tokens) // self.bs)

    def admission_need(self, job: Job, hits: list[int], n: int) -> int:
        """New blocks, plus the cached hits that leave the evictable set once referenced."""
        refs = self.pool.fields.refcount
        revived = sum(1 for b in hits if not refs[b])
        return -(-(len(hits) * self.bs + n) // self.bs) - len(hits) + revived

    def prefill_in_flight(self, job: Job, running: Iterable[Job], hits: list[int] | None = None) -> bool:
        """Whether a running request of ``job``'s tenant is still computing the prompt block that follows
        ``job``'s cached prefix (so that waiting a step turns that block into a hit). Same chain, same block:
        the other holds ``job``'s last hit block at the same position (or neither has a hit) and the next block's
        tokens agree. ``hits``: :meth:`lookup` of ``job`` if the caller has it already."""
        B = self.bs
        others = [o for o in running if o.req.tenant == job.req.tenant and o.kv.num_tokens < o.req.prompt_len]
        if self.cache is None or not others:
            return False
        hits = self.lookup(job) if hits is None else hits
        k = len(hits)
        if k >= (len(job.tokens) - 1) // B:
            return False  # its cached prefix already covers every block it may take from the cache
        nxt = job.tokens[k * B:(k + 1) * B]
        for o in others:
            table = self.sequence(o).block_table
            if o.kv.num_tokens < (k + 1) * B <= o.req.prompt_len \
                    and (k == 0 or (len(table) >= k and table[k - 1] == hits[-1])) \
                    and o.tokens[k * B:(k + 1) * B] == nxt:
                return True
        return False

    def _next_use(self, block_id: int) -> float:
        """OPT's oracle: when the cached prefix ``block_id`` holds is next looked up (inf: never)."""
        digest = self.cache.digest_of(block_id) if self.cache is not None else None
        return math.inf if digest is None or self.future is None else self.future.next_use(digest)

    def admit(self, job: Job) -> None:
        """A new sequence; its prompt's cached prefix is referenced, not recomputed."""
        if self.future is not None:  # OPT's clock: the request being admitted (a re-admission changes nothing)
            self.future.advance(max(self.future.request, self.arrival_index[job.req.id]))
        job.kv = self.manager.create(job.tokens if self.cache is not None else None, tenant=job.req.tenant)

    # -------------------------------------------------------------------------------- the batch
    def execute(self, batch: list[tuple[Job, int]]) -> torch.Tensor | None:
        """Append this step's tokens, taking the promised blocks in one allocation. Real mode runs the model
        through the paged cache and returns the logits of every row's last token; metadata mode only counts."""
        seqs = cast(list[Sequence], [j.kv for j, _ in batch])  # resident: admitted and not swapped out
        feeds: list[Any] = ([j.tokens[s.num_tokens:s.num_tokens + n] for (j, n), s in zip(batch, seqs)]
                            if self.track_ids else [n for _, n in batch])
        if self.model is not None:  # the model appends and registers full blocks itself
            return self.model.step(self.manager, seqs, feeds)
        # Register the blocks a prefill fills; a decode's wait for the release.
        bs = self.bs
        fills = [s for (j, n), s in zip(batch, seqs) if s.cacheable and (s.num_tokens + n) // bs > s.cached_blocks
                 and not j.decodes(n)] if self.cache is not None else []
        self.manager.append_tokens(seqs, feeds)
        for seq in fills:
            self.manager.cache_full_blocks(seq)
        return None

    def release(self, job: Job) -> None:
        """Free ``job``'s sequence, tail first: private blocks become FREE, registered ones stay cached. Its
        full blocks of generated tokens are registered now (SGLang inserts a request's decoded tokens when it
        finishes too): until then nobody else could hit them, since nobody else has generated those tokens."""
        seq = job.kv
        if isinstance(seq, Sequence):
            if self.cache is not None and self.model is None and seq.cacheable and seq.swapped is None \
                    and seq.num_tokens // self.bs > seq.cached_blocks:
                self.manager.cache_full_blocks(seq)
            self.manager.free(seq)
            job.kv = NO_KV

    def swappable(self, job: Job) -> int:
        """Those it holds alone and no cache names."""
        return len(self.manager.swappable(self.sequence(job)))

    def swap_out(self, job: Job) -> int:
        """Copy the blocks ``job`` holds alone to host memory and free them."""
        self.manager.swap_out(self.sequence(job))
        return sum(self._swap_state(job).tokens)

    def swap_need(self, job: Job) -> int:
        return len(self._swap_state(job).positions)

    def swap_in(self, job: Job) -> int:
        """Into fresh blocks."""
        tokens = sum(self._swap_state(job).tokens)
        self.manager.swap_in(self.sequence(job))
        return tokens

    def _swap_state(self, job: Job) -> SwapState:
        swapped = self.sequence(job).swapped
        assert swapped is not None, f"request {job.req.id} is not swapped out"
        return swapped

    # -------------------------------------------------------------------------------- gauges
    def gauges(self) -> Gauges:
        """Cached blocks count as reserved, and their tokens as held. No pass over the pool: a cached block is
        registered, hence full."""
        pool, bs = self.pool, self.bs
        used_slots, used_tokens = self._usage()
        frag = unusable_free_percent(pool) / 100 if pool.max_order else 0.0  # one size: none, by construction
        return Gauges((pool.num_blocks - pool.num_free_blocks) * bs, used_tokens + pool.num_cached_blocks * bs, frag,
                      used_slots, used_tokens, pool.counts["evictions"])

    def _usage(self) -> tuple[int, int]:
        """(slots of the blocks requests hold, tokens in them), from the sequences in O(sequences): summing their
        resident tokens counts a block shared by k sequences k times, and every shared block is full (sharing
        comes from prefix hits), so each extra reference is one block's worth too many."""
        pool, refs, tokens = self.pool, 0, 0
        for seq in self.manager.seqs.values():
            refs += len(seq.block_table)
            tokens += seq.num_tokens
            if seq.swapped is not None:  # what went to the host is not in the pool
                refs -= len(seq.swapped.positions)
                tokens -= sum(seq.swapped.tokens)
        used = pool.num_blocks - pool.num_free_blocks - pool.num_cached_blocks
        return used * self.bs, tokens - (refs - used) * self.bs

    def summary(self) -> dict[str, Any]:
        """Block lifetimes and, with a prefix cache, its reuse gaps, in pool clock ticks (see
        :mod:`kvlab.serve.metrics`)."""
        out: dict[str, Any] = self.lifetimes.summary()
        if self.cache is not None:
            out.update(distribution(self.cache.reuse_gaps, "reuse_gap", "ticks"))
        return out

    def check_invariants(self, jobs: Collection[Job]) -> None:
        self.manager.check_invariants()
        seqs = self.manager.seqs
        assert len(seqs) == len(jobs) and all(seqs.get(self.sequence(j).seq_id) is j.kv for j in jobs), \
            f"{len(seqs)} live sequences for {len(jobs)} requests holding memory"
        for j in jobs:
            ids = self.sequence(j).token_ids
            assert ids is None or ids == j.tokens[:j.kv.num_tokens], f"request {j.req.id}: the KV holds other tokens"


# ---------------------------------------------------------------------------------------------------- contiguous
@dataclass(slots=True, eq=False)
class Region:
    """What the contiguous memory holds for a request: its region of the arena (start and length are the arena's
    ``regions[req.id]``), whose first ``num_tokens`` slots hold K/V."""
    num_tokens: int = 0


class ContiguousMemory:
    """The engine's memory when ``EngineConfig.memory == "contiguous"``: every admitted request reserves
    ``max_model_len`` contiguous slots of a :class:`~kvlab.ContiguousAllocator` up front (its output length is
    unknown), so it never grows, never needs a block later and is never preempted; admission waits until a long
    enough free run exists. Metadata only. With ``memory == "contiguous-exact"`` a request reserves exactly its
    prompt plus output length instead: an oracle that knows the output length, the strongest contiguous baseline
    (the PagedAttention paper's "Orca (Oracle)"); only external fragmentation is left."""

    def __init__(self, cfg: EngineConfig, model: Any = None) -> None:
        if model is not None:
            raise ConfigError("the contiguous baseline runs metadata-only: pass no model")
        self.bs, self.max_len = cfg.block_size, cfg.max_model_len
        self.exact = cfg.memory == "contiguous-exact"
        self.arena = ContiguousAllocator(cfg.num_blocks * cfg.block_size)
        self.capacity_slots = self.arena.capacity
        self.events = EventBus()
        self.clock: Clock = LogicalClock()  # ticks per reservation and release
        self._tokens = 0  # K/V tokens in all regions: their num_tokens summed as they change

    def slots_for(self, job: Job) -> int:
        """The slots ``job``'s region reserves: the context limit, or (exact) its own prompt + output length."""
        return job.req.total_len if self.exact else self.max_len

    def span(self, job: Job) -> int:
        """Blocks' worth of slots ``job``'s region spans."""
        return -(-self.slots_for(job) // self.bs)

    def prompt_ids(self, req: Request) -> list[int]:
        return [0] * req.prompt_len

    def available(self) -> int:
        """Blocks' worth of slots in the longest free run: only a contiguous run can take a request."""
        return self.arena.largest_free // self.bs

    def held(self, job: Job) -> int:
        return self.span(job) if isinstance(job.kv, Region) else 0

    def blocks_for(self, job: Job, n: int) -> int:
        return 0  # its region holds every token it will have

    def lookup(self, job: Job) -> list[int]:
        return []

    def admission_bound(self, job: Job) -> int:
        return self.span(job)

    def admission_need(self, job: Job, hits: list[int], n: int) -> int:
        return self.span(job)

    def prefill_in_flight(self, job: Job, running: Iterable[Job], hits: list[int] | None = None) -> bool:
        return False  # nothing is cached: waiting never turns into a hit

    def admit(self, job: Job) -> None:
        self.arena.reserve(job.req.id, self.slots_for(job))
        self.clock.tick()
        job.kv = Region()

    def execute(self, batch: list[tuple[Job, int]]) -> None:
        added = 0
        for job, n in batch:
            job.kv.num_tokens += n
            added += n
        self._tokens += added

    def release(self, job: Job) -> None:
        if isinstance(job.kv, Region):
            self.arena.release(job.req.id)
            self.clock.tick()
            self._tokens -= job.kv.num_tokens
            job.kv = NO_KV

    def swappable(self, job: Job) -> int:
        return 0

    def swap_out(self, job: Job) -> int:
        raise ConfigError(f"request {job.req.id}: the contiguous baseline never preempts (its regions never grow)")

    swap_in = swap_out

    def swap_need(self, job: Job) -> int:
        return 0

    def gauges(self) -> Gauges:
        """Every reserved slot is used: a region is its request's alone; nothing is cached or evicted."""
        reserved = self.arena.reserved
        return Gauges(reserved, self._tokens, self.arena.fragmentation(), reserved, self._tokens, 0)

    def summary(self) -> dict[str, Any]:
        return {}

    def check_invariants(self, jobs: Collection[Job]) -> None:
        self.arena.check_invariants()
        regions = self.arena.regions
        assert len(regions) == len(jobs) and all(isinstance(j.kv, Region) and j.req.id in regions
                                                 and regions[j.req.id][1] == self.slots_for(j) for j in jobs), \
            f"{len(regions)} regions for {len(jobs)} requests holding memory"
        assert self._tokens == sum(j.kv.num_tokens for j in jobs), f"token count {self._tokens} drifted"


__all__ = ["ContiguousMemory", "Gauges", "Memory", "PagedMemory", "Region"]
