"""kvlab beyond one machine (an extension of §2.2): the KV cache across processes on ``torch.distributed``.

* :mod:`~kvlab.distributed.launch`: process groups (gloo on the CPU, NCCL on CUDA), spawned on 127.0.0.1, joined
  from ``torchrun``, or as threads of one process; :class:`Link` bounds every wait and types every failure;
* :mod:`~kvlab.distributed.connector`: the KV connector, split like a real engine's (scheduler / worker side),
  one message per layer, prefix-cached blocks skipped, block sizes re-chunked;
* :mod:`~kvlab.distributed.disagg`: disaggregated prefill and decode, checked against one process;
* :mod:`~kvlab.distributed.tp`: tensor-parallel KV (each rank holds ``num_kv_heads / tp`` heads of every block);
* :mod:`~kvlab.distributed.measure`: the transfer against the transport's limit and against recomputing;
* :mod:`~kvlab.distributed.watch`: both pools of a disaggregated run, shown live in a notebook;
* :mod:`~kvlab.distributed.exercises`: the chapter's predict-then-check exercises (registered on import).
"""
from kvlab.distributed.connector import (BlocksReceived, BlocksSent, BlocksSkipped, KVReceiver, KVSender, LoadSpec,
                                         RemoteRequest, SaveSpec, TransferReport, spec_vector)
from kvlab.distributed.disagg import (DisaggResult, decode_rank, demo_batches, make_manager, prefill_rank, reference,
                                      run_disagg)
from kvlab.distributed.errors import (PeerLostError, ProtocolError, SpecMismatchError, TransferError,
                                     TransferTimeoutError)
from kvlab.distributed.launch import Link, backend_for, free_port, from_env, run_threads, spawn
from kvlab.distributed.measure import (MoveOrRecompute, TransferCase, TransferTiming, measure_transfer,
                                       measure_transfers, move_or_recompute, move_or_recompute_table,
                                       plot_move_or_recompute, prefill_seconds)
from kvlab.distributed.tp import TPShard, head_split, run_tp, single_process
from kvlab.distributed.watch import WatchedDisagg, watch_disagg
from kvlab.distributed import exercises  # registers the chapter's exercises with kvlab.exercises

__all__ = [
    "BlocksReceived", "BlocksSent", "BlocksSkipped", "KVReceiver", "KVSender", "LoadSpec", "RemoteRequest",
    "SaveSpec", "TransferReport", "spec_vector", "DisaggResult", "decode_rank", "demo_batches", "make_manager",
    "prefill_rank",
    "reference", "run_disagg", "PeerLostError", "ProtocolError", "SpecMismatchError", "TransferError",
    "TransferTimeoutError",
    "Link", "backend_for", "free_port", "from_env", "run_threads", "spawn", "TransferCase", "TransferTiming",
    "measure_transfer", "measure_transfers", "MoveOrRecompute", "move_or_recompute", "move_or_recompute_table",
    "plot_move_or_recompute", "prefill_seconds", "TPShard", "head_split", "run_tp", "single_process",
    "WatchedDisagg", "watch_disagg", "exercises",
]
