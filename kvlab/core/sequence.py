"""Sequences and their block tables (text §2.2.3 "块的分配和回收机制", §2.2.6 "智能回收").

The idea: a :class:`Sequence` owns no memory, only a *block table* mapping its logical block ``i`` (tokens
``i*B .. i*B+B-1``) to a physical block of the pool; token ``pos`` lives in slot ``table[pos // B] * B + pos % B``.
:class:`SequenceManager` changes tables only through the pool's own methods, so refcounts say who holds what:

* **append** takes blocks only when the last one is full (a batch's in one all-or-nothing ``pool.allocate``) and
  returns every new token's slot; the caller writes K/V there with one ``index_copy_`` per layer.
* **fork** shares every block (one ``incref``); the first append into a *shared, partly filled* last block copies
  it first (copy-on-write). Full blocks are never written again, so they stay shared for good.
* **free** releases the table tail first, so under LRU a cached chain loses its tail before its head.
* **swap out / in** moves the blocks the sequence holds alone to host memory (EVICTING -> FREE) and back into
  possibly other blocks (PENDING -> ALLOCATED), bitwise identical; shared and prefix-cached blocks stay resident.
* **migration** (defragmentation) moves blocks under everybody's feet: a ``pool.relocation_hooks`` callback
  rewrites every live table.

Invariants (:meth:`SequenceManager.check_invariants`): a resident table entry is ALLOCATED; each block's refcount
equals the number of table entries naming it; a table has ``ceil(num_tokens / B)`` entries; exactly the
swapped-out entries are ``-1``. On a metadata-only pool (``with_storage=False``) tables and token counts work
without any K/V.
"""
from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch

from kvlab.core.block import ALLOCATED
from kvlab.core.errors import ConfigError, IllegalTransitionError, KVDataError
from kvlab.core.events import Event
from kvlab.core.checks import TOKEN_MAX, TokenBytes, check_flag, check_tenant, is_int, token_ids, token_list
from kvlab.core.pool import BlockPool
from kvlab.core.prefix import PrefixCache
from kvlab.core.interrupts import atomic

NewTokens = int | Seq[int]


@atomic()
class SequenceManager:
    """Registry of live sequences (each a :class:`Sequence`, defined below) over ``pool``, with an optional
    :class:`PrefixCache` (``prefix_cache=True`` builds one). Registers a relocation hook so ``pool.migrate``
    rewrites every table."""

    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache | bool | None = None) -> None:
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"a SequenceManager needs a BlockPool, got {pool!r}")
        if isinstance(prefix_cache, PrefixCache) and prefix_cache.pool is not pool:
            raise ConfigError(f"the prefix cache {prefix_cache!r} belongs to another pool")
        if isinstance(prefix_cache, (bool, np.bool_)):
            prefix_cache = PrefixCache(pool) if prefix_cache else None
        elif prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
            raise ConfigError(f"prefix_cache must be a PrefixCache, True, False or None, not {prefix_cache!r}")
        self.pool, self.block_size = pool, pool.block_size
        self.prefix_cache = prefix_cache  # an empty cache is falsy (it has a length): never test it for truth
        self.seqs: dict[int, Sequence] = {}
        self._next_id = 0
        pool.relocation_hooks.append(self._relocate)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def device(self) -> torch.device:
        return self.pool.storage.kv.device if self.pool.storage is not None else torch.device("cpu")

    # ------------------------------------------------------------------ create / fork / free
    def create(self, prompt: Seq[int] | None = None, *, tenant: str | None = None) -> Sequence:
        """A new empty sequence. With a ``prompt`` (token ids) the sequence tracks token ids and, if there is a
        prefix cache, starts with the cached blocks of the prompt's longest cached prefix (at least one prompt
        token is left to compute, since the model needs its logits). Append ``prompt[seq.num_tokens:]`` next."""
        tenant = check_tenant(tenant)
        # Checked once, with or without a cache (the same prompt must not pass only sometimes).
        return self._open(None if prompt is None else token_ids(prompt, f"sequence {self._next_id}"), tenant)

    def _open(self, prompt: tuple[list[int], TokenBytes] | None, tenant: str | None) -> Sequence:
        """:meth:`create` once its arguments are checked: ``prompt`` is the token ids as the sequence keeps them
        and as the cache looks them up."""
        seq = Sequence(self._next_id, self, token_ids=None if prompt is None else [], tenant=tenant)
        if prompt is not None and self.prefix_cache is not None:
            ids, last = self.prefix_cache.match(prompt[1], tenant, max(0, (len(prompt[0]) - 1) // self.block_size))
            n = len(ids) * self.block_size
            seq.block_table, seq.num_tokens, seq.token_ids = ids, n, prompt[0][:n]
            seq.num_cached_tokens, seq.cached_blocks, seq.prefix_hash = n, len(ids), last
        self._next_id += 1
        self.seqs[seq.seq_id] = seq
        return seq

    def _live(self, seq: Sequence, resident: bool = True) -> None:
        if not isinstance(seq, Sequence):
            raise IllegalTransitionError(f"expected a Sequence of this manager, got {seq!r}")
        if not seq.alive or self.seqs.get(seq.seq_id) is not seq:
            raise IllegalTransitionError(f"sequence {seq.seq_id} is not live in this manager (freed?)")
        if resident and seq.swapped is not None:
            raise IllegalTransitionError(f"sequence {seq.seq_id} is swapped out: swap it in first")

    def fork(self, seq: Sequence) -> Sequence:
        """A child sharing every block of ``seq`` (refcounts +1, no copy until one of them appends)."""
        self._live(seq)
        self.pool.incref(seq.block_table)
        child = Sequence(self._next_id, self, list(seq.block_table), seq.num_tokens,
                         None if seq.token_ids is None else list(seq.token_ids), seq.tenant, seq.num_cached_tokens,
                         seq.cached_blocks, seq.prefix_hash, seq.cacheable)
        self._next_id += 1
        self.seqs[child.seq_id] = child
        return child

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``, tail first (one reference each), and forget the sequence."""
        self._live(seq, resident=False)
        # One call, tail first: blocks that stay cached enter the LRU order tail first, so a prefix chain is
        # evicted from its end (one call per block cost ~15% of an engine run).
        self.pool.free([b for b in reversed(seq.block_table) if b >= 0])
        seq.block_table, seq.swapped, seq.alive = [], None, False
        del self.seqs[seq.seq_id]

    # ------------------------------------------------------------------ append
    def append(self, seq: Sequence, new: NewTokens) -> torch.Tensor:
        """Append to one sequence; returns the slots of the new tokens."""
        return self.append_batch([seq], [new]).slots

    def append_batch(self, seqs: Seq[Sequence], new: Seq[NewTokens]) -> PagedBatch:
        """Append ``new[i]`` (a count, or token ids when the sequence tracks them) to ``seqs[i]``: blocks for the
        whole batch come from one ``pool.allocate`` (all or nothing: on :class:`OutOfBlocksError` nothing
        changed), shared partly filled tail blocks are copied first, token counts are updated and the slots of
        the new tokens returned in a :class:`PagedBatch`."""
        starts = self.append_tokens(seqs, new)
        counts = [s.num_tokens - a for s, a in zip(seqs, starts)]
        tables = self._tables(seqs)  # checked by append_tokens
        rows = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(counts, dtype=torch.long))
        pos = torch.arange(rows.numel()) - torch.tensor(np.cumsum([0] + counts[:-1]), dtype=torch.long)[rows] \
            + torch.tensor(starts, dtype=torch.long)[rows]
        return PagedBatch(self._slots(tables, rows, pos), pos.to(self.device), tables.to(self.device),
                          [s.num_tokens for s in seqs], counts)

    def append_tokens(self, seqs: Seq[Sequence], new: Seq[NewTokens]) -> list[int]:
        """The bookkeeping of :meth:`append_batch` (blocks, copy-on-write, token counts, token ids, same errors,
        same all-or-nothing allocation) without building any tensor: the fast path of metadata-only
        simulations, which never read slots. Returns each sequence's length before the append.

        Plan (validate everything, count the blocks needed), allocate them in one call, then apply: a rejected
        call changes nothing."""
        if not isinstance(seqs, (list, tuple)) or not isinstance(new, (list, tuple)) or len(seqs) != len(new):
            raise ConfigError(f"append_batch needs a list of sequences and one entry each, got {seqs!r} and {new!r}")
        for seq in seqs:
            self._live(seq)
        if len({s.seq_id for s in seqs}) != len(seqs):
            twice = next(s.seq_id for s in seqs if sum(t is s for t in seqs) > 1)
            raise ConfigError(f"append_batch needs distinct sequences; sequence {twice} appears twice")
        B, refcount = self.block_size, self.pool.fields.refcount
        # Plan: the new token ids, new blocks per sequence, and a private copy of a shared, partly filled tail
        # (copy-on-write). Refcounts are simulated in order, so of k sharers appending in one batch only the
        # first k-1 copy; the last one keeps the original.
        plan: list[tuple[Sequence, int, list[int] | None, bool, int]] = []
        copied: dict[int, int] = {}
        need = 0
        for seq, x in zip(seqs, new):
            n, ids = self._new_tokens(seq, x)
            cow = False
            if n and seq.num_tokens % B:
                tail = seq.block_table[-1]
                cow = refcount[tail] - copied.get(tail, 0) > 1
                copied[tail] = copied.get(tail, 0) + cow
            k = -(-(seq.num_tokens + n) // B) - len(seq.block_table)
            plan.append((seq, n, ids, cow, k))
            need += cow + k
        fresh = self.pool.allocate(need) if need else []
        # Apply.
        src, dst, cowed, starts, filled, counts, at = [], [], [], [], [], [], 0
        for seq, n, ids, cow, k in plan:
            table = seq.block_table
            if cow + k:
                got = fresh[at:at + cow + k]
                at += cow + k
                if cow:
                    src.append(table[-1])
                    dst.append(got[0])
                    cowed.append(seq)
                    table[-1] = got[0]
                table.extend(got[cow:])
                self.pool.set_owner(got, seq.seq_id)
            start = seq.num_tokens
            starts.append(start)
            end = seq.num_tokens = start + n
            for i in range(start // B, -(-end // B)):
                filled.append(table[i])
                counts.append(min(B, end - i * B))
            if ids:
                seq.token_ids.extend(ids)  # type: ignore[union-attr]  # ids only for sequences that track them
        if filled:
            self.pool.set_token_counts(filled, counts)
        if src:
            if self.pool.storage is not None:
                self.pool.storage.copy_blocks(src, dst)
            self.pool.free(src)  # the sharers keep the originals
            if self.pool.events:
                for s_, d_, seq in zip(src, dst, cowed):
                    self.pool.events.publish(CopiedOnWrite(self.pool.clock.now(), seq.seq_id, s_, d_))
        return starts

    @staticmethod
    def _new_tokens(seq: Sequence, x: NewTokens) -> tuple[int, list[int] | None]:
        """``(count, token ids or None)`` of what is appended to ``seq``; :class:`KVDataError` for anything but
        a count (for a sequence without token ids) or a flat sequence of token ids in 0..2**63-1."""
        if is_int(x):
            if x < 0 or seq.num_tokens + x > TOKEN_MAX:  # positions are int64
                raise ConfigError(f"sequence {seq.seq_id}: cannot append {x!r} tokens to {seq.num_tokens}")
            if seq.token_ids is not None and x:
                raise KVDataError(f"sequence {seq.seq_id} tracks token ids: append ids, not a count ({x})")
            return int(x), None
        if not isinstance(x, (list, tuple, range, torch.Tensor, np.ndarray)):
            raise KVDataError(f"sequence {seq.seq_id}: append a token count or a list of token ids, not {x!r}")
        ids = token_list(x, f"sequence {seq.seq_id}")
        return len(ids), ids if seq.token_ids is not None else None

    # ------------------------------------------------------------------ tables and slots
    def block_tables(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """Padded ``[batch, max_blocks]`` int64 block tables (CPU), padding with block 0 (never read)."""
        if not isinstance(seqs, (list, tuple)):
            raise ConfigError(f"block_tables needs a list of sequences, got {seqs!r}")
        for s in seqs:
            self._live(s)  # a swapped-out table holds -1: no kernel may read it
        return self._tables(seqs)

    @staticmethod
    def _tables(seqs: Seq[Sequence]) -> torch.Tensor:
        width = max((len(s.block_table) for s in seqs), default=0)
        return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.long)

    def _slots(self, tables: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        B = self.block_size
        return (tables[rows, pos // B] * B + pos % B).to(self.device)

    def slot_mapping(self, seqs: Seq[Sequence], starts: Seq[int], stops: Seq[int]) -> torch.Tensor:
        """Slots of positions ``starts[i] .. stops[i]-1`` of each sequence, packed (vectorised)."""
        if not isinstance(seqs, (list, tuple)):
            raise ConfigError(f"slot_mapping needs a list of sequences, got {seqs!r}")
        starts, stops = _positions(starts, "starts"), _positions(stops, "stops")
        if not len(seqs) == len(starts) == len(stops):
            raise ConfigError(f"slot_mapping needs one start and stop per sequence: {len(seqs)} sequences, "
                              f"starts {starts!r}, stops {stops!r}")
        for s, a, b in zip(seqs, starts, stops):
            self._live(s)
            if not (is_int(a) and is_int(b) and 0 <= a <= b <= s.num_tokens):
                raise ConfigError(f"sequence {s.seq_id} has {s.num_tokens} tokens: positions from start {a!r} to "
                                  f"stop {b!r} are outside 0 <= start <= stop <= {s.num_tokens}")
        starts, stops = [int(a) for a in starts], [int(b) for b in stops]
        lens = torch.tensor([b - a for a, b in zip(starts, stops)], dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(seqs)), lens)
        off = torch.arange(rows.numel()) - (torch.cumsum(lens, 0) - lens)[rows]
        return self._slots(self._tables(seqs), rows, off + torch.tensor(starts, dtype=torch.long)[rows])

    # ------------------------------------------------------------------ prefix cache
    def cache_full_blocks(self, seq: Sequence) -> int:
        """Register the full blocks of ``seq`` not yet in the prefix cache (call once their K/V are written).
        A block is registered only on top of its registered parent, so a cached child's holders always hold its
        parent. A block whose exact prefix another live block registered first (two requests computed the same
        prefix at once) is replaced by that block, as a hit would have given it, and registration goes on behind
        it; at a hash collision (that block holds other tokens) registration stops for good (``cacheable``
        False). Returns how many blocks were added."""
        self._live(seq)
        cache = self.prefix_cache
        if cache is None or seq.token_ids is None or not seq.cacheable:
            return 0
        B, first, stop, added = self.block_size, seq.cached_blocks, seq.num_tokens // self.block_size, 0
        while first < stop:
            chain = TokenBytes(array("q", seq.token_ids[first * B:stop * B]))  # checked when they came in
            digests = cache.store_blocks(seq.block_table[first:stop], chain, seq.prefix_hash, seq.tenant)
            if digests:
                first, added = first + len(digests), added + len(digests)
                seq.cached_blocks, seq.prefix_hash = first, digests[-1]
            if first < stop:  # block `first`'s prefix is registered already: take that block, drop ours
                tokens = seq.token_ids[first * B:(first + 1) * B]
                digest = cache.block_hash(seq.prefix_hash, tokens, seq.tenant)
                other, mine = cache.cached_block(digest, tokens), seq.block_table[first]
                if other is None:  # a hash collision: the block under that hash holds other tokens
                    seq.cacheable = False
                    break
                self.pool.incref([other])
                self.pool.free([mine])
                seq.block_table[first] = other
                first += 1
                seq.cached_blocks, seq.prefix_hash = first, digest
        return added

    # ------------------------------------------------------------------ swap
    def swappable(self, seq: Sequence) -> list[int]:
        """Table positions :meth:`swap_out` would move: blocks ``seq`` holds alone that no cache names (an
        empty list means swapping ``seq`` out would free no memory)."""
        self._live(seq)
        held = self.prefix_cache.holds if self.prefix_cache is not None else (lambda b: False)
        return [i for i, b in enumerate(seq.block_table) if self.pool.fields.refcount[b] == 1 and not held(b)]

    def swap_out(self, seq: Sequence) -> None:
        """Move the blocks ``seq`` holds alone to host memory (pinned on CUDA); they go EVICTING -> FREE."""
        pos = self.swappable(seq)
        ids = [seq.block_table[i] for i in pos]
        storage = self.pool.storage
        data = None
        self.pool.begin_eviction(ids)
        if storage is not None and ids:
            k = storage.kv
            data = torch.empty((*k.shape[:2], len(ids), *k.shape[3:]), dtype=k.dtype,
                               pin_memory=k.is_cuda)
            storage.gather_blocks(ids, out=data)
            if k.is_cuda:  # the blocks may be reused as soon as they are FREE: the copy must have landed
                torch.cuda.current_stream(k.device).synchronize()
        tokens = [self.pool.fields.tokens[b] for b in ids]
        self.pool.finish_eviction(ids)
        for i in pos:
            seq.block_table[i] = -1
        seq.swapped = SwapState(pos, tokens, data)
        if self.pool.events:
            self.pool.events.publish(Swapped(self.pool.clock.now(), seq.seq_id, "out", tuple(ids)))

    def swap_in(self, seq: Sequence) -> None:
        """Bring a swapped-out sequence back into freshly reserved blocks (PENDING -> ALLOCATED). On
        :class:`OutOfBlocksError` nothing changed and the sequence stays swapped out."""
        self._live(seq, resident=False)
        st = seq.swapped
        if st is None:
            raise IllegalTransitionError(f"sequence {seq.seq_id} is not swapped out")
        ids = self.pool.reserve(len(st.positions), owner=seq.seq_id) if st.positions else []
        if st.data is not None:
            self.pool.storage_of().scatter_blocks(ids, st.data)
        self.pool.commit(ids)
        self.pool.set_token_counts(ids, st.tokens)
        for i, b in zip(st.positions, ids):
            seq.block_table[i] = b
        seq.swapped = None
        if self.pool.events:
            self.pool.events.publish(Swapped(self.pool.clock.now(), seq.seq_id, "in", tuple(ids)))

    # ------------------------------------------------------------------ migration and checks
    def _relocate(self, src: np.ndarray, dst: np.ndarray) -> None:
        """``pool.migrate`` moved ``src[i]`` to ``dst[i]``: rewrite every table that names a moved block."""
        moved = dict(zip(src.tolist(), dst.tolist()))
        for seq in self.seqs.values():
            seq.block_table[:] = [moved.get(b, b) for b in seq.block_table]

    def check_invariants(self, exclusive: bool = True) -> None:
        """The pool's invariants, plus: refcount == number of table entries naming the block (and, when
        ``exclusive``, no block is referenced by anything but these tables); resident entries are ALLOCATED and
        count the tokens the table puts in them; table length == ceil(tokens / B). Raises AssertionError."""
        check_flag(exclusive, "exclusive")
        self.pool.check_invariants()
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
        named = Counter(b for s in self.seqs.values() for b in s.block_table if b >= 0)
        refs = self.pool.arrays.refcount
        held = np.flatnonzero(refs) if exclusive else np.fromiter(named, dtype=np.int64, count=len(named))
        assert named == Counter(dict(zip(held.tolist(), refs[held].tolist()))), "refcounts disagree with tables"
        B, tokens = self.block_size, self.pool.fields.tokens
        for s in self.seqs.values():
            assert len(s.block_table) == -(-s.num_tokens // self.block_size), f"sequence {s.seq_id}: table length"
            resident = [b for b in s.block_table if b >= 0]
            assert all(self.pool.fields.status[b] == ALLOCATED for b in resident), f"sequence {s.seq_id}: status"
            filled = [min(B, s.num_tokens - i * B) for i, b in enumerate(s.block_table) if b >= 0]
            assert [tokens[b] for b in resident] == filled, f"sequence {s.seq_id}: block token counts {filled} expected"
            out = s.swapped.positions if s.swapped is not None else []
            assert [i for i, b in enumerate(s.block_table) if b < 0] == out, f"sequence {s.seq_id}: swap state"


@dataclass(slots=True, eq=False)
class Sequence:
    """A request's view of the cache: ``block_table[i]`` is the physical block of logical block ``i``.

    ``token_ids`` is tracked when the sequence was created with tokens (needed for prefix caching) and None when
    only counts matter. ``num_cached_tokens`` prompt tokens came from the prefix cache; ``cached_blocks`` leading
    blocks are registered there (``prefix_hash`` is the last one's hash); ``cacheable`` turns False when
    registration met a hash collision, and nothing more of the sequence is registered."""
    seq_id: int
    manager: SequenceManager = field(repr=False)
    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    token_ids: list[int] | None = None
    tenant: str | None = None
    num_cached_tokens: int = 0
    cached_blocks: int = 0
    prefix_hash: bytes | None = field(default=None, repr=False)
    cacheable: bool = True
    swapped: SwapState | None = field(default=None, repr=False)
    alive: bool = True

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)

    def append(self, new: NewTokens) -> torch.Tensor:
        """Append ``new`` (a token count, or token ids) and return the slots of the new tokens."""
        return self.manager.append(self, new)

    def fork(self) -> Sequence:
        return self.manager.fork(self)

    def free(self) -> None:
        self.manager.free(self)

    def swap_out(self) -> None:
        self.manager.swap_out(self)

    def swap_in(self) -> None:
        self.manager.swap_in(self)

    def slots(self) -> torch.Tensor:
        """Slot of every token of the sequence, in order (for reading its K/V back)."""
        return self.manager.slot_mapping([self], [0], [self.num_tokens])


@dataclass(slots=True)
class SwapState:
    """Host copy of a swapped-out sequence: table ``positions``, their token counts and ``data``
    ``[2, layers, n, B, heads, dim]`` (None on a metadata-only pool)."""
    positions: list[int]
    tokens: list[int]
    data: torch.Tensor | None


@dataclass(slots=True)
class PagedBatch:
    """What one forward step needs: slots and positions of the new tokens (packed, sequence by sequence), the
    padded ``block_tables`` ``[batch, max_blocks]``, ``seq_lens`` after the step and ``query_lens`` (new tokens)."""
    slots: torch.Tensor
    positions: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: list[int]
    query_lens: list[int]


@dataclass(slots=True)
class CopiedOnWrite(Event):
    """Sequence ``seq_id`` appended into shared block ``src`` and got private copy ``dst`` first."""
    seq_id: int
    src: int
    dst: int


@dataclass(slots=True)
class Swapped(Event):
    """Sequence ``seq_id`` moved ``block_ids`` to host memory (``direction='out'``) or back (``'in'``)."""
    seq_id: int
    direction: str
    block_ids: tuple[int, ...]


def _positions(x: object, what: str) -> list:
    """``starts``/``stops`` of :meth:`SequenceManager.slot_mapping` as a list (ints are checked per sequence)."""
    if isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim == 1:
        return x.tolist()
    if not isinstance(x, (list, tuple, range)):
        raise ConfigError(f"slot_mapping: {what} must be a list of positions, got {x!r}")
    return list(x)
