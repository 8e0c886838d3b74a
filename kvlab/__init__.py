"""kvlab: see how a paged KV cache works (course text §2.2, fixed-size chunking of the KV cache).

The KV data of every block lives in one preallocated torch tensor (:class:`KVStorage`); :class:`BlockPool`
splits it into fixed-size blocks with states, refcounts, an eviction policy and events. ``import kvlab`` never
imports Jupyter packages; the widgets live in :mod:`kvlab.viz` and load only when used.
"""
from .allocator import (AllocationAbandoned, AllocationQueued, AllocationRecord, AllocationServed,
                        DynamicAllocator, Ticket, TicketState)
from .attention import AttentionWorkspace, contiguous_attention, paged_attention
from .block import BlockStatus
from .baseline import ContiguousAllocator
from .claims import BASELINES, Claim, claims_report, measure_claims, prefetch_effect, prefix_hit_share, verdicts
from .clock import LogicalClock, WallClock
from .device import default_device, torch_threads
from .errors import (ConfigError, DoubleFreeError, IllegalTransitionError, KVDataError, KVLabError,
                     ModelFileError, OutOfBlocksError, RefcountUnderflowError, TraceFormatError, UnknownBlockError)
from .events import (Allocated, Cached, EngineEvent, Event, EventBus, EventRecorder, Evicted, Freed, Merged,
                     Migrated, RefChanged, Split, StatusChanged)
from . import exercises
from .exercises import fast_mode, sized
from .eviction import (ClockPolicy, EvictionPolicy, FIFOPolicy, FutureUses, LFUPolicy, LRUPolicy, OPTPolicy,
                       RandomPolicy, make_policy)
from .serve.config import CostModel, EngineConfig
from .serve.engine import Engine, run_workload
from .serve.events import Admitted, Finished, Preempted, SwappedIn, TenantReclaimed
from .serve.memory import ContiguousMemory
from .fragmentation import DefragmentationStrategy, Defragmented, DefragReport, FragmentationDetector
from .metrics import MetricsLog, RequestRecord, StepMetrics
from .model import Llama, LlamaConfig, TinyConfig, TinyLlama
from .loader import load_model
from .chat import ChatReply, ChatSession, ChatStep, ChatStream, sample
from .tokenizer import ChatTokenizer
from .perf import COMPILED as hotpath_compiled
from .perf import FastBlockPool, PyFastBlockPool
from .pool import BlockPool
from .race import PolicyRace, race_policies
from .prefix import PrefixCache, PrefixEvicted, PrefixHit, PrefixStored
from .preallocation import Preallocator
from .refs import ReferenceManager
from .sequence import CopiedOnWrite, PagedBatch, Sequence, SequenceManager, Swapped
from .spec import KVSpec
from .textbook import KVBlock, TextbookPool
from .sizing import ChunkSizeOptimizer, SweepResult, SweepRow, measure_block_size, plot_sweep, sweep
from .storage import KVStorage
from .traces import load_trace, prefix_hit_bound, prefix_hits, trace_names
from .workloads import (LengthRange, Request, Scenario, Workload, make_workload, read_trace, write_trace)

__version__ = "0.1.0"

__all__ = [
    "AllocationAbandoned", "AllocationQueued", "AllocationRecord", "AllocationServed", "DefragReport",
    "DefragmentationStrategy", "Defragmented", "DynamicAllocator", "FragmentationDetector", "Preallocator",
    "Ticket", "TicketState",
    "exercises", "fast_mode", "sized",
    "Admitted", "Claim", "ContiguousAllocator", "ContiguousMemory", "CostModel", "Engine", "EngineConfig",
    "Finished", "MetricsLog", "Preempted", "RequestRecord", "StepMetrics", "SwappedIn", "TenantReclaimed",
    "PolicyRace", "race_policies", "BASELINES", "claims_report", "measure_claims", "prefetch_effect",
    "prefix_hit_share", "verdicts", "run_workload",
    "AttentionWorkspace", "CopiedOnWrite", "PagedBatch", "PrefixCache", "PrefixEvicted", "PrefixHit",
    "PrefixStored", "Sequence", "SequenceManager", "Swapped", "Llama", "LlamaConfig", "TinyConfig", "TinyLlama",
    "contiguous_attention", "paged_attention", "ChatTokenizer", "ModelFileError", "load_model",
    "ChatReply", "ChatSession", "ChatStep", "ChatStream", "sample",
    "ChunkSizeOptimizer", "LengthRange", "Request", "Scenario", "SweepResult", "SweepRow", "TraceFormatError",
    "Workload", "make_workload", "measure_block_size", "plot_sweep", "read_trace", "sweep", "write_trace",
    "load_trace", "prefix_hit_bound", "prefix_hits", "trace_names",
    "Allocated", "BlockPool", "FastBlockPool", "PyFastBlockPool", "hotpath_compiled", "BlockStatus", "Cached",
    "EngineEvent", "ConfigError",
    "DoubleFreeError", "Event", "EventBus",
    "EventRecorder", "Evicted", "EvictionPolicy", "FIFOPolicy", "Freed", "IllegalTransitionError", "KVBlock",
    "KVDataError", "KVLabError", "KVSpec", "KVStorage", "LFUPolicy", "LRUPolicy", "LogicalClock", "Merged",
    "Migrated", "OutOfBlocksError", "RandomPolicy", "RefChanged", "RefcountUnderflowError", "ReferenceManager",
    "Split", "StatusChanged", "UnknownBlockError", "WallClock", "default_device", "make_policy", "torch_threads",
    "ClockPolicy", "FutureUses", "OPTPolicy", "TextbookPool",
]


_LAZY_VIEWS = ("PoolView", "EvictionView", "FragmentationView", "Dashboard", "ChatView")


def __getattr__(name: str):
    """``kvlab.PoolView`` and the other views import :mod:`kvlab.viz` (and anywidget) on first use only."""
    if name in _LAZY_VIEWS:
        from . import viz
        return getattr(viz, name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
