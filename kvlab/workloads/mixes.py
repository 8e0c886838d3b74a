"""Workloads: the request mixes of text §2.2.1 ("序列长度分析"), seeded, with arrivals and trace files.

§2.2.1 argues that the block size must follow the lengths real requests have, and names four scenarios. Each is
a :class:`Scenario` here, with the text's ranges; where the text gives no mean we take the geometric mean of
the range (our choice, marked *):

=============  ===============================  ==============================================  ===================
scenario       new prompt tokens                output tokens                                   shared prefix
=============  ===============================  ==============================================  ===================
``chat``       a turn: 10-200, mean 50          a turn: 10-200, mean 50                         4 system prompts
``document``   instruction: 10-200, mean 50     70% paragraph 200-1000 (447*), 30% document     3 templates
                                                1000-5000 (2236*)
``code``       instruction: 10-200, mean 50     70% function 100-500 (224*), 30% class          3 few-shot
                                                500-2000 (1000*)                                templates
``retrieval``  query: 10-100 (32*)              response: 1000-10000 (3162*)                    2 system prompts
=============  ===============================  ==============================================  ===================

``mixed`` draws each request's scenario uniformly and uses the scenario's name as its tenant. The text's
numbers describe the tokens a request adds; a shared prefix (system prompt, few-shot template) comes on top, so
``prompt_len - prefix_len`` is what follows the text's range. Lengths are log-normal, truncated to the range,
with the location solved so that the truncated mean is the stated one (:class:`LengthRange`). The prefix
templates and their share of requests are our assumptions, chosen so that prefix caching matters.

Arrivals are a Poisson process at ``rate`` requests per second, or bursts: groups of ``burst_size`` requests
arriving at the same instant, the groups Poisson at ``rate / burst_size`` (same mean rate, far burstier).

Trace files (bring a real trace, or save a generated one) are UTF-8 text (a leading byte-order mark is
skipped) holding one request per record:

* **JSONL** (``.jsonl``): one JSON object per line; blank lines and lines starting with ``#`` are skipped. Values
  have their field's JSON type (``8``, not ``"8"`` or ``8.0``); ``null`` in an optional field takes its default.
* **CSV** (``.csv``): a header row naming the columns (each once, the required ones present), then one row per
  request with a cell per column, quoted as :mod:`csv` writes it (``"`` around a cell holding a comma, quote or
  line end, ``""`` for a quote inside it); a stray quote is an error. Empty optional cells take their default,
  numbers are ASCII decimals, ``prompt_tokens`` and ``hash_ids`` are written as space-separated integers.

=================  ========  =====================================================================
field              required  meaning
=================  ========  =====================================================================
``id``             yes       int in 0..2**31-1, unique within the trace
``arrival``        yes       seconds since the start of the trace, finite float >= 0
``prompt_len``     yes       prompt tokens, int in 1..2**31-1, including the shared prefix
``output_len``     yes       tokens the model writes, int in 0..2**31-1
``tenant``         no        user or application the request belongs to (default ``"default"``)
``prefix_id``      no        name of the shared prefix the prompt starts with (default none)
``prefix_len``     no        tokens of that prefix; > 0 iff ``prefix_id`` is set, the same in every request
``prompt_tokens``  no        the prompt's token ids (``prompt_len`` of them, each in 0..2**31-1); derived when
                             absent
``hash_ids``       no        Mooncake-style content ids, one per 512 prompt tokens (:data:`HASH_BLOCK`): the
                             prompt's token ids follow from them; not with ``prefix_id`` or ``prompt_tokens``
=================  ========  =====================================================================

The bound 2**31-1 (:data:`INT_MAX`) is the pool's: it keeps owners and token counts as int32. A malformed record
raises :class:`~kvlab.core.errors.TraceFormatError` naming the file and the 1-based line, and nothing is loaded;
:func:`write_trace` then :func:`read_trace` gives back equal requests in either format.

Two production formats are read too (:func:`parse_trace`; :func:`kvlab.workloads.traces.load_trace` finds the files,
unzips and detects them). Records are numbered from 0 in file order, arrivals are seconds since the first
record and must not go backwards, the tenant is ``"default"``:

* **Azure** (LLM inference trace 2023): CSV with the header ``TIMESTAMP,ContextTokens,GeneratedTokens``;
  ``TIMESTAMP`` reads ``YYYY-MM-DD HH:MM:SS.fffffff`` and is converted exactly (integer nanoseconds, at most 9
  fractional digits: more are refused rather than rounded); the counts are the prompt and output lengths.
* **Mooncake** (FAST'25 release): JSONL objects with exactly ``timestamp`` (milliseconds, a number),
  ``input_length``, ``output_length`` and ``hash_ids`` (:attr:`Request.hash_ids`).
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import date
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from kvlab.core.checks import SEED_MAX, check_path, check_real, is_int, is_real, is_text, show
from kvlab.core.errors import ConfigError, TraceFormatError
from kvlab.core.files import os_reason, read_file, shown

FIELDS = ("id", "arrival", "prompt_len", "output_len", "tenant", "prefix_id", "prefix_len", "prompt_tokens",
          "hash_ids")
REQUIRED = FIELDS[:4]
DEFAULT_VOCAB = 32000  # derived token ids are drawn from this many ids when no model says otherwise
INT_MAX = 2**31 - 1  # the largest id, length or token id a request may hold (the pool's int32 fields)
HASH_BLOCK = 512  # prompt tokens per hash id (Mooncake's trace hashes its prompts in blocks of 512 tokens)
HASH_ID_MAX = INT_MAX // HASH_BLOCK  # the largest hash id whose tokens (id * 512 + offset) stay <= INT_MAX
TRACE_KINDS = ("jsonl", "csv", "azure", "mooncake")
_PHI = NormalDist()
_inv_cdf = np.vectorize(_PHI.inv_cdf, otypes=[float])


# ---------------------------------------------------------------------------------------------------- requests
@dataclass(frozen=True, slots=True)
class Request:
    """One request. Its prompt is ``prefix_len`` tokens of the shared prefix ``prefix_id`` (identical in every
    request naming it) followed by ``prompt_len - prefix_len`` tokens of its own; the model then writes
    ``output_len`` tokens, so the sequence peaks at :attr:`total_len` tokens in the cache.

    Invariants (checked on construction, :class:`~kvlab.core.errors.ConfigError` otherwise): ``arrival`` is finite
    and ``>= 0``, ``prompt_len >= 1``, ``output_len >= 0``, ``0 <= prefix_len <= prompt_len``, ``prefix_len > 0``
    iff ``prefix_id`` is set, and ``prompt_tokens`` (when given) holds ``prompt_len`` token ids. The id, the
    lengths and the token ids are ints in ``0..INT_MAX`` (2**31 - 1): the pool stores owners and counts as int32,
    so a larger value would overflow there rather than fail here.

    ``hash_ids`` describes the prompt the way the Mooncake trace does: id ``i`` of the tuple names the content
    of prompt tokens ``512*i .. 512*(i+1)-1`` (the last id the rest of the prompt), so it holds
    ``ceil(prompt_len / 512)`` ints in ``0..HASH_ID_MAX``, and two requests whose tuples start alike share that
    much prompt. It is a complete description of the prompt, so it excludes ``prefix_id`` and ``prompt_tokens``
    (a request with both would describe its prompt twice, possibly differently).
    """

    id: int
    arrival: float
    prompt_len: int
    output_len: int
    tenant: str = "default"
    prefix_id: str | None = None
    prefix_len: int = 0
    prompt_tokens: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise numpy scalars etc. to plain Python values once
        for name in ("id", "prompt_len", "output_len", "prefix_len"):
            v = getattr(self, name)
            if type(v) is not int or not 0 <= v <= INT_MAX:  # the check is cheap; its message is built on need
                set_(self, name, _bounded_int(v, f"request {show(self.id)}: {name}"))
        a = self.arrival
        if type(a) is not float or not 0 <= a < math.inf:  # as for the ints: the message is built on need
            set_(self, "arrival", check_real(a, f"request {self.id}: arrival", lo=0, unit=" of seconds"))
        if self.prompt_len < 1 or self.output_len < 0:
            raise ConfigError(f"request {self.id}: prompt_len must be >= 1 and output_len >= 0, got "
                              f"{self.prompt_len} and {self.output_len}")
        if not is_text(self.tenant) or not self.tenant:
            raise ConfigError(f"request {self.id}: tenant must be a non-empty str of UTF-8 text, got "
                              f"{show(self.tenant)}")
        if self.prefix_id is not None and (not is_text(self.prefix_id) or not self.prefix_id):
            raise ConfigError(f"request {self.id}: prefix_id must be a non-empty str of UTF-8 text or None, "
                              f"got {show(self.prefix_id)}")
        if not 0 <= self.prefix_len <= self.prompt_len or (self.prefix_len > 0) != (self.prefix_id is not None):
            raise ConfigError(f"request {self.id}: prefix_len={self.prefix_len} with prefix_id={self.prefix_id!r} "
                              f"and prompt_len={self.prompt_len} (need 0 < prefix_len <= prompt_len exactly "
                              f"when a prefix_id is set)")
        if self.prompt_tokens is not None:
            set_(self, "prompt_tokens", _int_tuple(self.prompt_tokens, self.prompt_len, INT_MAX,
                                                   lambda: f"request {self.id}: prompt_tokens must be "
                                                           f"{self.prompt_len} token ids in 0..{INT_MAX}"))
        if self.hash_ids is not None:
            if self.prefix_id is not None or self.prompt_tokens is not None:
                raise ConfigError(f"request {self.id}: hash_ids describe the whole prompt, so they exclude "
                                  f"prefix_id and prompt_tokens")
            need = -(-self.prompt_len // HASH_BLOCK)
            set_(self, "hash_ids", _int_tuple(self.hash_ids, need, HASH_ID_MAX,
                                              lambda: f"request {self.id}: hash_ids must be {need} ints in "
                                                      f"0..{HASH_ID_MAX} (one per {HASH_BLOCK} of the "
                                                      f"{self.prompt_len} prompt tokens)"))

    @property
    def total_len(self) -> int:
        """Tokens in the cache when the request finishes: prompt plus output."""
        return self.prompt_len + self.output_len

    def prompt_token_ids(self, vocab_size: int | None = None) -> list[int]:
        """The prompt's token ids: :attr:`prompt_tokens` when given, else derived deterministically (a stable
        hash seeds a generator) so that every request naming the same prefix starts with the same ids, and a
        prefix cache that hashes token ids finds the sharing the trace describes. ``vocab_size`` is the model's
        vocabulary; None (no model, metadata mode) draws derived ids from :data:`DEFAULT_VOCAB` ids.

        With :attr:`hash_ids` the token at offset ``o`` of hash id ``h`` is ``h * 512 + o``: equal ids give equal
        tokens and distinct ids never share one. These ids are exact, not taken modulo ``vocab_size`` (that
        would make distinct ids collide), so a vocabulary too small for them raises
        :class:`~kvlab.core.errors.ConfigError`: such traces run without a model (metadata mode)."""
        if self.prompt_tokens is not None:
            return list(self.prompt_tokens)
        if vocab_size is not None and not (is_int(vocab_size) and vocab_size >= 1):
            raise ConfigError(f"vocab_size must be an int >= 1 or None, got {show(vocab_size)}")
        if self.hash_ids is not None:
            return _hash_token_ids(self.hash_ids, self.prompt_len, INT_MAX + 1 if vocab_size is None else vocab_size,
                                   self.id)
        vocab_size = DEFAULT_VOCAB if vocab_size is None else vocab_size
        head = _token_ids(f"prefix:{self.prefix_id}", self.prefix_len, vocab_size) if self.prefix_id else []
        return head + _token_ids(f"request:{self.id}", self.prompt_len - self.prefix_len, vocab_size)


def _bounded_int(v: Any, what: str) -> int:
    """``v`` as a plain int in ``0..INT_MAX``; a bool or a float is refused, not rounded."""
    if not is_int(v):
        raise ConfigError(f"{what} must be an int, got {show(v)}")
    if not 0 <= v <= INT_MAX:
        raise ConfigError(f"{what} must be an int in 0..{INT_MAX}, got {show(v)}")
    return int(v)


def _int_tuple(toks: Any, n: int, hi: int, what: Callable[[], str]) -> tuple[int, ...]:
    """``toks`` as a tuple of ``n`` plain ints in ``0..hi``. ``what()`` says so in an error; it is called only
    then, since a trace builds thousands of requests."""
    if type(toks) in (tuple, list) and all(type(t) is int for t in toks):
        out = tuple(toks)  # the common case: plain ints already
    else:
        if isinstance(toks, np.ndarray):
            if toks.dtype.kind not in "iu":
                raise ConfigError(f"{what()}, got an array of {toks.dtype}")
            toks = toks.tolist()
        if isinstance(toks, (str, bytes)) or not isinstance(toks, Iterable):
            raise ConfigError(f"{what()}, got {show(toks)}")
        toks = list(toks)
        for t in toks:
            if not is_int(t):
                raise ConfigError(f"{what()}, got {show(t)}")
        out = tuple(int(t) for t in toks)
    if len(out) != n:
        raise ConfigError(f"{what()}, got {len(out)} ids")
    if out and not (0 <= min(out) and max(out) <= hi):
        raise ConfigError(f"{what()}, got {show(next(t for t in out if not 0 <= t <= hi))}")
    return out


def _hash_token_ids(hash_ids: tuple[int, ...], n: int, vocab_size: int, rid: int) -> list[int]:
    """The ``n`` token ids of a prompt given by hash ids: ``h * HASH_BLOCK + offset`` (vectorised: a 126k-token
    prompt is built without a Python step per token)."""
    toks = np.repeat(np.asarray(hash_ids, dtype=np.int64) * HASH_BLOCK, HASH_BLOCK)[:n] + np.arange(n) % HASH_BLOCK
    top = int(toks.max())
    if top >= vocab_size:
        raise ConfigError(f"request {rid}: its hash ids make token ids up to {top}, past vocab_size={vocab_size}; "
                          f"hash-id prompts are exact (a modulo would make distinct ids collide), so run them "
                          f"without a model or with a vocabulary of more than {top} ids")
    return toks.tolist()


def _token_ids(key: str, n: int, vocab_size: int) -> list[int]:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, vocab_size, n).tolist()


# ---------------------------------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """A named list of requests in arrival order (ties by id). Ids are unique and every request naming a
    prefix agrees on its length (else :class:`~kvlab.core.errors.ConfigError`)."""

    name: str
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.requests, (str, bytes)) or not isinstance(self.requests, Iterable):
            raise ConfigError(f"workload {self.name!r}: requests must be a list of Request, got "
                              f"{show(self.requests)}")
        reqs = list(self.requests)  # once: it may be an iterator
        stray = [r for r in reqs if not isinstance(r, Request)]
        if stray:
            raise ConfigError(f"workload {self.name!r}: requests must be a list of Request, got {show(stray[0])}")
        self.requests = sorted(reqs, key=lambda r: (r.arrival, r.id))
        bad = _inconsistency(self.requests)
        if bad is not None:
            raise ConfigError(bad[1])

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> Request:
        return self.requests[i]

    def sequence_lengths(self) -> np.ndarray:
        """Peak cache length of every request (prompt + output), in arrival order."""
        return np.array([r.total_len for r in self.requests], dtype=np.int64)

    def summary(self) -> dict[str, Any]:
        """Counts and length statistics, for a quick look or a table."""
        if not self.requests:
            return {"name": self.name, "requests": 0}
        lens = self.sequence_lengths()
        span = self.requests[-1].arrival - self.requests[0].arrival
        return {"name": self.name, "requests": len(self), "duration_s": span,
                "rate_per_s": (len(self) - 1) / span if span > 0 else math.inf,
                "prompt_mean": float(np.mean([r.prompt_len for r in self])),
                "output_mean": float(np.mean([r.output_len for r in self])),
                "total_p50": float(np.median(lens)), "total_p95": float(np.percentile(lens, 95)),
                "total_max": int(lens.max()),
                "with_prefix": sum(r.prefix_id is not None for r in self) / len(self),
                "tenants": len({r.tenant for r in self})}


def _inconsistency(requests: Sequence[Request]) -> tuple[int, str] | None:
    """``(index, problem)`` of the first request whose id repeats or whose prefix length disagrees."""
    ids: dict[int, int] = {}
    prefixes: dict[str, tuple[int, int]] = {}
    for i, r in enumerate(requests):
        problem = _clash(r, ids, prefixes)
        if problem is not None:
            return i, problem
    return None


def _clash(r: Request, ids: dict[int, int], prefixes: dict[str, tuple[int, int]]) -> str | None:
    """What is wrong with adding ``r`` to the requests seen so far (``ids``, ``prefixes``; updated), if anything:
    one request at a time, so that a trace reader reports the first bad line, not the end of the file."""
    if r.id in ids:
        return f"request id {r.id} appears twice"
    ids[r.id] = len(ids)
    if r.prefix_id is not None:
        first, n = prefixes.setdefault(r.prefix_id, (r.id, r.prefix_len))
        if n != r.prefix_len:
            return (f"request {r.id} says prefix {r.prefix_id!r} has {r.prefix_len} tokens but request "
                    f"{first} says {n}")
    return None


# ---------------------------------------------------------------------------------------------------- lengths
@lru_cache(maxsize=None)
def _location(lo: float, hi: float, mean: float, sigma: float) -> float:
    """The ``mu`` of a log-normal(mu, sigma) truncated to [lo, hi] whose mean is ``mean`` (bisection: the
    truncated mean grows monotonically with mu)."""
    a, b = math.log(lo), math.log(hi)

    def truncated_mean(mu: float) -> float:
        z = _PHI.cdf((b - mu) / sigma) - _PHI.cdf((a - mu) / sigma)
        s = _PHI.cdf((b - mu - sigma ** 2) / sigma) - _PHI.cdf((a - mu - sigma ** 2) / sigma)
        return math.exp(mu + sigma ** 2 / 2) * s / z if z > 0 else (lo if mu < a else hi)

    left, right = a - 6 * sigma, b + 6 * sigma
    for _ in range(80):
        mid = (left + right) / 2
        left, right = (mid, right) if truncated_mean(mid) < mean else (left, mid)
    return (left + right) / 2


@dataclass(frozen=True, slots=True)
class LengthRange:
    """Token lengths in ``[lo, hi]`` with mean ``mean``: a log-normal of shape ``sigma`` truncated to the range
    (sampled by inverting its CDF, so nothing piles up at the bounds) and rounded to ints."""

    lo: int
    hi: int
    mean: float
    sigma: float = 0.7

    def __post_init__(self) -> None:
        if not (is_int(self.lo) and is_int(self.hi) and is_real(self.mean) and is_real(self.sigma)
                and 1 <= self.lo < self.mean < self.hi <= INT_MAX and self.sigma > 0):
            raise ConfigError(f"LengthRange needs ints 1 <= lo < hi <= {INT_MAX}, a mean between them and a "
                              f"finite sigma > 0, got lo={self.lo!r}, hi={self.hi!r}, mean={self.mean!r}, "
                              f"sigma={self.sigma!r}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if not isinstance(rng, np.random.Generator):
            raise ConfigError(f"rng must be a numpy Generator, got {show(rng)}")
        n = _bounded_int(n, "LengthRange.sample: n")
        mu = _location(self.lo, self.hi, float(self.mean), self.sigma)
        lo, hi = (_PHI.cdf((math.log(x) - mu) / self.sigma) for x in (self.lo, self.hi))
        z = _inv_cdf(np.clip(rng.uniform(lo, hi, n), 1e-300, 1 - 1e-16)) if n else np.zeros(0)
        return np.clip(np.rint(np.exp(mu + self.sigma * z)), self.lo, self.hi).astype(np.int64)


def _geo(lo: int, hi: int) -> LengthRange:
    """The range with the mean the text leaves unstated: the geometric mean of its bounds."""
    return LengthRange(lo, hi, round(math.sqrt(lo * hi)))


Mixture = tuple[tuple[float, LengthRange], ...]


@dataclass(frozen=True, slots=True)
class Scenario:
    """One of the text's application scenarios: length mixtures for the new prompt tokens and the output, and
    ``num_prefixes`` shared prefixes (``prefix_kind``) of ``prefix_range`` tokens used by ``prefix_share`` of
    the requests."""

    name: str
    prompt: Mixture
    output: Mixture
    prefix_kind: str
    prefix_range: tuple[int, int]
    num_prefixes: int
    prefix_share: float


TURN = LengthRange(10, 200, 50)  # the text's dialogue turn: 10-200 tokens, about 50 on average
SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("chat", ((1.0, TURN),), ((1.0, TURN),), "system", (50, 300), 4, 0.9),
    Scenario("document", ((1.0, TURN),), ((0.7, _geo(200, 1000)), (0.3, _geo(1000, 5000))), "template",
             (100, 400), 3, 0.5),
    Scenario("code", ((1.0, TURN),), ((0.7, _geo(100, 500)), (0.3, _geo(500, 2000))), "fewshot", (200, 800), 3,
             0.7),
    Scenario("retrieval", ((1.0, _geo(10, 100)),), ((1.0, _geo(1000, 10000)),), "system", (50, 200), 2, 0.9),
)}
ALIASES = {"dialogue": "chat", "doc": "document", "rag": "retrieval"}
WORKLOADS = (*SCENARIOS, "mixed")


def _mixture(mix: Mixture, rng: np.random.Generator, n: int) -> np.ndarray:
    weights = np.array([w for w, _ in mix])
    kind = rng.choice(len(mix), size=n, p=weights / weights.sum())
    out = np.empty(n, dtype=np.int64)
    for k, (_, lengths) in enumerate(mix):
        out[kind == k] = lengths.sample(rng, int((kind == k).sum()))
    return out


# ---------------------------------------------------------------------------------------------------- arrivals
def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival times (s) of a Poisson process of ``rate`` requests/s: exponential gaps, starting at 0."""
    gaps = rng.exponential(1.0 / rate, n)
    return np.cumsum(gaps) - gaps[0] if n else gaps


def burst_arrivals(n: int, rate: float, burst_size: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival times in bursts of ``burst_size`` simultaneous requests; the bursts are Poisson at
    ``rate / burst_size`` per second, so the mean rate is still ``rate``."""
    starts = poisson_arrivals(-(-n // burst_size), rate / burst_size, rng)
    return starts[np.arange(n) // burst_size]  # not np.repeat: a burst larger than n would fill memory


def make_workload(name: str, n: int, seed: int = 0, *, rate: float = 8.0, arrival: str = "poisson",
                  burst_size: int = 16, tenants: int = 1, prefix_share: float | None = None) -> Workload:
    """``n`` requests of scenario ``name`` (``chat``/``dialogue``, ``document``, ``code``, ``retrieval``, or
    ``mixed``), identical for the same arguments and seed.

    Args:
        rate: mean arrivals per second. ``arrival``: ``"poisson"`` or ``"burst"`` (groups of ``burst_size``).
        tenants: requests are spread uniformly over tenants ``tenant-0..``; ``mixed`` names tenants after the
            scenario instead.
        prefix_share: fraction of requests that start with one of the scenario's shared prefixes (default: the
            scenario's own, see the module table; 0 turns sharing off).
    """
    key = ALIASES.get(name, name) if isinstance(name, str) else None
    if key not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)} "
                          f"(or {', '.join(ALIASES)})")
    # counts up to INT_MAX: ids must fit the pool's int32 fields, and numpy's int64 the draws
    for arg, value, ok in (("n", n, is_int(n) and 1 <= n <= INT_MAX),
                           ("seed", seed, is_int(seed) and 0 <= seed <= SEED_MAX),
                           ("rate", rate, is_real(rate) and rate > 0),
                           ("burst_size", burst_size, is_int(burst_size) and 1 <= burst_size <= INT_MAX),
                           ("tenants", tenants, is_int(tenants) and 1 <= tenants <= INT_MAX),
                           ("prefix_share", prefix_share,
                            prefix_share is None or is_real(prefix_share) and 0 <= prefix_share <= 1),
                           ("arrival", arrival, isinstance(arrival, str) and arrival in ("poisson", "burst"))):
        if not ok:
            raise ConfigError(f"make_workload: invalid {arg}={show(value)}")
    n = int(n)
    rng = np.random.default_rng(seed)
    times = poisson_arrivals(n, rate, rng) if arrival == "poisson" else burst_arrivals(n, rate, burst_size, rng)
    names = list(SCENARIOS)
    which = rng.integers(0, len(names), n) if key == "mixed" else np.full(n, names.index(key))
    new, out = np.zeros(n, np.int64), np.zeros(n, np.int64)
    pre_id: list[str | None] = [None] * n
    pre_len = np.zeros(n, np.int64)
    for k, scn in enumerate(SCENARIOS.values()):
        idx = np.flatnonzero(which == k)
        templates = rng.integers(scn.prefix_range[0], scn.prefix_range[1] + 1, scn.num_prefixes)
        new[idx], out[idx] = _mixture(scn.prompt, rng, idx.size), _mixture(scn.output, rng, idx.size)
        share = scn.prefix_share if prefix_share is None else prefix_share
        uses = rng.random(idx.size) < share
        pick = rng.integers(0, scn.num_prefixes, idx.size)
        for i, u, j in zip(idx.tolist(), uses.tolist(), pick.tolist()):
            if u:
                pre_id[i], pre_len[i] = f"{scn.name}/{scn.prefix_kind}-{j}", templates[j]
    owner = rng.integers(0, tenants, n)
    reqs = [Request(i, float(times[i]), int(new[i] + pre_len[i]), int(out[i]),
                    names[which[i]] if key == "mixed" else f"tenant-{owner[i]}", pre_id[i], int(pre_len[i]))
            for i in range(n)]
    return Workload(key, reqs)


# ---------------------------------------------------------------------------------------------------- traces
def write_trace(workload: Workload, path: str | Path) -> Path:
    """Write ``workload`` as JSONL or CSV, chosen by the suffix of ``path`` (format: module docstring).
    :func:`read_trace` gives back equal requests. The text is built in full before the file is opened; a path
    that cannot be written raises :class:`~kvlab.core.errors.ConfigError`."""
    path = check_path(path, "a trace path")
    kind = _kind(path)
    text = _jsonl_text(workload) if kind == "jsonl" else _csv_text(workload)
    try:
        path.write_bytes(text.encode("utf-8"))
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise ConfigError(f"cannot write trace {shown(path)}: {os_reason(e)}") from None
    return path


def _jsonl_text(workload: Workload) -> str:
    lines = []
    for r in workload:
        row = asdict(r)
        for name in ("prompt_tokens", "hash_ids"):
            if row[name] is None:
                del row[name]
            else:
                row[name] = list(row[name])
        # ASCII-only output: nothing in a name splits a line
        lines.append(json.dumps(row, separators=(",", ":"), allow_nan=False) + "\n")
    return "".join(lines)


def _csv_text(workload: Workload) -> str:
    rows = []
    for r in workload:
        row = asdict(r)
        row.update({name: "" if row[name] is None else " ".join(map(str, row[name]))
                    for name in ("prompt_tokens", "hash_ids")})
        row.update(prefix_id=row["prefix_id"] or "", arrival=repr(row["arrival"]))
        rows.append(row)
    # Python 3.10's csv writer refuses NUL ("need to escape"); 3.11+ writes it as it is. On 3.10 a character
    # absent from the text stands in for NUL while writing, so both write the same file.
    names = "".join(str(row[k]) for row in rows for k in ("tenant", "prefix_id"))
    nul = next((chr(c) for c in range(0xE000, 0x110000) if chr(c) not in names), "") \
        if sys.version_info < (3, 11) and "\x00" in names else ""
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=FIELDS)
    w.writeheader()
    for row in rows:
        if nul:
            row.update(tenant=row["tenant"].replace("\x00", nul), prefix_id=row["prefix_id"].replace("\x00", nul))
        w.writerow(row)
    return out.getvalue().replace(nul, "\x00") if nul else out.getvalue()


def read_trace(path: str | Path, name: str | None = None) -> Workload:
    """Read a JSONL or CSV trace (by suffix) into a :class:`Workload` named ``name`` (default: the file stem).

    Raises :class:`~kvlab.core.errors.TraceFormatError` naming the line of the first malformed record (bytes that
    are not UTF-8, a JSON line that does not parse, a CSV quote that never closes, a field of the wrong type or
    out of range, a repeated id, ...); nothing is returned unless every record is good. A file that cannot be
    read at all raises :class:`~kvlab.core.errors.ConfigError`."""
    path = check_path(path, "a trace path")
    kind = _kind(path)
    return parse_trace(read_file(path, "trace"), kind, str(path), name or path.stem)


def parse_trace(data: bytes, kind: str, where: str, name: str) -> Workload:
    """The workload named ``name`` in trace bytes ``data`` of ``kind``: kvlab's ``"jsonl"`` or ``"csv"`` (what
    :func:`read_trace` does once it has the bytes) or a production trace's ``"azure"`` or ``"mooncake"``
    (module docstring). Errors name ``where`` as the file."""
    if kind not in TRACE_KINDS:
        raise ConfigError(f"trace kind must be one of {', '.join(TRACE_KINDS)}, got {show(kind)}")
    text = _decode(data, where)
    if kind == "azure":
        return Workload(name, _azure_requests(text, where))
    if kind == "mooncake":
        return Workload(name, _mooncake_requests(text, where))
    records = _jsonl_records(text, where) if kind == "jsonl" else _csv_records(text, where)
    requests: list[Request] = []
    ids: dict[int, int] = {}
    prefixes: dict[str, tuple[int, int]] = {}
    for line, rec in records:  # lazily: a bad record is reported before a later one is even parsed
        try:
            r = _request(rec, from_text=kind == "csv")
        except (ConfigError, ValueError, TypeError, OverflowError) as e:
            raise TraceFormatError(where, line, str(e)) from None
        problem = _clash(r, ids, prefixes)
        if problem is not None:
            raise TraceFormatError(where, line, problem)
        requests.append(r)
    if not requests:
        raise TraceFormatError(where, 1, "the trace holds no request")
    return Workload(name, requests)


def _kind(path: Path) -> str:
    kind = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}.get(path.suffix.lower())
    if kind is None:
        raise ConfigError(f"trace {shown(path)} must end in .jsonl or .csv, not {show(path.suffix)}")
    return kind


def _line_breaks(text: str) -> int:
    """Line ends in ``text`` as both readers count them: ``\\n``, ``\\r`` or ``\\r\\n``."""
    return text.count("\n") + text.count("\r") - text.count("\r\n")


def _decode(data: bytes, path: str) -> str:
    """``data`` as UTF-8 text without its byte-order mark, or the line of the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = 1 + _line_breaks(data[:e.start].decode("utf-8-sig"))
        col = e.start - max(data.rfind(b"\n", 0, e.start), data.rfind(b"\r", 0, e.start))
        raise TraceFormatError(path, line, f"not UTF-8 text (byte 0x{data[e.start]:02x} at byte {col} of "
                                           f"the line)") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that names a field twice is ambiguous (``json`` would keep the last silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"field {k!r} appears twice in one object")
        out[k] = v
    return out


MAX_LINE = 1 << 24  # characters of one trace record (16 Mi: a prompt of about two million token ids)


def _jsonl_records(text: str, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for line, raw in enumerate(io.StringIO(text, newline=""), start=1):
        if len(raw) > MAX_LINE:
            raise TraceFormatError(path, line, f"a record of {len(raw):,} characters; kvlab reads at most "
                                               f"{MAX_LINE:,} a line")
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        try:
            rec = json.loads(raw, object_pairs_hook=_unique_keys)
        except RecursionError:
            raise TraceFormatError(path, line, "not valid JSON (nested too deeply)") from None
        except json.JSONDecodeError as e:
            raise TraceFormatError(path, line, f"not valid JSON ({e.msg} at column {e.colno})") from None
        except ValueError as e:  # a repeated field, or an int past Python's digit limit
            raise TraceFormatError(path, line, f"not valid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise TraceFormatError(path, line, f"expected a JSON object, got {type(rec).__name__}")
        yield line, rec


# One CSV cell at a position: quoted ("" is a quote inside; may span lines) or plain (no quote, comma, line end).
_QUOTED = re.compile(r'"([^"]*(?:""[^"]*)*)"')
_PLAIN = re.compile(r'[^,"\r\n]*')


def _csv_rows(text: str, path: str) -> Iterator[tuple[int, list[str]]]:
    """``(line, cells)`` of each record of CSV ``text``, ``line`` where the record starts; blank lines skipped.

    Our own reader rather than :mod:`csv`: that one refuses cells over ``csv.field_size_limit()`` (128 KiB, and
    a 30,000-token prompt is larger; the limit is process-wide, so raising it would change other code's CSV),
    and it reads a quote that never closes as a cell running to the end of the file, swallowing the records
    after it. It reads what :class:`csv.writer` writes (the ``excel`` dialect) and refuses any stray quote."""
    pos, line, end = 0, 1, len(text)
    while pos < end:
        if text[pos] in "\r\n":  # a blank line
            pos += 2 if text.startswith("\r\n", pos) else 1
            line += 1
            continue
        first, cells, start = line, [], pos
        while True:
            if text.startswith('"', pos):
                m = _QUOTED.match(text, pos)
                if m is None or text.startswith('"', m.end()):  # the second: "a"" is "a" plus an open quote
                    raise TraceFormatError(path, line, "a quoted cell never closes (a \" without its partner)")
                cells.append(m.group(1).replace('""', '"'))
                line += _line_breaks(m.group(1))
            else:
                m = _PLAIN.match(text, pos)
                assert m is not None  # the pattern matches the empty string
                cells.append(m.group())
            pos = m.end()
            if pos - start > MAX_LINE:
                raise TraceFormatError(path, first, f"a record of more than {MAX_LINE:,} characters; kvlab reads "
                                                    f"at most {MAX_LINE:,} a record")
            if pos == end:
                break
            if text[pos] == ",":
                pos += 1
                continue
            if text[pos] in "\r\n":
                pos += 2 if text.startswith("\r\n", pos) else 1
                line += 1
                break
            at = "" if line == first else f" (on line {line})"
            raise TraceFormatError(path, first, f"a quote inside a cell{at}; quote the whole cell and write a "
                                                f"quote inside it as \"\"")
        yield first, cells


def _csv_records(text: str, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    rows = _csv_rows(text, path)
    head = next(rows, None)
    if head is None:
        raise TraceFormatError(path, 1, "empty file: expected a header row")
    line, header = head
    unknown = [c for c in header if c not in FIELDS]
    if unknown:
        raise TraceFormatError(path, line, f"header names unknown columns {unknown}; known: {', '.join(FIELDS)}")
    twice = sorted({c for c in header if header.count(c) > 1})
    missing = [c for c in REQUIRED if c not in header]
    if twice or missing:
        raise TraceFormatError(path, line, f"header names column(s) {twice} twice" if twice
                               else f"header lacks the required column(s) {missing}")
    for line, cells in rows:
        # Every row has a cell per column (leave it empty for the default). A short row is refused, not padded:
        # it is what a stray quote leaves when a later quote closes it, the records between read as one cell.
        if len(cells) != len(header):
            span = sum(_line_breaks(c) for c in cells)
            hint = f" (the record runs over lines {line}-{line + span}: is a quote missing its partner?)" \
                if span else ""
            raise TraceFormatError(path, line, f"{len(cells)} cells for {len(header)} columns{hint}")
        yield line, {k: v for k, v in zip(header, cells) if v != ""}  # an empty cell takes the default


def _request(rec: dict[str, Any], from_text: bool) -> Request:
    """A :class:`Request` from one parsed record: CSV strings (``from_text``) or JSON values. JSON values must
    have their field's type (a number is not a string of digits, an int not a float or a bool); a JSON ``null``
    in an optional field takes its default, as an empty CSV cell does. Ranges are the :class:`Request`'s."""
    unknown = sorted(set(rec) - set(FIELDS))
    missing = [k for k in REQUIRED if k not in rec]
    if unknown or missing:
        raise ConfigError(f"unknown fields {unknown}" if unknown else f"missing field(s) {missing}")
    if not from_text:
        rec = {k: v for k, v in rec.items() if v is not None or k in REQUIRED}
    num, real, tokens = (_cell_int, _cell_float, _cell_tokens) if from_text else (_json_int, _json_float,
                                                                                  _json_tokens)
    plen, toks, hashes = rec.get("prefix_len"), rec.get("prompt_tokens"), rec.get("hash_ids")
    return Request(num(rec["id"], "id"), real(rec["arrival"], "arrival"), num(rec["prompt_len"], "prompt_len"),
                   num(rec["output_len"], "output_len"), rec.get("tenant", "default"), rec.get("prefix_id"),
                   0 if plen is None else num(plen, "prefix_len"),
                   None if toks is None else tokens(toks, "prompt_tokens"),
                   None if hashes is None else tokens(hashes, "hash_ids"))


_INT_CELL = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)
_FLOAT_CELL = re.compile(r"\s*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*", re.ASCII)
_TOKENS_CELL = re.compile(r"[0-9\s]*", re.ASCII)
_DIGITS = len(str(INT_MAX))  # longer digit strings are out of range whatever they say; refuse before int()


def _cell_int(cell: str, name: str) -> int:
    # ASCII digits only: int() would also take "1_000" and other scripts' digits, which no writer means
    if not _INT_CELL.fullmatch(cell):
        raise ConfigError(f"{name} must be an integer, got {show(cell)}")
    if len(cell.strip().lstrip("+-").lstrip("0")) > _DIGITS:
        raise ConfigError(f"{name} must be an int in 0..{INT_MAX}, got {show(cell.strip())}")
    return int(cell)


def _cell_float(cell: str, name: str) -> float:
    if not _FLOAT_CELL.fullmatch(cell):
        raise ConfigError(f"{name} must be a decimal number, got {show(cell)}")
    return float(cell)


def _cell_tokens(cell: str, name: str) -> tuple[int, ...]:
    if not _TOKENS_CELL.fullmatch(cell):
        raise ConfigError(f"{name} must be integers >= 0 separated by spaces, got {show(cell)}")
    parts = cell.split()
    if any(len(t.lstrip("0")) > _DIGITS for t in parts):
        raise ConfigError(f"{name} must be ints in 0..{INT_MAX}")
    return tuple(map(int, parts))


def _json_int(value: Any, name: str) -> int:
    if type(value) is int:  # json gives exact types: this refuses bool, float, str, null
        return value
    raise ConfigError(f"{name} must be an integer, got {show(value)}")


def _json_float(value: Any, name: str) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{name} must be a finite number of seconds, got {show(value)}") from None
    raise ConfigError(f"{name} must be a number, got {show(value)}")


def _json_tokens(value: Any, name: str) -> tuple[int, ...]:
    if type(value) is not list or any(type(t) is not int for t in value):
        raise ConfigError(f"{name} must be a list of integers, got {show(value)}")
    return tuple(value)


# ---------------------------------------------------------------------------------------------------- production traces
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


def _length(n: int, name: str, least: int) -> int:
    """A token count of a production trace, checked under the trace's own column name."""
    if not least <= n <= INT_MAX:
        raise ConfigError(f"{name} must be an int in {least}..{INT_MAX}, got {show(n)}")
    return n


def _azure_requests(text: str, where: str) -> list[Request]:
    """The requests of an Azure LLM inference trace (module docstring), or the first bad line's error."""
    rows = _csv_rows(text, where)
    head = next(rows, None)
    if head is None:
        raise TraceFormatError(where, 1, f"empty file: expected the header {','.join(AZURE_COLUMNS)}")
    line, header = head
    header = [c.strip() for c in header]
    if sorted(header) != sorted(AZURE_COLUMNS):
        raise TraceFormatError(where, line, f"an Azure trace has the header {','.join(AZURE_COLUMNS)}, got "
                                            f"{show(','.join(header))}")
    col = {c: header.index(c) for c in AZURE_COLUMNS}
    requests: list[Request] = []
    arrival = _Arrivals(10**9, "row")
    for line, cells in rows:
        try:
            if len(cells) != len(header):
                raise ConfigError(f"{len(cells)} cells for the {len(header)} columns {','.join(header)}")
            stamp = cells[col["TIMESTAMP"]].strip()
            requests.append(Request(len(requests), arrival(_azure_time(stamp), f"TIMESTAMP {stamp}"),
                                    _length(_cell_int(cells[col["ContextTokens"]], "ContextTokens"),
                                            "ContextTokens", 1),
                                    _length(_cell_int(cells[col["GeneratedTokens"]], "GeneratedTokens"),
                                            "GeneratedTokens", 0)))
        except (ValueError, TypeError, OverflowError) as e:
            raise TraceFormatError(where, line, str(e)) from None
    if not requests:
        raise TraceFormatError(where, 1, "the trace holds no request")
    return requests


_DATETIME = re.compile(r"\s*([0-9]{4})-([0-9]{2})-([0-9]{2})[ T]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]+))?\s*",
                       re.ASCII)


def _azure_time(cell: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fraction]`` as integer nanoseconds since 0001-01-01 (exact, so that arrival gaps
    keep the trace's 100 ns ticks); a fraction finer than 1 ns is refused rather than rounded."""
    m = _DATETIME.fullmatch(cell)
    if m is None:
        raise ConfigError(f"TIMESTAMP must read YYYY-MM-DD HH:MM:SS.fffffff, got {show(cell)}")
    y, mo, d, h, mi, s = map(int, m.groups()[:6])
    frac = m.group(7) or ""
    if len(frac) > 9:
        raise ConfigError(f"TIMESTAMP {cell.strip()} has {len(frac)} fractional digits; kvlab keeps time to the "
                          f"nanosecond (9 digits) and would have to round it")
    if h > 23 or mi > 59 or s > 59:
        raise ConfigError(f"TIMESTAMP {cell.strip()} is not a time of day")
    try:
        day = date(y, mo, d).toordinal()
    except ValueError:
        raise ConfigError(f"TIMESTAMP {cell.strip()} is not a calendar date") from None
    return ((day * 24 + h) * 60 + mi) * 60 * 10**9 + s * 10**9 + int(frac.ljust(9, "0"))


class _Arrivals:
    """A trace's timestamps (``per_second`` ticks a second) as seconds since its first; a timestamp earlier than
    the one before raises :class:`ConfigError` (arrivals must not go backwards)."""

    def __init__(self, per_second: int, record: str) -> None:
        self.per_second, self.record = per_second, record
        self.first: float | None = None
        self.last: float = 0
        self.last_shown = ""

    def __call__(self, t: float, shown: str) -> float:
        if self.first is None:
            self.first = t
        elif t < self.last:
            raise ConfigError(f"{shown} is earlier than the {self.record} before ({self.last_shown}); arrivals must "
                              f"not go backwards")
        self.last, self.last_shown = t, shown
        return (t - self.first) / self.per_second


def _mooncake_requests(text: str, where: str) -> list[Request]:
    """The requests of a Mooncake trace (module docstring), or the first bad line's error."""
    requests: list[Request] = []
    arrival = _Arrivals(1000, "record")
    for line, rec in _jsonl_records(text, where):
        try:
            missing = [k for k in MOONCAKE_KEYS if k not in rec]
            unknown = sorted(set(rec) - set(MOONCAKE_KEYS))
            if missing or unknown:
                raise ConfigError(f"a Mooncake record has the keys {', '.join(MOONCAKE_KEYS)}; "
                                  + (f"this one lacks {missing}" if missing else f"this one also has {unknown}"))
            t = rec["timestamp"]
            if not is_real(t):
                raise ConfigError(f"timestamp must be a finite number of milliseconds, got {show(t)}")
            requests.append(Request(len(requests), arrival(t, f"timestamp {t}"),
                                    _length(_json_int(rec["input_length"], "input_length"), "input_length", 1),
                                    _length(_json_int(rec["output_length"], "output_length"), "output_length", 0),
                                    hash_ids=_json_tokens(rec["hash_ids"], "hash_ids")))
        except (ValueError, TypeError, OverflowError) as e:
            raise TraceFormatError(where, line, str(e)) from None
    if not requests:
        raise TraceFormatError(where, 1, "the trace holds no request")
    return requests
