"""kvlab: see how a paged KV cache works (course text §2.2, fixed-size chunking of the KV cache).

The KV data of every block lives in one preallocated torch tensor (:class:`KVStorage`); :class:`BlockPool`
splits it into fixed-size blocks with states, refcounts, an eviction policy and events. ``import kvlab`` never
imports Jupyter packages; the widgets live in :mod:`kvlab.viz` and load only when used.
"""
# Imported in reading order, one folder after another (docs/architecture.md draws them).
# core/: one token's shape, the KV tensor, blocks, the pool, eviction, prefix caching, sequences, attention.
from kvlab.core.errors import (ConfigError, DoubleFreeError, IllegalTransitionError, KVDataError, KVLabError,
                               ModelFileError, OutOfBlocksError, RefcountUnderflowError, TraceFormatError,
                               UnknownBlockError)
from kvlab.core.spec import KVSpec
from kvlab.core.device import default_device, torch_threads
from kvlab.core.clock import LogicalClock, WallClock
from kvlab.core.storage import KVStorage
from kvlab.core.block import BlockStatus
from kvlab.core.events import (Allocated, Cached, EngineEvent, Event, EventBus, EventRecorder, Evicted, Freed, Merged,
                               Migrated, RefChanged, Split, StatusChanged)
from kvlab.core.pool import BlockPool
from kvlab.core.eviction import (ClockPolicy, EvictionPolicy, FIFOPolicy, FutureUses, LFUPolicy, LRUPolicy, OPTPolicy,
                                 RandomPolicy, make_policy)
from kvlab.core.prefix import PrefixCache, PrefixEvicted, PrefixHit, PrefixStored
from kvlab.core.sequence import CopiedOnWrite, PagedBatch, Sequence, SequenceManager, Swapped
from kvlab.core.attention import AttentionWorkspace, contiguous_attention, paged_attention
# textbook/: the text's own API (§2.2.2 BlockPool and KVBlock, §2.2.3 ReferenceManager) as adapters.
from kvlab.textbook.pool import KVBlock, TextbookPool
from kvlab.textbook.refs import ReferenceManager
# memory/: serving one request for blocks, fragmentation, pre-allocation, the block size, the contiguous baseline.
from kvlab.memory.allocator import (AllocationAbandoned, AllocationQueued, AllocationRecord, AllocationServed,
                                    DynamicAllocator, Ticket, TicketState)
from kvlab.memory.fragmentation import DefragmentationStrategy, Defragmented, DefragReport, FragmentationDetector
from kvlab.memory.preallocation import Preallocator
from kvlab.memory.sizing import ChunkSizeOptimizer, SweepResult, SweepRow, measure_block_size, plot_sweep, sweep
from kvlab.memory.baseline import ContiguousAllocator
# fast/: the same pool with §2.2.5's speed tricks, held equal to core/ by the tests.
from kvlab.fast.pool import COMPILED as hotpath_compiled
from kvlab.fast.pool import FastBlockPool, PyFastBlockPool
# workloads/: request mixes, real traces, racing eviction policies on them.
from kvlab.workloads.mixes import LengthRange, Request, Scenario, Workload, make_workload, read_trace, write_trace
from kvlab.workloads.traces import load_trace, prefix_hit_bound, prefix_hits, trace_names
from kvlab.workloads.race import PolicyRace, race_policies
# serve/: the engine, its metrics, the model that writes into the cache, chat, §2.2.6's claims.
from kvlab.serve.config import CostModel, EngineConfig
from kvlab.serve.events import Admitted, Finished, Preempted, SwappedIn, TenantReclaimed
from kvlab.serve.memory import ContiguousMemory
from kvlab.serve.metrics import MetricsLog, RequestRecord, StepMetrics
from kvlab.serve.engine import Engine, run_workload
from kvlab.serve.model import Llama, LlamaConfig, TinyConfig, TinyLlama
from kvlab.serve.loader import load_model
from kvlab.serve.tokenizer import ChatTokenizer
from kvlab.serve.sampling import sample
from kvlab.serve.chat import ChatReply, ChatSession, ChatStep, ChatStream
from kvlab.serve.claims import (BASELINES, Claim, claims_report, measure_claims, prefetch_effect, prefix_hit_share,
                                verdicts)
# exercises/: the chapters' exercises and their checks.
from kvlab import exercises
from kvlab.exercises import fast_mode, sized

from kvlab.core.interrupts import install as _install_interrupts, install_for_ipython as _install_for_ipython

__version__ = "0.1.0"

# An interrupt (Jupyter's "interrupt kernel") is held while a kvlab mutation runs and raised as it returns
# (kvlab.core.interrupts); outside kvlab's calls SIGINT behaves as Python's own handler.
_install_interrupts()
_install_for_ipython()

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


_LAZY_VIEWS = ("PoolView", "EvictionView", "FragmentationView", "Dashboard", "ChatView", "BlockTableView")


def __getattr__(name: str):
    """``kvlab.PoolView`` and the other views import :mod:`kvlab.viz` (and anywidget) on first use only."""
    if name in _LAZY_VIEWS:
        from kvlab import viz
        return getattr(viz, name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
