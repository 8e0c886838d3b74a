"""Real production traces: load them as :class:`~kvlab.workloads.mixes.Workload` s, and bound their prefix sharing.

kvlab bundles three traces, unmodified (``kvlab/data/traces/``; sources and licences in ``ATTRIBUTION.md``):

==========================  ========  ============================================================
name                        requests  what
==========================  ========  ============================================================
``azure-conv-2023``         19,366    Azure LLM inference trace 2023, a conversation service (Splitwise, ISCA 2024)
``azure-code-2023``         8,819     the same trace, a code-completion service
``mooncake-conversation``   12,031    Mooncake (FAST 2025): one hour of Kimi's chat traffic, with prompt hash ids
==========================  ========  ============================================================

:func:`load_trace` reads a bundled name or any file in one of three formats (gzip-compressed or not):

* ``"azure"``: CSV with the header ``TIMESTAMP,ContextTokens,GeneratedTokens``; ``TIMESTAMP`` is a date and
  time such as ``2023-11-16 18:15:46.6805900``, read exactly (integer nanoseconds: up to 9 fractional digits,
  more are refused rather than rounded away).
* ``"mooncake"``: JSONL, one object a line with ``timestamp`` (ms), ``input_length``, ``output_length`` and
  ``hash_ids`` (one id per 512 prompt tokens; equal leading ids = equal prompt prefix, see
  :attr:`Request.hash_ids <kvlab.workloads.mixes.Request>`).
* ``"kvlab"``: what :func:`~kvlab.workloads.mixes.write_trace` writes, JSONL or CSV.

Left to ``None``, the format is taken from the first record: the Azure header, a JSON object holding
``input_length`` or ``hash_ids`` but no ``prompt_len``, else kvlab's (JSONL if it starts with ``{`` or ``[``,
CSV otherwise). A format given that the first record plainly contradicts (``"azure"`` for a file whose first
record is a Mooncake object, say) is refused at that line, naming the format the file looks like. Arrival times
are seconds since the first request; request ids number the records from 0 in file order; the tenant is
``"default"``. A malformed record raises :class:`~kvlab.core.errors.TraceFormatError` naming the
file and the 1-based line, and nothing is returned.

:func:`prefix_hits` and :func:`prefix_hit_bound` say how much prompt an *unbounded* prefix cache could serve: each
request reuses the longest prompt prefix it shares with an earlier request, in whole blocks, leaving one token
to compute. No finite cache does better, so it is the yardstick for a real one.
"""
from __future__ import annotations

import io
import json
from collections.abc import Hashable, Sequence
from pathlib import Path

import numpy as np

from kvlab.core.checks import check_choice, check_positive, is_path
from kvlab.core.errors import ConfigError, TraceFormatError
from kvlab.core.files import gunzip, read_file
from kvlab.workloads.mixes import AZURE_COLUMNS, HASH_BLOCK, Request, Workload, parse_trace

DATA = Path(__file__).parents[1] / "data" / "traces"
TRACES: dict[str, str] = {
    "azure-conv-2023": "azure_conv_2023.csv.gz",
    "azure-code-2023": "azure_code_2023.csv.gz",
    "mooncake-conversation": "mooncake_conversation_trace.jsonl.gz",
}
FORMATS = ("azure", "mooncake", "kvlab")


def trace_names() -> list[str]:
    """The names of the bundled traces, for :func:`load_trace`."""
    return list(TRACES)


# ---------------------------------------------------------------------------------------------------- loading
def load_trace(name_or_path: str | Path, format: str | None = None) -> Workload:
    """The trace ``name_or_path`` as a :class:`~kvlab.workloads.mixes.Workload`: a bundled name (:func:`trace_names`)
    or a file in ``format`` ``"azure"``, ``"mooncake"`` or ``"kvlab"`` (``None``: detected; module docstring).
    The workload is named after the bundled trace or the file (``conv.csv.gz`` gives ``conv``).

    Raises :class:`~kvlab.core.errors.ConfigError` for an unknown name or a file that cannot be read, and
    :class:`~kvlab.core.errors.TraceFormatError` (file and line) for a malformed one; nothing is half-loaded."""
    check_choice(format, "trace format", (*FORMATS, None))
    if isinstance(name_or_path, str) and name_or_path in TRACES:
        path, name = DATA / TRACES[name_or_path], name_or_path
    elif is_path(name_or_path):
        path = Path(name_or_path)
        name = path.name.removesuffix(".gz").rsplit(".", 1)[0] or path.name
    else:
        raise ConfigError(f"a trace is a bundled name or a path, got {name_or_path!r:.60}; bundled traces: "
                          f"{', '.join(TRACES)}")
    try:
        data = read_file(path, "trace")
    except ConfigError as e:
        raise ConfigError(f"{e}; it is no bundled trace either ({', '.join(TRACES)})") from None
    where = str(path)
    if data.startswith(b"\x1f\x8b"):
        data = gunzip(data, where, lambda out, problem: TraceFormatError(where, _lines_in(out), problem))
    elif path.suffix.lower() == ".gz":
        raise TraceFormatError(where, 1, "the name ends in .gz but the file is not gzip data")
    return parse_trace(data, _reader(format, data, where), where, name)


def _lines_in(chunks: list[bytes]) -> int:
    """The line the text decompressed so far ends on (1-based; line ends as the readers count them)."""
    text = b"".join(chunks)
    return 1 + text.count(b"\n") + text.count(b"\r") - text.count(b"\r\n")


def _first_record(data: bytes) -> tuple[int, str]:
    """The first line of ``data`` that is neither blank nor a ``#`` comment, stripped, and its 1-based number
    (``(1, "")`` if none). Only to choose a reader: undecodable bytes are replaced here, and the reader reports
    them."""
    for number, raw in enumerate(io.StringIO(data.decode("utf-8-sig", "replace"), newline=""), start=1):
        line = raw.strip()
        if line and not line.startswith("#"):
            return number, line
    return 1, ""


# What each format's first record shows, for a message saying which one a file looks like.
LOOKS = {"azure": "an Azure CSV trace (its header TIMESTAMP,ContextTokens,GeneratedTokens)",
         "mooncake": "a Mooncake JSONL trace (input_length and hash_ids, no prompt_len)",
         "kvlab": "a kvlab trace (prompt_len)"}


def _looks_like(first: str) -> str | None:
    """The format (:data:`FORMATS`) that the first record ``first`` plainly shows, or None when it shows none
    (a malformed line: the reader asked for says what is wrong with it)."""
    cells = [c.strip() for c in first.split(",")]
    if sorted(cells) == sorted(AZURE_COLUMNS):
        return "azure"
    if not first.startswith(("{", "[")):
        return "kvlab" if "prompt_len" in cells else None  # kvlab's CSV header names its fields
    try:
        rec = json.loads(first)
    except (ValueError, RecursionError):
        return None
    if not isinstance(rec, dict):
        return None
    if "prompt_len" in rec:  # kvlab's own records name prompt_len and may hold hash_ids too
        return "kvlab"
    return "mooncake" if "input_length" in rec or "hash_ids" in rec else None


def _reader(format: str | None, data: bytes, where: str) -> str:
    """The reader (:data:`kvlab.workloads.mixes.TRACE_KINDS`) for ``data`` in ``format``, detected from the first
    record where the format leaves it open; a :class:`~kvlab.core.errors.TraceFormatError` at that record when
    it plainly belongs to another format than the one given."""
    line, first = _first_record(data)
    looks = _looks_like(first)
    if format is not None and looks is not None and looks != format:
        raise TraceFormatError(where, line, f"read as format {format!r}, but it looks like {LOOKS[looks]}: give "
                                            f"format {looks!r} (kvlab's --format {looks}), or none to detect it")
    if format in ("azure", "mooncake"):
        return format
    if format is None and looks in ("azure", "mooncake"):
        return looks
    return "jsonl" if first.startswith(("{", "[")) else "csv"  # a CSV header starts with a column name


# ---------------------------------------------------------------------------------------------------- hit bound
class _Trie:
    """Chains of keys, one tree per tenant: node ``n``'s child under key ``k`` is ``children[n, k]``. A node
    stands for a chain prefix (the keys from the root to it), so equal leading keys share nodes."""

    def __init__(self) -> None:
        self.children: dict[tuple[int, Hashable], int] = {}
        self.roots: dict[str, int] = {}
        self.size = 0

    def _new(self) -> int:
        self.size += 1
        return self.size - 1

    def insert(self, tenant: str, keys: Sequence[Hashable]) -> tuple[int, list[int]]:
        """Add the chain ``keys`` of ``tenant``; returns how many leading keys were there before, and the nodes
        of the chain (``nodes[j]`` stands for ``keys[:j + 1]``)."""
        node = self.roots.get(tenant)
        if node is None:
            node = self.roots[tenant] = self._new()
        known, nodes = 0, []
        for key in keys:
            child = self.children.get((node, key))
            if child is None:
                child = self.children[node, key] = self._new()
            else:
                known += 1  # a new node has no children, so the known keys are the leading ones
            nodes.append(child)
            node = child
        return known, nodes


def prefix_hits(workload: Workload, block_size: int) -> np.ndarray:
    """Per request of ``workload`` (in its order: arrival, ties by id), the prompt tokens an unbounded prefix
    cache of ``block_size``-token blocks could serve: the longest prompt prefix the request shares with an
    earlier request of its tenant (kvlab's cache keeps tenants apart), rounded down to whole blocks, and at
    most ``prompt_len - 1`` (the last prompt token is computed for its logits). An int64 array.

    For a request R with :attr:`~kvlab.workloads.mixes.Request.hash_ids` and an earlier E whose ids agree on the
    first ``k``, the shared tokens are ``min(cover(E, k), cover(R, k))`` with ``cover(X, k) = min(512 k,
    X.prompt_len)`` (a last id may cover a partial block); R's hit is the most over all E, rounded down to
    the block. Computed with a trie of id chains: linear in the ids. Any block size works: tokens are content
    (``id * 512 + offset``), so a block is shared iff all its tokens lie in the common chain, and a block that
    straddles into the first differing id is lost.

    Requests without hash ids are compared by their token ids (:meth:`~kvlab.workloads.mixes.Request.prompt_token_ids`:
    given, or derived from the prefix) block by block. A workload mixing the two kinds raises
    :class:`~kvlab.core.errors.ConfigError`: their token ids come from unrelated schemes."""
    block_size = check_positive(block_size, "block_size")
    if not isinstance(workload, Workload):
        raise ConfigError(f"prefix_hits bounds a Workload, got {workload!r:.60}")
    requests = workload.requests
    hashed = sum(r.hash_ids is not None for r in requests)
    if 0 < hashed < len(requests):
        first = next(r for r in requests if r.hash_ids is None)
        raise ConfigError(f"workload {workload.name!r} mixes {hashed} requests with hash_ids and "
                          f"{len(requests) - hashed} without (request {first.id}); bound one kind at a time")
    hits = _hash_id_hits(requests, block_size) if hashed else _token_hits(requests, block_size)
    return np.array(hits, dtype=np.int64)


def prefix_hit_bound(workload: Workload, block_size: int) -> int:
    """Prompt tokens an unbounded prefix cache could serve over the whole ``workload``: the sum of
    :func:`prefix_hits` (its docstring says how each request's hit is counted)."""
    return int(prefix_hits(workload, block_size).sum())


def _hash_id_hits(requests: Sequence[Request], B: int) -> list[int]:
    trie, hits = _Trie(), []
    cover: dict[int, int] = {}  # node -> the most tokens an earlier request has under that chain prefix
    for r in requests:
        ids, n = r.hash_ids or (), r.prompt_len
        known, nodes = trie.insert(r.tenant, ids)
        shared = min(cover[nodes[known - 1]], HASH_BLOCK * known, n) if known else 0
        hits.append(min(shared, n - 1) // B * B)
        for j, node in enumerate(nodes, start=1):
            cover[node] = max(cover.get(node, 0), HASH_BLOCK * j if j < len(ids) else n)
    return hits


def _token_hits(requests: Sequence[Request], B: int) -> list[int]:
    trie, hits = _Trie(), []
    for r in requests:
        toks = r.prompt_token_ids()
        known, _ = trie.insert(r.tenant, [tuple(toks[i:i + B]) for i in range(0, len(toks) - B + 1, B)])
        hits.append(min(known, (r.prompt_len - 1) // B) * B)
    return hits
