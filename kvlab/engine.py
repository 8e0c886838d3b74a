"""The serving engine: continuous batching over a block pool, many tenants, long sequences (text §2.2.6).

§2.2.6 lists what a serving system built on fixed-size blocks should do for many users (thread safety,
isolation between users, reclaiming a user's memory when they leave, monitoring) and for long sequences
(splitting them into blocks, caching common blocks, managing memory so it never overflows, prefetching).
:class:`Engine` does each of these on a :class:`~kvlab.BlockPool` and measures the outcome. Every request is a
:class:`~kvlab.sequence.Sequence` of a :class:`~kvlab.sequence.SequenceManager` (block tables, swap) with a
:class:`~kvlab.prefix.PrefixCache` (hash chains); the engine only decides *who* runs and *who* yields.

One step of :meth:`Engine.step`:

1. **arrivals** whose time has come join their tenant's queue (when nothing runs, the clock jumps to the next);
2. **running** requests get their tokens first: one decode token each, then the next chunk of an unfinished
   prompt (chunked prefill: at most ``max_batched_tokens`` per step in all). The blocks a request will need
   are *promised* here (preempting victims if they cannot be) and taken when the batch runs, in one allocation;
3. **swapped** requests come back next (oldest first), before any new request, so none starves;
4. **waiting** requests are admitted round-robin over tenants while sequences, tokens and blocks last
   (a prefix-cache hit skips the cached part of the prompt; :meth:`PrefixCache.peek` prices it first);
5. the batch runs: metadata mode appends token counts (:meth:`SequenceManager.append_tokens`), real mode runs
   the model through the paged KV tensor (:meth:`Llama.step <kvlab.model.Llama.step>`) and samples each
   request's next token (:func:`kvlab.chat.sample`: greedy, or temperature and top-p with a seeded generator);
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

**Time.** Steps are counted; seconds come from :class:`CostModel` in metadata mode (an explicit, stated
assumption: ``summary()["clock"]`` says ``"simulated"``) and from the wall clock in real mode (``"wall"``).
Copies to and from host memory at preemption or at an on-demand swap-in stall the step. A *prefetched* swap-in
(end of the previous step) overlaps the next step's compute and stalls only by what it takes longer than that
compute: this is the effect of prefetching, measured as ``swap_in_stall_s`` (and ``swap_stall_s``, which adds
swap-outs) with and without it.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .baseline import ContiguousMemory
from .chat import check_temperature, check_top_p, sample
from .checks import check_choice, check_flag, check_positive, check_real, check_seed, is_int
from .errors import ConfigError
from .events import EngineEvent, Event
from .fragmentation import unusable_free_percent
from .eviction import POLICIES, FutureUses, OPTPolicy
from .metrics import BlockLifetimes, MetricsLog, RequestRecord, StepMetrics, distribution, format_table
from .model import Llama
from .perf import FastBlockPool, FastSequenceManager
from .prefix import PrefixCache
from .sequence import Sequence, SwapState
from .spec import KVSpec
from .workloads import Request, Workload

WAITING, RUNNING, SWAPPED, FINISHED = "waiting", "running", "swapped", "finished"


# ---------------------------------------------------------------------------------------------------- events
@dataclass(slots=True)
class Admitted(EngineEvent):
    """A request entered the running batch; ``cached_tokens`` of its prompt came from the prefix cache."""
    request_id: int
    tenant: str
    cached_tokens: int


@dataclass(slots=True)
class Preempted(EngineEvent):
    """A running request lost its blocks: ``mode`` is ``"recompute"`` or ``"swap"``; ``blocks`` it held."""
    request_id: int
    tenant: str
    mode: str
    blocks: int
    reason: str


@dataclass(slots=True)
class SwappedIn(EngineEvent):
    """A swapped request's ``blocks`` came back; ``prefetched`` when it happened ahead of need."""
    request_id: int
    blocks: int
    prefetched: bool


@dataclass(slots=True)
class Finished(EngineEvent):
    """A request produced its last token and released its blocks."""
    request_id: int
    tenant: str
    ttft_s: float
    tpot_s: float


@dataclass(slots=True)
class TenantReclaimed(EngineEvent):
    """A tenant left: ``requests`` were aborted and ``blocks`` returned to the pool."""
    tenant: str
    requests: int
    blocks: int


# ---------------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class CostModel:
    """Simulated seconds of one step: ``base_s + token_s * tokens + context_s * context`` of compute, plus
    ``swap_token_s`` per token copied between host and device where the copy stalls the step.

    ``tokens`` are the tokens computed this step, ``context`` the cached tokens attention reads. The defaults
    are an assumption in the range of a 7B model on one data-centre GPU (5 ms fixed, 40 µs per computed token,
    0.5 µs per token read, 20 µs per token swapped); change them and the absolute figures change, the
    comparisons much less."""
    base_s: float = 5e-3
    token_s: float = 4e-5
    context_s: float = 5e-7
    swap_token_s: float = 2e-5

    def __post_init__(self) -> None:
        for name in ("base_s", "token_s", "context_s", "swap_token_s"):
            object.__setattr__(self, name, check_real(getattr(self, name), f"CostModel.{name}", lo=0,
                                                      unit=" of seconds"))

    def step_s(self, tokens: int, context: int) -> float:
        return self.base_s + self.token_s * tokens + self.context_s * context

    def swap_s(self, tokens: int) -> float:
        return self.swap_token_s * tokens


@dataclass
class EngineConfig:
    """Engine settings. ``memory="contiguous"`` runs the pre-paging baseline (max-length regions) instead;
    ``memory="contiguous-exact"`` the same with regions of exactly each request's prompt + output length.

    ``shared_prefill`` says what a waiting request does when the block of its prompt that follows its cached
    prefix is being computed right now by a running request (two users sending the same long document within a
    second): ``"wait"`` (default) leaves it queued until that block is cached, then takes it as a hit, so nothing is
    computed twice (SGLang's scheduler holds back such requests too); ``"duplicate"`` admits it at once and
    computes the shared part again, as vLLM does; the rest of its prompt is registered behind the copy that was
    registered first (:meth:`~kvlab.SequenceManager.cache_full_blocks` keeps one copy, vLLM keeps both). With
    ``"wait"`` and a pool that never evicts, the prefix hits equal :func:`kvlab.prefix_hit_bound`."""
    num_blocks: int = 4096
    block_size: int = 16
    policy: str = "lru"
    memory: str = "paged"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_batched_tokens: int = 512
    preemption: str = "recompute"
    prefix_caching: bool = True
    shared_prefill: str = "wait"
    prefetch: bool = True
    quotas: dict[str, int] = field(default_factory=dict)
    reservations: dict[str, int] = field(default_factory=dict)
    cost: CostModel = field(default_factory=CostModel)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_batched_tokens"):
            setattr(self, name, check_positive(getattr(self, name), f"EngineConfig.{name}"))
        for name, options in (("memory", ("paged", "contiguous", "contiguous-exact")),
                              ("preemption", ("recompute", "swap")), ("shared_prefill", ("wait", "duplicate")),
                              ("policy", (*POLICIES, "opt"))):
            check_choice(getattr(self, name), f"EngineConfig.{name}", options)
        self.temperature = check_temperature(self.temperature, "EngineConfig.temperature")
        self.top_p = check_top_p(self.top_p, "EngineConfig.top_p")
        self.seed = check_seed(self.seed, "EngineConfig.seed", optional=True)
        for name in ("prefix_caching", "prefetch", "stop_at_eos"):
            setattr(self, name, check_flag(getattr(self, name), f"EngineConfig.{name}"))
        if not isinstance(self.cost, CostModel):
            raise ConfigError(f"EngineConfig.cost must be a CostModel, got {self.cost!r}")
        for name in ("quotas", "reservations"):
            d = getattr(self, name)
            if not isinstance(d, dict):
                raise ConfigError(f"EngineConfig.{name} must be a dict of tenant -> blocks, got {d!r}")
            bad = {t: v for t, v in d.items() if not isinstance(t, str) or not is_int(v) or v < 0}
            if bad:
                raise ConfigError(f"EngineConfig.{name} maps tenant names (str) to block counts >= 0, got {bad}")
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
    the KV cache holds the first ``computed`` of them (``seq.num_tokens`` in paged mode). A step feeds
    ``tokens[computed:computed + n]``; when that reaches the end, the model samples the next token. The prompt's
    ids are built when the request first comes up for admission (empty until then: a queue of long prompts
    would otherwise hold them all). ``pending`` blocks are promised for this step's tokens; ``counted`` is what
    its tenant is charged."""
    req: Request
    rec: RequestRecord
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    generated: int = 0
    state: str = WAITING
    seq: Sequence | None = None
    pending: int = 0
    counted: int = 0

    @property
    def sequence(self) -> Sequence:
        """``seq`` of a job the paged memory admitted and has not released, where callers rely on it."""
        assert self.seq is not None, f"request {self.req.id} holds no sequence"
        return self.seq


class PagedMemory:
    """The paged KV cache behind the engine: a :class:`~kvlab.BlockPool` (metadata-only unless a model runs),
    a :class:`SequenceManager` holding one sequence per admitted request, and a :class:`PrefixCache`.

    ``promised`` blocks are owed to this step's batch and allocated when it runs (one ``pool.allocate``); the
    scheduler never promises more than :meth:`available` minus what is already promised."""

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
        self.pool = FastBlockPool(cfg.num_blocks, spec=spec, eviction_policy=policy,
                                  with_storage=model is not None)
        self.manager = FastSequenceManager(self.pool, prefix_cache=cfg.prefix_caching)
        self.cache: PrefixCache | None = self.manager.prefix_cache
        self.lifetimes = BlockLifetimes(self.pool)
        self.events, self.clock = self.pool.events, self.pool.clock
        self.model, self.bs = model, cfg.block_size
        self.track_ids = self.cache is not None or model is not None  # else only counts matter
        self.capacity_slots = cfg.num_blocks * cfg.block_size
        self.promised = 0

    @property
    def evictions(self) -> int:
        return self.pool.counts["evictions"]

    def prompt_ids(self, req: Request) -> list[int]:
        return req.prompt_token_ids(self.vocab) if self.track_ids else [0] * req.prompt_len

    def available(self) -> int:
        """Blocks a new promise may use: FREE or cached (evictable), less what is already promised."""
        return self.pool.num_free_blocks + self.pool.num_cached_blocks - self.promised

    def held(self, job: Job) -> int:
        """Pool blocks ``job`` holds a reference to (its resident table entries)."""
        seq = job.seq
        if seq is None:
            return 0
        return len(seq.block_table) - (len(seq.swapped.positions) if seq.swapped is not None else 0)

    def blocks_for(self, job: Job, n: int) -> int:
        """New blocks ``n`` more tokens of resident ``job`` need (the last block's free slots come first)."""
        return max(0, -(-(job.computed + n) // self.bs) - len(job.sequence.block_table))

    # -------------------------------------------------------------------------------- admission
    def lookup(self, job: Job) -> list[int]:
        """Cached blocks of ``job``'s prompt (full blocks; one token at least stays to compute, since the step
        that computes it yields the first output token). Nothing is taken yet."""
        if self.cache is None:
            return []
        return self.cache.peek(job.tokens, job.req.tenant, (len(job.tokens) - 1) // self.bs)

    def admission_bound(self, job: Job) -> int:
        """At most what admitting ``job`` takes, without looking up the cache: its whole prompt's blocks."""
        return -(-len(job.tokens) // self.bs)

    def admission_need(self, job: Job, hits: list[int], n: int) -> int:
        """Blocks admitting ``job`` with its first ``n`` tokens takes from :meth:`available`: new blocks, plus
        the cached hits that leave the evictable set once referenced."""
        refs = self.pool.fields.refcount
        revived = sum(1 for b in hits if not refs[b])
        return -(-(len(hits) * self.bs + n) // self.bs) - len(hits) + revived

    def prefill_in_flight(self, job: Job, running: Iterable[Job], hits: list[int] | None = None) -> bool:
        """Whether a running request of ``job``'s tenant is still computing the prompt block that follows
        ``job``'s cached prefix (so that waiting a step turns that block into a hit). Same chain, same block:
        the other holds ``job``'s last hit block at the same position (or neither has a hit) and the next block's
        tokens agree. ``hits``: :meth:`lookup` of ``job`` if the caller has it already."""
        B = self.bs
        others = [o for o in running if o.req.tenant == job.req.tenant and o.seq is not None
                  and o.seq.swapped is None and o.computed < o.req.prompt_len]
        if self.cache is None or not others:
            return False
        hits = self.lookup(job) if hits is None else hits
        k = len(hits)
        if k >= (len(job.tokens) - 1) // B:
            return False  # its cached prefix already covers every block it may take from the cache
        nxt = job.tokens[k * B:(k + 1) * B]
        for o in others:
            table = o.seq.block_table if o.seq is not None else []
            if o.computed < (k + 1) * B <= o.req.prompt_len \
                    and (k == 0 or (len(table) >= k and table[k - 1] == hits[-1])) \
                    and o.tokens[k * B:(k + 1) * B] == nxt:
                return True
        return False

    def _next_use(self, block_id: int) -> float:
        """OPT's oracle: when the cached prefix ``block_id`` holds is next looked up (inf: never)."""
        digest = self.cache.digest_of(block_id) if self.cache is not None else None
        return math.inf if digest is None or self.future is None else self.future.next_use(digest)

    def admit(self, job: Job) -> None:
        """Create ``job``'s sequence; its prompt's cached prefix is referenced, not recomputed."""
        if self.future is not None:  # OPT's clock: the request being admitted (a re-admission changes nothing)
            self.future.advance(max(self.future.request, self.arrival_index[job.req.id]))
        job.seq = self.manager.create(job.tokens if self.cache is not None else None, tenant=job.req.tenant)
        job.computed = job.seq.num_tokens

    # -------------------------------------------------------------------------------- the batch
    def execute(self, batch: list[tuple[Job, int]]) -> torch.Tensor | None:
        """Append this step's tokens, taking the promised blocks. Real mode runs the model through the paged
        cache and returns the logits of every row's last token; metadata mode only counts (and returns None)."""
        seqs = [j.sequence for j, _ in batch]
        feeds: list[Any] = ([j.tokens[j.computed:j.computed + n] for j, n in batch] if self.track_ids
                            else [n for _, n in batch])
        self.promised = 0
        for j, _ in batch:
            j.pending = 0
        if self.model is not None:  # the model appends and registers full blocks itself
            return self.model.step(self.manager, seqs, feeds)
        self.manager.append_tokens(seqs, feeds)
        if self.cache is not None:  # register what a prefill computed; a decode's blocks wait for the release
            bs, cache_full = self.bs, self.manager.cache_full_blocks
            for (job, n), seq in zip(batch, seqs):
                decoding = n == 1 and job.generated and job.computed + 1 == len(job.tokens)
                if not decoding and seq.cacheable and seq.num_tokens // bs > seq.cached_blocks:
                    cache_full(seq)
        return None

    def release(self, job: Job) -> None:
        """Free ``job``'s sequence, tail first: private blocks become FREE, registered ones stay cached. Its
        full blocks of generated tokens are registered now (SGLang inserts a request's decoded tokens when it
        finishes too): until then nobody else could hit them, since nobody else has generated those tokens."""
        seq = job.seq
        if seq is not None:
            if self.cache is not None and self.model is None and seq.cacheable and seq.swapped is None \
                    and seq.num_tokens // self.bs > seq.cached_blocks:
                self.manager.cache_full_blocks(seq)
            self.manager.free(seq)
            job.seq = None

    def swap_out(self, job: Job) -> int:
        """Copy the blocks ``job`` holds alone to host memory and free them; returns the tokens copied."""
        self.manager.swap_out(job.sequence)
        return sum(self._swap_state(job).tokens)

    @staticmethod
    def _swap_state(job: Job) -> SwapState:
        swapped = job.sequence.swapped
        assert swapped is not None, f"request {job.req.id} is not swapped out"
        return swapped

    def swap_need(self, job: Job) -> int:
        return len(self._swap_state(job).positions)

    def swappable(self, job: Job) -> int:
        """Blocks a swap-out of resident ``job`` would free (those it holds alone and no cache names)."""
        return len(self.manager.swappable(job.sequence))

    def swap_in(self, job: Job) -> int:
        """Bring ``job``'s host blocks back into fresh blocks; returns the tokens copied."""
        tokens = sum(self._swap_state(job).tokens)
        self.manager.swap_in(job.sequence)
        return tokens

    # -------------------------------------------------------------------------------- gauges
    def gauges(self) -> tuple[int, int, float]:
        """(reserved slots, token slots, fragmentation) right now; cached blocks count as reserved, and their
        tokens as held. No pass over the pool: a cached block is registered, hence full."""
        pool = self.pool
        reserved = (pool.num_blocks - pool.num_free_blocks) * self.bs
        frag = unusable_free_percent(pool) / 100 if pool.max_order else 0.0  # one size: none, by construction
        return reserved, self.usage()[1] + pool.num_cached_blocks * self.bs, frag

    def usage(self) -> tuple[int, int]:
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

    def hit_rate(self) -> float:
        """Prompt tokens the prefix cache served / prompt tokens looked up, so far."""
        c = self.cache
        return c.hit_tokens / c.query_tokens if c is not None and c.query_tokens else 0.0

    def check_invariants(self) -> None:
        self.manager.check_invariants()
        assert self.promised == 0, f"{self.promised} blocks promised outside a step"


class _Preempt(Exception):
    """Internal: the request being scheduled was itself chosen as the victim."""


# ---------------------------------------------------------------------------------------------------- engine
class Engine:
    """Continuous batching of ``workload`` (a :class:`Workload` or requests) on a paged pool or the baseline.

    Drive it with :meth:`step` (one step; False once every request finished) or :meth:`run`. Events
    (:class:`Admitted`, :class:`Preempted`, :class:`SwappedIn`, :class:`Finished`, :class:`TenantReclaimed`,
    :class:`~kvlab.metrics.StepMetrics`, and the pool's, sequences' and prefix cache's own) go to
    :attr:`events`, the pool's bus in paged mode. ``model`` (a :class:`~kvlab.model.TinyLlama`) turns on real
    mode: the KV tensor holds real K/V and the tokens are the model's greedy choices.

    Invariants after every step: every resident request's sequence holds exactly its ``computed`` tokens; each
    tenant holds at most its quota; with every request finished the pool holds only cached prefix blocks
    (none referenced) and passes ``check_invariants``.
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
        self.config = cfg
        reqs = self._requests(workload.requests if isinstance(workload, Workload) else workload)
        self._refuse_impossible(reqs, set())
        self._ids = {r.id for r in reqs}  # every id given, to refuse one given again
        self._tenants = {r.tenant for r in reqs} | set(cfg.quotas) | set(cfg.reservations)
        if cfg.policy == "opt" and not (cfg.memory == "paged" and cfg.prefix_caching):
            raise ConfigError("policy 'opt' ranks cached prefix blocks by their next lookup: it needs "
                              "memory='paged' and prefix_caching=True")
        self.memory: PagedMemory | ContiguousMemory = (PagedMemory(cfg, model, reqs) if cfg.memory == "paged"
                                                       else ContiguousMemory(cfg, model))
        self.events = self.memory.events
        self.model = model
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
        self.now_s = 0.0
        self.step_count = 0
        self.preemptions = 0
        self.finished_count = 0
        self.swap_ins = self.prefetched_ins = 0
        self.swap_in_stall_s = 0.0  # the part of the stall prefetching can hide
        self._sync_out = self._sync_in = self._async_in = 0  # tokens copied this step (out, in, in overlapped)
        self._wall = time.perf_counter

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
        prefill = decode = context = 0
        for job, n in batch:
            context += job.computed
            if n == 1 and job.generated and job.computed + 1 == len(job.tokens):
                decode += 1
            else:
                prefill += n
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
        out["prefix_hit_tokens"] = sum(r.prefix_hit_tokens for r in self.log.requests.values())
        out["swap_ins"], out["prefetched_swap_ins"] = self.swap_ins, self.prefetched_ins
        out["swap_in_stall_s"] = self.swap_in_stall_s
        if isinstance(self.memory, PagedMemory):  # in pool clock ticks (see kvlab.metrics)
            out.update(self.memory.lifetimes.summary())
            if self.memory.cache is not None:
                out.update(distribution(self.memory.cache.reuse_gaps, "reuse_gap", "ticks"))
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
        """Raise AssertionError if the memory, a sequence or the tenant accounting drifted."""
        self.memory.check_invariants()
        mem, per = self.memory, dict[str, int]()
        for j in (*self.running, *self.swapped):
            assert j.counted == mem.held(j) + j.pending, f"request {j.req.id}: charged {j.counted} blocks"
            assert j.seq is None or j.seq.num_tokens == j.computed, f"request {j.req.id}: KV holds the wrong tokens"
            per[j.req.tenant] = per.get(j.req.tenant, 0) + j.counted
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
            q.append(Job(r, rec))

    def _schedule(self) -> list[tuple[Job, int]]:
        cfg, mem = self.config, self.memory
        budget, bs, paged = cfg.max_batched_tokens, cfg.block_size, cfg.memory == "paged"
        batch: list[tuple[Job, int]] = []
        # Decode tokens first (they keep TPOT low), then continuing prompt chunks.
        for job in sorted(self.running, key=lambda j: len(j.tokens) - j.computed > 1):
            if job.state != RUNNING or not budget:
                continue
            n = min(len(job.tokens) - job.computed, budget)
            need = mem.blocks_for(job, n) if paged and job.computed + n > len(job.sequence.block_table) * bs else 0
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
        while self.swapped and len(self.running) < cfg.max_num_seqs:
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
                n = min(len(job.tokens) - len(hits) * mem.bs, budget)
                if not self._fits(tenant, mem.admission_need(job, hits, n)):
                    tried += 1
                    continue
            if wait_shared and isinstance(mem, PagedMemory) and mem.prefill_in_flight(job, self.running, hits):
                tried += 1  # its next prompt block is being computed: take it as a hit next step
                continue
            tried = 0
            q.popleft()
            mem.admit(job)
            cached = job.computed
            n = min(len(job.tokens) - cached, budget)
            job.rec.prefix_hit_tokens += cached
            job.state = RUNNING
            self.running.append(job)
            job.pending = mem.blocks_for(job, n)
            mem.promised += job.pending
            self._account(job)
            batch.append((job, n))
            budget -= n
            if self.events:
                self.events.publish(Admitted(self._now(), self.step_count, job.req.id, tenant, cached))

    def _fits(self, tenant: str, need: int) -> bool:
        """Whether ``tenant`` may take ``need`` more blocks: within its quota, and leaving every other tenant's
        unused reservation untouched."""
        cfg = self.config
        quota = cfg.quotas.get(tenant)
        if quota is not None and self.held.get(tenant, 0) + need > quota:
            return False
        owed = sum(max(0, r - self.held.get(t, 0)) for t, r in cfg.reservations.items() if t != tenant)
        return need <= self.memory.available() - owed

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
        self.memory.promised += need
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
        mem.promised -= job.pending
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
        """Recompute ``job`` later: free its sequence (registered blocks stay cached for its return) and put it
        first in its tenant's queue."""
        self.memory.release(job)
        job.computed = 0
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
        step, now, mem = self.step_count, self.now_s, self.memory
        for i, (job, n) in enumerate(batch):
            job.computed += n
            if job.computed < len(job.tokens):
                continue
            rec, stopped = job.rec, False
            if job.generated < job.req.output_len:
                token = next_ids[i] if next_ids is not None else (job.req.id * 7919 + job.generated) % 32000
                if rec.first_step < 0:
                    rec.first_step, rec.first_s = step, now
                stopped = token == self.eos  # the model ended its turn: done, and the end token is not kept
                if not stopped:
                    job.tokens.append(token)
                    job.generated += 1
            if stopped or job.generated == job.req.output_len:
                if rec.first_step < 0:  # nothing to generate: the prompt's last step is its first "token"
                    rec.first_step, rec.first_s = step, now
                rec.output_len = job.generated  # what it generated: fewer than asked when the model stopped
                rec.finish_step, rec.finish_s = step, now
                self.outputs[job.req.id] = job.tokens[len(job.tokens) - job.generated:]
                self.running.remove(job)
                mem.release(job)
                self._account(job)
                job.state = FINISHED
                self.finished_count += 1
                if self.events:
                    self.events.publish(Finished(self._now(), step, job.req.id, job.req.tenant, rec.ttft_s,
                                                 rec.tpot_s))

    def _record(self, prefill: int, decode: int, stall: float) -> None:
        mem = self.memory
        reserved, tokens, frag = mem.gauges()
        used_slots, used_tokens = mem.usage() if isinstance(mem, PagedMemory) else (reserved, tokens)
        cache = mem.cache if isinstance(mem, PagedMemory) else None
        m = StepMetrics(self._now(), self.step_count, self.now_s, len(self.running), self.num_waiting,
                        len(self.swapped), prefill, decode, mem.capacity_slots, reserved, tokens, frag, mem.evictions,
                        self.preemptions, mem.hit_rate(), self.finished_count,
                        tuple(sorted((t, n) for t, n in self.held.items() if n)), stall, used_slots, used_tokens,
                        cache.query_tokens if cache is not None else 0, cache.hit_tokens if cache is not None else 0)
        self.log.steps.append(m)
        if self.events:
            self.events.publish(m)


def run_workload(workload: Workload, **config: Any) -> dict[str, Any]:
    """Convenience: run ``workload`` to the end with an :class:`EngineConfig` built from ``config``."""
    try:
        return Engine(workload, EngineConfig(**config)).run()
    except TypeError as e:
        raise ConfigError(f"unknown engine setting: {e}") from None


__all__ = ["Admitted", "CostModel", "Engine", "EngineConfig", "Finished", "Job", "PagedMemory", "Preempted",
           "SwappedIn", "TenantReclaimed", "run_workload"]
