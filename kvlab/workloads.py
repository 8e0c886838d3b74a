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

Trace files (bring a real trace, or save a generated one) hold one request per record:

* **JSONL** (``.jsonl``): one JSON object per line; blank lines and lines starting with ``#`` are skipped.
* **CSV** (``.csv``): a header row naming the columns, then one row per request; empty optional cells take
  their default, ``prompt_tokens`` is written as space-separated integers.

=================  ========  =====================================================================
field              required  meaning
=================  ========  =====================================================================
``id``             yes       int, unique within the trace
``arrival``        yes       seconds since the start of the trace, float >= 0
``prompt_len``     yes       prompt tokens, int >= 1, including the shared prefix
``output_len``     yes       tokens the model writes, int >= 0
``tenant``         no        user or application the request belongs to (default ``"default"``)
``prefix_id``      no        name of the shared prefix the prompt starts with (default none)
``prefix_len``     no        tokens of that prefix; > 0 iff ``prefix_id`` is set, the same in every request
``prompt_tokens``  no        the prompt's token ids (``prompt_len`` of them); derived when absent
=================  ========  =====================================================================

A malformed record raises :class:`~kvlab.errors.TraceFormatError` naming the file and the 1-based line.
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from .errors import ConfigError, TraceFormatError

FIELDS = ("id", "arrival", "prompt_len", "output_len", "tenant", "prefix_id", "prefix_len", "prompt_tokens")
REQUIRED = FIELDS[:4]
_PHI = NormalDist()
_inv_cdf = np.vectorize(_PHI.inv_cdf, otypes=[float])


# ---------------------------------------------------------------------------------------------------- requests
@dataclass(frozen=True, slots=True)
class Request:
    """One request. Its prompt is ``prefix_len`` tokens of the shared prefix ``prefix_id`` (identical in every
    request naming it) followed by ``prompt_len - prefix_len`` tokens of its own; the model then writes
    ``output_len`` tokens, so the sequence peaks at :attr:`total_len` tokens in the cache.

    Invariants (checked on construction, :class:`~kvlab.errors.ConfigError` otherwise): ``arrival >= 0``,
    ``prompt_len >= 1``, ``output_len >= 0``, ``0 <= prefix_len <= prompt_len``, ``prefix_len > 0`` iff
    ``prefix_id`` is set, and ``prompt_tokens`` (when given) holds ``prompt_len`` ids >= 0.
    """

    id: int
    arrival: float
    prompt_len: int
    output_len: int
    tenant: str = "default"
    prefix_id: str | None = None
    prefix_len: int = 0
    prompt_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise numpy scalars etc. to plain Python values once
        for name in ("id", "prompt_len", "output_len", "prefix_len"):
            v = getattr(self, name)
            if isinstance(v, bool):
                raise ConfigError(f"request {self.id!r}: {name} must be an int, got {v!r}")
            try:
                set_(self, name, operator.index(v))
            except TypeError:
                raise ConfigError(f"request {self.id!r}: {name} must be an int, got {v!r}") from None
        arrival = float(self.arrival) if isinstance(self.arrival, (int, float, np.number)) else math.nan
        if not math.isfinite(arrival) or arrival < 0 or isinstance(self.arrival, bool):
            raise ConfigError(f"request {self.id}: arrival must be a finite number of seconds >= 0, "
                              f"got {self.arrival!r}")
        set_(self, "arrival", arrival)
        if self.prompt_len < 1 or self.output_len < 0:
            raise ConfigError(f"request {self.id}: prompt_len must be >= 1 and output_len >= 0, got "
                              f"{self.prompt_len} and {self.output_len}")
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ConfigError(f"request {self.id}: tenant must be a non-empty str, got {self.tenant!r}")
        if self.prefix_id is not None and (not isinstance(self.prefix_id, str) or not self.prefix_id):
            raise ConfigError(f"request {self.id}: prefix_id must be a non-empty str or None, got {self.prefix_id!r}")
        if not 0 <= self.prefix_len <= self.prompt_len or (self.prefix_len > 0) != (self.prefix_id is not None):
            raise ConfigError(f"request {self.id}: prefix_len={self.prefix_len} with prefix_id={self.prefix_id!r} "
                              f"and prompt_len={self.prompt_len} (need 0 < prefix_len <= prompt_len exactly "
                              f"when a prefix_id is set)")
        if self.prompt_tokens is not None:
            toks = tuple(operator.index(t) for t in self.prompt_tokens)
            if len(toks) != self.prompt_len or any(t < 0 for t in toks):
                raise ConfigError(f"request {self.id}: prompt_tokens must be {self.prompt_len} ids >= 0, got "
                                  f"{len(toks)} ids")
            set_(self, "prompt_tokens", toks)

    @property
    def total_len(self) -> int:
        """Tokens in the cache when the request finishes: prompt plus output."""
        return self.prompt_len + self.output_len

    def prompt_token_ids(self, vocab_size: int = 32000) -> list[int]:
        """The prompt's token ids: :attr:`prompt_tokens` when given, else derived deterministically (a stable
        hash seeds a generator) so that every request naming the same prefix starts with the same ids, and a
        prefix cache that hashes token ids finds the sharing the trace describes."""
        if self.prompt_tokens is not None:
            return list(self.prompt_tokens)
        if vocab_size < 1:
            raise ConfigError(f"vocab_size must be >= 1, got {vocab_size}")
        head = _token_ids(f"prefix:{self.prefix_id}", self.prefix_len, vocab_size) if self.prefix_id else []
        return head + _token_ids(f"request:{self.id}", self.prompt_len - self.prefix_len, vocab_size)


def _token_ids(key: str, n: int, vocab_size: int) -> list[int]:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, vocab_size, n).tolist()


# ---------------------------------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """A named list of requests in arrival order (ties by id). Ids are unique and every request naming a
    prefix agrees on its length (else :class:`~kvlab.errors.ConfigError`)."""

    name: str
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.requests = sorted(self.requests, key=lambda r: (r.arrival, r.id))
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
        if r.id in ids:
            return i, f"request id {r.id} appears twice"
        ids[r.id] = i
        if r.prefix_id is not None:
            first, n = prefixes.setdefault(r.prefix_id, (r.id, r.prefix_len))
            if n != r.prefix_len:
                return i, (f"request {r.id} says prefix {r.prefix_id!r} has {r.prefix_len} tokens but request "
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
        if not (1 <= self.lo < self.mean < self.hi) or self.sigma <= 0:
            raise ConfigError(f"LengthRange needs 1 <= lo < mean < hi and sigma > 0, got lo={self.lo}, "
                              f"hi={self.hi}, mean={self.mean}, sigma={self.sigma}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
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
    return np.repeat(starts, burst_size)[:n]


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
    key = ALIASES.get(name, name)
    if key not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)} "
                          f"(or {', '.join(ALIASES)})")
    for arg, value, ok in (("n", n, isinstance(n, int) and n >= 1),
                           ("rate", rate, isinstance(rate, (int, float)) and 0 < rate < math.inf),
                           ("burst_size", burst_size, isinstance(burst_size, int) and burst_size >= 1),
                           ("tenants", tenants, isinstance(tenants, int) and tenants >= 1),
                           ("prefix_share", prefix_share, prefix_share is None or 0 <= prefix_share <= 1),
                           ("arrival", arrival, arrival in ("poisson", "burst"))):
        if not ok or isinstance(value, bool):
            raise ConfigError(f"make_workload: invalid {arg}={value!r}")
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
    """Write ``workload`` as JSONL or CSV, chosen by the suffix of ``path`` (format: module docstring)."""
    path = Path(path)
    kind = _kind(path)
    rows = [asdict(r) for r in workload]
    with path.open("w", newline="", encoding="utf-8") as f:
        if kind == "jsonl":
            for row in rows:
                if row["prompt_tokens"] is None:
                    del row["prompt_tokens"]
                else:
                    row["prompt_tokens"] = list(row["prompt_tokens"])
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
        else:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            for row in rows:
                toks = row["prompt_tokens"]
                row.update(prefix_id=row["prefix_id"] or "",
                           prompt_tokens="" if toks is None else " ".join(map(str, toks)),
                           arrival=repr(row["arrival"]))
                w.writerow(row)
    return path


def read_trace(path: str | Path, name: str | None = None) -> Workload:
    """Read a JSONL or CSV trace (by suffix) into a :class:`Workload` named ``name`` (default: the file stem).
    Raises :class:`~kvlab.errors.TraceFormatError` naming the line of the first malformed record."""
    path = Path(path)
    kind = _kind(path)
    try:
        with path.open(newline="", encoding="utf-8") as f:
            records = list(_jsonl_records(f, str(path)) if kind == "jsonl" else _csv_records(f, str(path)))
    except OSError as e:
        raise ConfigError(f"cannot read trace {path}: {e.strerror or e}") from None
    requests, lines = [], []
    for line, rec in records:
        try:
            requests.append(_request(rec))
        except (ConfigError, ValueError, TypeError) as e:
            raise TraceFormatError(str(path), line, str(e)) from None
        lines.append(line)
    if not requests:
        raise TraceFormatError(str(path), max(1, len(records)), "the trace holds no request")
    bad = _inconsistency(requests)
    if bad is not None:
        raise TraceFormatError(str(path), lines[bad[0]], bad[1])
    return Workload(name or path.stem, requests)


def _kind(path: Path) -> str:
    kind = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}.get(path.suffix.lower())
    if kind is None:
        raise ConfigError(f"trace {path} must end in .jsonl or .csv, not {path.suffix!r}")
    return kind


def _jsonl_records(f: Any, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for line, text in enumerate(f, start=1):
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceFormatError(path, line, f"not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict):
            raise TraceFormatError(path, line, f"expected a JSON object, got {type(rec).__name__}")
        yield line, rec


def _csv_records(f: Any, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    reader = csv.DictReader(f)
    header = reader.fieldnames or []
    unknown = [c for c in header if c not in FIELDS]
    if unknown or not header:
        raise TraceFormatError(path, 1, f"header names unknown columns {unknown}; known: {', '.join(FIELDS)}"
                               if unknown else "empty file: expected a header row")
    for row in reader:
        if None in row:  # DictReader puts surplus cells under the key None
            raise TraceFormatError(path, reader.line_num, f"{len(header) + len(row[None])} cells for "
                                                         f"{len(header)} columns")
        yield reader.line_num, {k: v for k, v in row.items() if v not in ("", None)}


def _request(rec: dict[str, Any]) -> Request:
    """A :class:`Request` from one parsed record (JSON values or CSV strings)."""
    unknown = sorted(set(rec) - set(FIELDS))
    missing = [k for k in REQUIRED if k not in rec]
    if unknown or missing:
        raise ConfigError(f"unknown fields {unknown}" if unknown else f"missing field(s) {missing}")
    toks = rec.get("prompt_tokens")
    if isinstance(toks, str):
        toks = [_int(t, "prompt_tokens") for t in toks.split()]
    elif toks is not None:
        if not isinstance(toks, list):
            raise ConfigError(f"prompt_tokens must be a list of ints, got {toks!r}")
        toks = [_int(t, "prompt_tokens") for t in toks]
    arrival = rec["arrival"]
    if isinstance(arrival, str):
        try:
            arrival = float(arrival)
        except ValueError:
            raise ConfigError(f"arrival must be a number, got {arrival!r}") from None
    return Request(_int(rec["id"], "id"), arrival, _int(rec["prompt_len"], "prompt_len"),
                   _int(rec["output_len"], "output_len"), rec.get("tenant", "default"), rec.get("prefix_id"),
                   _int(rec.get("prefix_len", 0), "prefix_len"), None if toks is None else tuple(toks))


def _int(value: Any, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ConfigError(f"{name} must be an integer, got {value!r}")
