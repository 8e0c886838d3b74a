"""What a KV transfer costs, measured: the connector against the transport's own limit, and against recomputing.

* :func:`measure_transfer` starts a sender and a receiver (two processes, gloo over 127.0.0.1) and times, round
  after round and alternating, (a) the connector moving ``requests`` prompts of ``tokens`` tokens (announce,
  allocate on the receiver, one gathered message per layer, scatter into the receiver's blocks) and (b) one
  plain ``send`` of a contiguous tensor of exactly the same bytes: the physical limit of the transport. Each
  variant's figure is its best round, timed on the receiver from the moment it tells the sender to go.
* :func:`prefill_seconds` times recomputing a prompt's KV instead, with the real model or the tiny decoder
  (chunked prefill, as engines do for long prompts, so the causal mask stays small).
* :func:`move_or_recompute` puts the two side by side for a list of prompt lengths (chapter 2.2.7's table), and
  :func:`move_or_recompute_table` prints them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.core.checks import check_positive
from kvlab.core.device import torch_threads
from kvlab.core.errors import ConfigError
from kvlab.serve.model import Llama, TinyConfig, TinyLlama
from kvlab.core.pool import BlockPool
from kvlab.core.sequence import SequenceManager
from kvlab.core.spec import KVSpec
from kvlab.distributed.connector import KVReceiver, KVSender, RemoteRequest
from kvlab.distributed.launch import DEFAULT_TIMEOUT, Link, run_threads, spawn

TAG_GO, TAG_PLAIN = 4, 5


@dataclass(frozen=True)
class TransferTiming:
    """Best round of each variant: ``connector`` and ``plain`` seconds for the same ``bytes``."""
    block_size: int
    tokens: int
    requests: int
    blocks: int
    bytes: int
    connector: float
    plain: float
    scattered: bool = False

    @property
    def ratio(self) -> float:
        """Connector throughput as a fraction of the plain send's (1.0: as fast as the transport allows)."""
        return self.plain / self.connector

    @property
    def blocks_per_s(self) -> float:
        return self.blocks / self.connector

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.connector / 1e9

    @property
    def plain_gb_per_s(self) -> float:
        return self.bytes / self.plain / 1e9


@dataclass(frozen=True)
class TransferCase:
    """One measurement: ``requests`` prompts of ``tokens`` tokens of a KV layout, blocks in runs or scattered."""
    block_size: int = 16
    tokens: int = 4096
    requests: int = 4
    num_layers: int = 4
    num_kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    scattered: bool = False

    def __post_init__(self) -> None:
        self.spec()  # bad sizes or dtype refused here, not in a rank

    def spec(self) -> KVSpec:
        """The (CPU) spec both ranks use; :class:`ConfigError` for bad sizes or an unknown dtype name."""
        for name in ("tokens", "requests"):
            check_positive(getattr(self, name), name)
        dtype = getattr(torch, self.dtype, None) if isinstance(self.dtype, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"dtype must name a torch dtype, got {self.dtype!r}")
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, dtype, torch.device("cpu"))


def _go(link: Link, peer: int, send: bool) -> None:
    flag = link.control([1])
    (link.send if send else link.recv)(flag, peer, TAG_GO)


def transfer_rank(link: Link, *, cases: list[TransferCase], rounds: int) -> list[dict[str, Any]]:
    """One rank of :func:`measure_transfers`: rank 0 sends, rank 1 receives and times, case after case."""
    return [_measure_case(link, c, rounds) for c in cases]


def _measure_case(link: Link, case: TransferCase, rounds: int) -> dict[str, Any]:
    s, tokens, requests, scattered = case.spec(), case.tokens, case.requests, case.scattered
    per_seq = -(-tokens // s.block_size)
    manager = SequenceManager(BlockPool(requests * per_seq + 1, spec=s), prefix_cache=None)
    sender = link.rank == 0
    conn: KVSender | KVReceiver = (KVSender if sender else KVReceiver)(link, manager, 1 - link.rank)
    prompts = [[(i * 7 + j) % 1000 for j in range(tokens)] for i in range(requests)]
    nbytes = requests * per_seq * s.bytes_per_block  # what the connector stages: whole blocks (same spec both sides)
    plain = torch.empty(nbytes // torch.empty((), dtype=s.dtype).element_size(), dtype=s.dtype)
    best = {"connector": float("inf"), "plain": float("inf")}
    if sender:
        seqs = [manager.create(p) for p in prompts]
        if scattered:  # block by block, request after request: each prompt's blocks lie ``requests`` ids apart
            B = s.block_size
            for at in range(0, tokens, B):
                manager.append_tokens(seqs, [p[at:at + B] for p in prompts])
        else:
            manager.append_tokens(seqs, prompts)
        manager.pool.storage_of().kv.normal_()
        plain.normal_()
    for _ in range(rounds):
        # (a) the connector
        if sender:
            _go(link, 1, send=False)
            assert isinstance(conn, KVSender)
            for i, (q, p) in enumerate(zip(seqs, prompts)):
                conn.request_finished(RemoteRequest(i, tuple(p), 0), q)
            conn.start_save(conn.build_connector_meta())
            for layer in range(s.num_layers):
                conn.save_kv_layer(layer)
            conn.wait_for_save()
            conn.get_finished()
        else:
            assert isinstance(conn, KVReceiver)
            _go(link, 0, send=True)
            t0 = time.perf_counter()
            got = conn.poll_requests() or []
            live = []
            for r in got:
                q = manager.create(list(r.prompt))
                manager.append_tokens([q], [list(r.prompt)])
                conn.update_state_after_alloc(r, q)
                live.append(q)
            conn.start_load_kv(conn.build_connector_meta())
            for layer in range(s.num_layers):
                conn.wait_for_layer_load(layer)
            conn.get_finished()
            best["connector"] = min(best["connector"], time.perf_counter() - t0)
            for q in live:
                manager.free(q)
        # (b) one contiguous tensor of the same bytes
        if sender:
            _go(link, 1, send=False)
            link.send(plain, 1, TAG_PLAIN)
        else:
            _go(link, 0, send=True)
            t0 = time.perf_counter()
            link.recv(plain, 0, TAG_PLAIN)
            best["plain"] = min(best["plain"], time.perf_counter() - t0)
    if isinstance(conn, KVSender):
        conn.finish()
        return {}
    assert isinstance(conn, KVReceiver) and conn.poll_requests() is None
    manager.check_invariants()
    sent = conn.report.bytes // rounds
    return {"bytes": sent, "plain_bytes": plain.numel() * plain.element_size(),
            "blocks": conn.report.blocks_received // rounds, **best}


def measure_transfers(cases: list[TransferCase], rounds: int = 5, *, timeout: float = DEFAULT_TIMEOUT,
                      threads: bool = False) -> list[TransferTiming]:
    """Time the connector against a plain send of the same bytes for each case, in one two-rank group (see the
    module docstring). A ``scattered`` case interleaves the sender's blocks of its requests (a pool that has been
    busy a while), so every layer is gathered into a staging buffer first instead of sent from the pool in runs."""
    check_positive(rounds, "rounds")
    if not isinstance(cases, (list, tuple)) or not all(isinstance(c, TransferCase) for c in cases):
        raise ConfigError(f"cases must be a list of TransferCase, got {cases!r}")
    kw = {"cases": list(cases), "rounds": rounds}
    _, got = (run_threads if threads else spawn)([transfer_rank, transfer_rank], [kw, kw], timeout=timeout)
    out = []
    for c, g in zip(cases, got):
        assert g["bytes"] == g["plain_bytes"], g
        out.append(TransferTiming(c.block_size, c.tokens, c.requests, g["blocks"], g["bytes"], g["connector"],
                                  g["plain"], c.scattered))
    return out


def measure_transfer(block_size: int = 16, tokens: int = 4096, requests: int = 4, *, rounds: int = 5,
                     timeout: float = DEFAULT_TIMEOUT, threads: bool = False, **layout: Any) -> TransferTiming:
    """:func:`measure_transfers` of one :class:`TransferCase` (``layout``: its other fields)."""
    unknown = sorted(set(layout) - set(TransferCase.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"measure_transfer got unknown layout fields {unknown}; "
                          f"known: {sorted(TransferCase.__dataclass_fields__)}")
    return measure_transfers([TransferCase(block_size, tokens, requests, **layout)], rounds, timeout=timeout,
                             threads=threads)[0]


@torch.no_grad()
def prefill_seconds(prompt_len: int, cfg: TinyConfig | None = None, block_size: int = 16, chunk: int = 2048,
                    rounds: int = 1, *, model: Llama | None = None) -> float:
    """Best of ``rounds`` wall times of computing a ``prompt_len``-token prompt's KV, ``chunk`` tokens per step,
    with ``model`` (e.g. the real one of :func:`kvlab.load_model`; ``cfg`` must then be None) or else the tiny
    decoder of ``cfg``. The thread count is the caller's (:func:`kvlab.torch_threads`)."""
    for name, value in (("prompt_len", prompt_len), ("chunk", chunk), ("rounds", rounds)):
        check_positive(value, name)
    if model is not None and not isinstance(model, Llama):
        raise ConfigError(f"model must be a kvlab Llama (kvlab.load_model, TinyLlama), got {model!r:.80}")
    if model is not None and cfg is not None:
        raise ConfigError(f"give a model or a cfg, not both (cfg {cfg!r:.80})")
    model = model or TinyLlama(cfg or TinyConfig())
    spec, vocab = model.cfg.kv_spec(block_size, model.dtype, model.device), model.cfg.vocab_size
    prompt = [(7 * i) % vocab for i in range(prompt_len)]
    warm = SequenceManager(BlockPool(8, spec=spec))
    model.step(warm, [warm.create(prompt[:64])], [prompt[:64]])  # first-use costs stay out of the timing
    best = float("inf")
    for _ in range(rounds):
        manager = SequenceManager(BlockPool(-(-prompt_len // block_size) + 1, spec=spec))
        seq = manager.create(prompt)
        t0 = time.perf_counter()
        for at in range(0, prompt_len, chunk):
            model.step(manager, [seq], [prompt[at:at + chunk]])
        best = min(best, time.perf_counter() - t0)
    return best


@dataclass(frozen=True)
class MoveOrRecompute:
    """One prompt length: its KV's ``bytes``, the seconds to move them (``transfer``: the connector's best round;
    ``plain``: one plain send of the same bytes) and to compute them again (``recompute``: chunked prefill)."""
    tokens: int
    bytes: int
    transfer: float
    plain: float
    recompute: float

    @property
    def ratio(self) -> float:
        """Recomputing's seconds over moving's (above 1: moving the KV is faster)."""
        return self.recompute / self.transfer

    @property
    def break_even_mb_s(self) -> float:
        """The link speed (MB/s) at which sending the bytes takes as long as recomputing them."""
        return self.bytes / self.recompute / 1e6


def move_or_recompute(lengths: list[int], cfg: TinyConfig | None = None, *, model: Llama | None = None,
                      rounds: int = 3, threads: bool = False, timeout: float = 60.0, recompute_threads: int = 1,
                      progress: bool = False) -> list[MoveOrRecompute]:
    """For each prompt length, time moving its KV between two ranks (:func:`measure_transfers`, ``rounds``
    rounds, one request per case, 16-token blocks, the KV layout of ``model`` or of the tiny decoder of ``cfg``)
    and recomputing it here (:func:`prefill_seconds`: the real model once per length, the tiny decoder best of two
    up to 4,096 tokens, once above) on ``recompute_threads`` torch threads: one by default, since on a shared
    machine a second thread mostly waits for a busy core (measured on 2 cores at load 8: a 8k-token tiny recompute
    took 10.8 s on two threads, 2.6 s on one)."""
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise ConfigError(f"lengths must be a non-empty list of prompt lengths, got {lengths!r:.80}")
    shape = (model.cfg if model is not None else cfg or TinyConfig())
    layout: dict[str, Any] = dict(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                                  head_dim=shape.head_dim)
    if model is not None:
        layout["dtype"] = str(model.dtype).removeprefix("torch.")
    moved = measure_transfers([TransferCase(16, n, 1, **layout) for n in lengths], rounds, timeout=timeout,
                              threads=threads)
    from tqdm.auto import tqdm

    out = []
    with torch_threads(recompute_threads):
        for n, t in zip(tqdm(lengths, desc="recomputing", disable=not progress), moved):
            again = (prefill_seconds(n, model=model) if model is not None
                     else prefill_seconds(n, cfg, rounds=1 if n > 4096 else 2))
            out.append(MoveOrRecompute(n, t.bytes, t.connector, t.plain, again))
    return out


def move_or_recompute_table(rows: list[MoveOrRecompute]) -> str:
    """:func:`move_or_recompute`'s rows as text, a legend line first."""
    lines = ["列 (columns)：提示 token 数 (tokens)、KV 字节 (KV bytes)、传输 ms (transfer)、"
             "同样字节的一次普通 send ms (plain send)、"
             "重新计算 ms (recompute)、重新计算 / 传输 (ratio)、打平所需的链路 MB/s (break-even)",
             f"{'tokens':>7s} {'KV bytes':>12s} {'transfer':>9s} {'plain':>7s} {'recompute':>10s} {'ratio':>8s} "
             f"{'MB/s':>8s}"]
    for r in rows:
        lines.append(f"{r.tokens:7,d} {r.bytes:12,d} {r.transfer * 1e3:9.2f} {r.plain * 1e3:7.2f} "
                     f"{r.recompute * 1e3:10.1f} {r.ratio:8.1f} {r.break_even_mb_s:8.1f}")
    return "\n".join(lines)


def plot_move_or_recompute(rows: list[MoveOrRecompute], title: str) -> Any:
    """Transfer and recompute milliseconds of :func:`move_or_recompute`'s rows against the prompt length, on log
    axes; returns the matplotlib figure (shown in a notebook as the cell's result)."""
    import matplotlib.pyplot as plt  # only when a figure is asked for: the ranks never need matplotlib

    if not rows:
        raise ConfigError("no rows to plot: move_or_recompute gives one per prompt length")
    fig, ax = plt.subplots(figsize=(6, 3))
    tokens = [r.tokens for r in rows]
    ax.loglog(tokens, [r.transfer * 1e3 for r in rows], "o-", label="传输 (transfer, connector)")
    ax.loglog(tokens, [r.recompute * 1e3 for r in rows], "s-", label="重新计算 (recompute)")
    ax.set_xlabel("提示 token 数 (prompt tokens)")
    ax.set_ylabel("毫秒 (ms)")
    ax.legend(fontsize=9)
    ax.set_title(title, fontsize=10)
    return fig
