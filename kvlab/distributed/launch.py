"""Process groups on ``torch.distributed`` for kvlab's multi-rank lessons: gloo on the CPU, NCCL on CUDA.

A :class:`Link` is one rank's handle on its group: point-to-point sends and receives, an all-reduce, and a
bounded wait that turns the backend's failures into kvlab's typed errors (a closed connection is
:class:`PeerLostError`, a silent peer :class:`TransferTimeoutError`). Three ways to get links:

* :func:`spawn` starts ``world_size`` processes on 127.0.0.1 (a free port, gloo) and returns what each rank's
  function returned; a rank that raised re-raises here, a rank that hangs is killed at the deadline;
* :func:`from_env` joins the group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``), across machines too (see ``docs/distributed.md``);
* :func:`run_threads` runs the ranks as threads of this process, each with its own gloo group over loopback
  TCP (the notebook does this so one kernel can show both pools live).

Nothing here is a transport of kvlab's own: every byte goes through the backend's ``send``/``recv``.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from kvlab.core.checks import check_positive, check_real
from kvlab.core.errors import ConfigError, KVLabError
from kvlab.distributed.errors import PeerLostError, ProtocolError, TransferError, TransferTimeoutError

DEFAULT_TIMEOUT = 30.0  # seconds any wait on a peer may take
MAX_MESSAGE = 1 << 26  # bytes of one control message (an announce of 64 MiB: prompts of millions of tokens)
RankFn = Callable[..., Any]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def as_device(device: Any) -> torch.device:
    """``device`` as a torch device, else :class:`ConfigError`."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{device!r} is not a torch device (cpu, cuda, cuda:1)") from None


def backend_for(device: torch.device | str) -> str:
    """``"nccl"`` for CUDA tensors, ``"gloo"`` otherwise."""
    return "nccl" if as_device(device).type == "cuda" else "gloo"


class Group(Protocol):
    """What a link needs of a group: ``torch.distributed``'s ProcessGroup, or a backend such as
    ``ProcessGroupGloo`` built directly (as :func:`run_threads` does)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> dist.Work: ...

    def allreduce(self, tensors: list[torch.Tensor], /) -> dist.Work: ...

    def abort(self) -> None: ...


@dataclass
class Link:
    """One rank's handle on a process group. Every wait is bounded by ``timeout`` seconds."""

    group: Group
    rank: int
    world_size: int
    timeout: float = DEFAULT_TIMEOUT
    device: torch.device = torch.device("cpu")  # where control messages live: NCCL moves only CUDA tensors

    def control(self, data: list[int] | torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A small control message (counts, the spec handshake) on the link's device."""
        return torch.as_tensor(data, dtype=dtype).to(self.device)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        """Start sending ``tensor`` (contiguous) to rank ``dst``; wait on the returned work with :meth:`wait`."""
        return self._call(lambda: self.group.send([tensor], dst, tag), f"sending to rank {dst}")

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        """Start receiving into ``tensor`` (contiguous) from rank ``src``."""
        return self._call(lambda: self.group.recv([tensor], src, tag), f"receiving from rank {src}")

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` at most ``timeout`` seconds; the backend's failure becomes a typed error."""
        self._call(lambda: work.wait(datetime.timedelta(seconds=self.timeout)), what)

    def abort(self) -> None:
        """Tear the group down after a failure: pending receives are cancelled, so no late message lands in
        memory that is about to be reused; every later call on this link fails."""
        try:
            self.group.abort()
        except RuntimeError:  # already torn down by the failure itself
            pass

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.wait(self.isend(tensor, dst, tag), f"sending {tensor.numel() * tensor.element_size()} bytes to "
                                                f"rank {dst}")

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        self.wait(self.irecv(tensor, src, tag), f"receiving {tensor.numel() * tensor.element_size()} bytes from "
                                                f"rank {src}")

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over all ranks, in place."""
        self.wait(self._call(lambda: self.group.allreduce([tensor]), "all-reduce"), "all-reduce")  # SUM: the default

    def send_json(self, obj: Any, dst: int, tag: int) -> None:
        """Send a JSON-able value: its length, then its UTF-8 bytes (no pickle crosses ranks)."""
        data = self.control(torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8), torch.uint8)
        self.send(self.control([data.numel()]), dst, tag)
        if data.numel():
            self.send(data, dst, tag)

    def recv_json(self, src: int, tag: int) -> Any:
        """A value :meth:`send_json` sent; :class:`ProtocolError` for a length out of range (read before any
        memory is taken for it) or bytes that are not UTF-8 JSON. The peer is not trusted: check what it says."""
        n = self.control([0])
        self.recv(n, src, tag)
        size = int(n)
        if not 0 <= size <= MAX_MESSAGE:
            raise ProtocolError(f"rank {self.rank}: rank {src} announced a control message of {size} bytes "
                                f"(at most {MAX_MESSAGE:,})")
        data = torch.empty(size, dtype=torch.uint8, device=self.device)
        if size:
            self.recv(data, src, tag)
        try:
            return json.loads(bytes(data.cpu().numpy()).decode())
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested past the parser
            raise ProtocolError(f"rank {self.rank}: rank {src} sent a control message that is not JSON "
                                f"({type(e).__name__}: {str(e)[:120]})") from None

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return fn()
        except RuntimeError as e:  # gloo and NCCL report every failure as a RuntimeError (DistBackendError)
            msg = str(e)
            low = msg.lower()
            where = f"rank {self.rank}: {what}"
            if "timed out" in low or "timeout" in low:
                raise TransferTimeoutError(f"{where}: no answer within {self.timeout:g} s") from e
            if "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low:
                raise PeerLostError(f"{where}: the peer is gone ({msg.splitlines()[0][:160]})") from e
            raise TransferError(f"{where}: {msg.splitlines()[0][:200]}") from e


def _check_world(world_size: Any, timeout: Any) -> None:
    check_positive(world_size, "world_size")
    check_real(timeout, "timeout", lo=0, hi=3600, lo_open=True, unit=" of seconds")


def from_env(timeout: float = DEFAULT_TIMEOUT, device: torch.device | str = "cpu") -> Link:
    """Join the process group ``torchrun`` set up (``env://`` rendezvous): NCCL for a CUDA ``device`` (this rank's
    GPU is ``LOCAL_RANK``), else gloo."""
    _check_world(1, timeout)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"from_env needs torchrun's environment; {', '.join(missing)} not set")
    dev = as_device(device)
    if dev.type == "cuda":  # one GPU per rank
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(dev), timeout=datetime.timedelta(seconds=timeout))
    world = dist.group.WORLD
    assert world is not None
    return Link(world, dist.get_rank(), dist.get_world_size(), float(timeout), dev)


# ---------------------------------------------------------------------------------------------- processes
def _child(rank: int, world_size: int, port: int, timeout: float, fn: RankFn, kwargs: dict[str, Any],
           results: Any) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores; one intra-op thread each
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        world = dist.group.WORLD
        assert world is not None
        out = fn(Link(world, rank, world_size, timeout), **kwargs)
        results.put((rank, True, out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which re-raises it
        results.put((rank, False, e if isinstance(e, KVLabError) else
                     TransferError(f"rank {rank} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:  # the group was aborted after a failure
                pass


def spawn(fns: Sequence[RankFn], kwargs: Sequence[dict[str, Any]] | None = None, *,
          timeout: float = DEFAULT_TIMEOUT, deadline: float | None = None) -> list[Any]:
    """Run ``fns[r](link, **kwargs[r])`` in process ``r`` of a new gloo group on 127.0.0.1; return their results
    in rank order. Functions and arguments must be picklable (module-level functions). ``timeout`` bounds every
    wait inside a rank; ``deadline`` (default ``timeout`` + 60 s, for interpreter start-up) bounds the whole
    run: ranks still alive then are killed and :class:`TransferTimeoutError` is raised. If a rank raised, its
    error is re-raised here (the first in rank order)."""
    world_size = len(fns)
    _check_world(world_size, timeout)
    kwargs = list(kwargs) if kwargs is not None else [{} for _ in fns]
    if len(kwargs) != world_size:
        raise ConfigError(f"spawn got {world_size} functions but {len(kwargs)} argument sets")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, float(timeout), fns[r], kwargs[r], results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    limit = timeout + 60.0 if deadline is None else deadline
    got: dict[int, tuple[bool, Any]] = {}
    start = time.monotonic()
    try:
        while len(got) < world_size:
            left = limit - (time.monotonic() - start)
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
                got[rank] = (ok, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, limit - (time.monotonic() - start))))
            if p.is_alive():
                p.kill()
                p.join()
    errors = [(r, got[r][1]) for r in sorted(got) if not got[r][0]]
    if errors:
        raise errors[0][1]
    missing = [r for r in range(world_size) if r not in got]
    if missing:
        codes = [procs[r].exitcode for r in missing]
        raise TransferTimeoutError(f"ranks {missing} gave no result within {limit:g} s: killed at the deadline"
                                   if time.monotonic() - start >= limit else
                                   f"ranks {missing} exited with codes {codes} before giving a result")
    return [got[r][1] for r in range(world_size)]


# ---------------------------------------------------------------------------------------------- threads
def run_threads(fns: Sequence[RankFn], kwargs: Sequence[dict[str, Any]] | None = None, *,
                timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Like :func:`spawn`, but rank ``r`` is a thread of this process with its own gloo group (an in-memory
    rendezvous store, loopback TCP between the ranks): the objects the ranks build stay visible here."""
    world_size = len(fns)
    _check_world(world_size, timeout)
    kwargs = list(kwargs) if kwargs is not None else [{} for _ in fns]
    store = dist.HashStore()
    got: dict[int, tuple[bool, Any]] = {}

    links: dict[int, Link] = {}  # while its rank runs: a finished rank's group must go, so its peers see it leave

    def body(r: int) -> None:
        try:
            # a gloo backend built directly (its stubs type it apart from ProcessGroup; it has what Group needs)
            group = cast(Group, dist.ProcessGroupGloo(store, r, world_size, datetime.timedelta(seconds=timeout)))
            links[r] = Link(group, r, world_size, float(timeout))
            got[r] = (True, fns[r](links[r], **kwargs[r]))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            got[r] = (False, e)
        finally:
            links.pop(r, None)

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"kvlab-rank-{r}")
               for r in range(world_size)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join(timeout + 30.0)
    except KeyboardInterrupt:  # the ranks see no signal: each stops at its next call on its aborted link (a wait
        for link in list(links.values()):  # already blocked, at its timeout) and gives back its step meanwhile
            link.abort()
        raise
    errors = [got[r][1] for r in sorted(got) if not got[r][0]]
    if errors:
        raise errors[0]
    if len(got) < world_size:
        raise TransferTimeoutError(f"ranks {[r for r in range(world_size) if r not in got]} did not finish")
    return [got[r][1] for r in range(world_size)]
