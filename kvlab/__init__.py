"""kvlab: see how a paged KV cache works (course text §2.2, fixed-size chunking of the KV cache).

The KV data of every block lives in one preallocated torch tensor (:class:`KVStorage`); :class:`BlockPool`
splits it into fixed-size blocks with states, refcounts, an eviction policy and events. ``import kvlab`` never
imports Jupyter packages; the widgets live in :mod:`kvlab.viz` and load only when used.

``import kvlab`` itself imports neither torch nor numpy (PEP 562): each public name is imported from its module
the first time it is read (``kvlab.BlockPool``, ``from kvlab import BlockPool``), so ``kvlab --help`` answers at
once and a notebook pays for torch on its first kvlab name. :data:`_WHERE` says where each name lives; the
``TYPE_CHECKING`` imports below say the same to mypy and IDEs (tests/test_cli_startup.py holds the two equal).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvlab.core.interrupts import install as _install_interrupts, install_for_ipython as _install_for_ipython

__version__ = "0.1.0"

# An interrupt (Jupyter's "interrupt kernel") is held while a kvlab mutation runs and raised as it returns
# (kvlab.core.interrupts); outside kvlab's calls SIGINT behaves as Python's own handler.
_install_interrupts()
_install_for_ipython()
# Importing kvlab.core.interrupts bound kvlab.core; unbound, it goes through __getattr__ like the other folders, which
# imports their modules, so a dotted path (kvlab.core.checks.SEED_MAX) works after a bare `import kvlab` as before.
globals().pop("core", None)

# Where each public name lives, in reading order, one folder after another (docs/architecture.md draws them).
_MODULES: dict[str, str] = {
    # core/: one token's shape, the KV tensor, blocks, the pool, eviction, prefix caching, sequences, attention.
    "kvlab.core.errors": "ConfigError DoubleFreeError IllegalTransitionError KVDataError KVEventError KVLabError "
                         "ModelFileError NoEventsError OutOfBlocksError RefcountUnderflowError TraceFormatError "
                         "UnknownBlockError",
    "kvlab.core.spec": "KVSpec",
    "kvlab.core.device": "default_device torch_threads",
    "kvlab.core.clock": "LogicalClock WallClock",
    "kvlab.core.storage": "KVStorage",
    "kvlab.core.block": "BlockStatus",
    "kvlab.core.events": "Allocated Cached EngineEvent Event EventBus EventRecorder Evicted Freed Merged Migrated "
                         "RefChanged Split StatusChanged",
    "kvlab.core.pool": "BlockPool",
    "kvlab.core.eviction": "ClockPolicy EvictionPolicy FIFOPolicy FutureUses LFUPolicy LRUPolicy OPTPolicy "
                           "RandomPolicy make_policy",
    "kvlab.core.prefix": "PrefixCache PrefixEvicted PrefixHit PrefixStored",
    "kvlab.core.sequence": "CopiedOnWrite PagedBatch Sequence SequenceManager Swapped",
    "kvlab.core.attention": "AttentionWorkspace contiguous_attention paged_attention",
    "kvlab.core.walk": "BlockStep BlockWalk walk_block_table",
    # textbook/: the text's own API (§2.2.2 BlockPool and KVBlock, §2.2.3 ReferenceManager) as adapters, and §2.2.1's
    # ChunkSizeOptimizer as written.
    "kvlab.textbook.pool": "KVBlock TextbookPool",
    "kvlab.textbook.refs": "ReferenceManager",
    "kvlab.textbook.sizing": "TextChunkSizeOptimizer",
    # memory/: serving one request for blocks, fragmentation, pre-allocation, the block size, the contiguous baseline.
    "kvlab.memory.allocator": "AllocationAbandoned AllocationQueued AllocationRecord AllocationServed "
                              "DynamicAllocator Ticket TicketState",
    "kvlab.memory.fragmentation": "DefragmentationStrategy Defragmented DefragReport FragmentationDetector",
    "kvlab.memory.preallocation": "Preallocator",
    "kvlab.memory.sizing": "ChunkSizeOptimizer SweepResult SweepRow measure_block_size plot_sweep sweep",
    "kvlab.memory.baseline": "ContiguousAllocator",
    # fast/: the same pool with §2.2.5's speed tricks, held equal to core/ by the tests.
    "kvlab.fast.pool": "FastBlockPool PyFastBlockPool hotpath_compiled",
    # workloads/: request mixes, real traces, racing eviction policies on them.
    "kvlab.workloads.mixes": "LengthRange Request Scenario Workload make_workload read_trace write_trace",
    "kvlab.workloads.traces": "load_trace prefix_hit_bound prefix_hits trace_names",
    "kvlab.workloads.race": "PolicyRace race_policies",
    # serve/: the engine, its metrics, the model that writes into the cache, chat, §2.2.6's claims.
    "kvlab.serve.config": "CostModel EngineConfig",
    "kvlab.serve.events": "Admitted Finished Preempted SwappedIn TenantReclaimed",
    "kvlab.serve.memory": "ContiguousMemory",
    "kvlab.serve.metrics": "MetricsLog RequestRecord StepMetrics",
    "kvlab.serve.engine": "Engine run_workload",
    "kvlab.serve.model": "Llama LlamaConfig TinyConfig TinyLlama",
    "kvlab.serve.loader": "load_model",
    "kvlab.serve.probe": "AttentionCall AttentionProbe",
    "kvlab.serve.reuse": "PrefillSaving measure_prefix_hit",
    "kvlab.serve.tokenizer": "ChatTokenizer",
    "kvlab.serve.sampling": "sample",
    "kvlab.serve.chat": "ChatReply ChatSession ChatStep ChatStream",
    "kvlab.serve.claims": "BASELINES Claim ClaimRuns PrefixHitTable claims_of claims_report measure_claims "
                          "prefetch_effect prefix_hit_share prefix_hit_table run_claims summary_table verdicts "
                          "workloads_table",
    "kvlab.serve.realsim": "RealVsMetadata answer_blocks compare_real_and_metadata",
    # exercises/: the chapters' exercises and their checks.
    "kvlab.exercises": "fast_mode sized",
}
# Public names that are modules: the name -> the module.
_MODULE_NAMES = {"exercises": "kvlab.exercises",
                 # The text's §2.2.2-§2.2.4 code as it behaves, flaws included (the errata appendix runs it).
                 "text_as_written": "kvlab.textbook.as_written"}
_RENAMED = {"hotpath_compiled": "COMPILED"}  # a public name -> its name in its module
_WHERE: dict[str, str] = {name: module for module, names in _MODULES.items() for name in names.split()}
_FOLDERS = ("app", "core", "distributed", "exercises", "fast", "kvevents", "memory", "serve", "textbook", "viz",
            "workloads")
# The widgets: kvlab.viz (and anywidget) loads on first use only; not in __all__, so `import *` leaves them out.
_LAZY_VIEWS = ("PoolView", "EvictionView", "FragmentationView", "Dashboard", "ChatView", "BlockTableView")

if TYPE_CHECKING:  # the same names as _WHERE and _MODULE_NAMES, imported for mypy and IDEs only
    from kvlab.core.errors import (ConfigError, DoubleFreeError, IllegalTransitionError, KVDataError, KVEventError,
                                   KVLabError, ModelFileError, NoEventsError, OutOfBlocksError,
                                   RefcountUnderflowError, TraceFormatError, UnknownBlockError)
    from kvlab.core.spec import KVSpec
    from kvlab.core.device import default_device, torch_threads
    from kvlab.core.clock import LogicalClock, WallClock
    from kvlab.core.storage import KVStorage
    from kvlab.core.block import BlockStatus
    from kvlab.core.events import (Allocated, Cached, EngineEvent, Event, EventBus, EventRecorder, Evicted, Freed,
                                   Merged, Migrated, RefChanged, Split, StatusChanged)
    from kvlab.core.pool import BlockPool
    from kvlab.core.eviction import (ClockPolicy, EvictionPolicy, FIFOPolicy, FutureUses, LFUPolicy, LRUPolicy,
                                     OPTPolicy, RandomPolicy, make_policy)
    from kvlab.core.prefix import PrefixCache, PrefixEvicted, PrefixHit, PrefixStored
    from kvlab.core.sequence import CopiedOnWrite, PagedBatch, Sequence, SequenceManager, Swapped
    from kvlab.core.attention import AttentionWorkspace, contiguous_attention, paged_attention
    from kvlab.core.walk import BlockStep, BlockWalk, walk_block_table
    from kvlab.textbook.pool import KVBlock, TextbookPool
    from kvlab.textbook.refs import ReferenceManager
    from kvlab.textbook.sizing import TextChunkSizeOptimizer
    from kvlab.textbook import as_written as text_as_written
    from kvlab.memory.allocator import (AllocationAbandoned, AllocationQueued, AllocationRecord, AllocationServed,
                                        DynamicAllocator, Ticket, TicketState)
    from kvlab.memory.fragmentation import DefragmentationStrategy, Defragmented, DefragReport, FragmentationDetector
    from kvlab.memory.preallocation import Preallocator
    from kvlab.memory.sizing import ChunkSizeOptimizer, SweepResult, SweepRow, measure_block_size, plot_sweep, sweep
    from kvlab.memory.baseline import ContiguousAllocator
    from kvlab.fast.pool import COMPILED as hotpath_compiled
    from kvlab.fast.pool import FastBlockPool, PyFastBlockPool
    from kvlab.workloads.mixes import LengthRange, Request, Scenario, Workload, make_workload, read_trace, write_trace
    from kvlab.workloads.traces import load_trace, prefix_hit_bound, prefix_hits, trace_names
    from kvlab.workloads.race import PolicyRace, race_policies
    from kvlab.serve.config import CostModel, EngineConfig
    from kvlab.serve.events import Admitted, Finished, Preempted, SwappedIn, TenantReclaimed
    from kvlab.serve.memory import ContiguousMemory
    from kvlab.serve.metrics import MetricsLog, RequestRecord, StepMetrics
    from kvlab.serve.engine import Engine, run_workload
    from kvlab.serve.model import Llama, LlamaConfig, TinyConfig, TinyLlama
    from kvlab.serve.loader import load_model
    from kvlab.serve.probe import AttentionCall, AttentionProbe
    from kvlab.serve.reuse import PrefillSaving, measure_prefix_hit
    from kvlab.serve.tokenizer import ChatTokenizer
    from kvlab.serve.sampling import sample
    from kvlab.serve.chat import ChatReply, ChatSession, ChatStep, ChatStream
    from kvlab.serve.claims import (BASELINES, Claim, ClaimRuns, PrefixHitTable, claims_of, claims_report,
                                    measure_claims, prefetch_effect, prefix_hit_share, prefix_hit_table, run_claims,
                                    summary_table, verdicts, workloads_table)
    from kvlab.serve.realsim import RealVsMetadata, answer_blocks, compare_real_and_metadata
    from kvlab import exercises
    from kvlab.exercises import fast_mode, sized

__all__ = [
    "AllocationAbandoned", "AllocationQueued", "AllocationRecord", "AllocationServed", "DefragReport",
    "DefragmentationStrategy", "Defragmented", "DynamicAllocator", "FragmentationDetector", "Preallocator",
    "Ticket", "TicketState",
    "exercises", "fast_mode", "sized",
    "Admitted", "Claim", "ContiguousAllocator", "ContiguousMemory", "CostModel", "Engine", "EngineConfig",
    "Finished", "MetricsLog", "Preempted", "RequestRecord", "StepMetrics", "SwappedIn", "TenantReclaimed",
    "PolicyRace", "race_policies", "BASELINES", "claims_report", "measure_claims", "prefetch_effect",
    "prefix_hit_share", "verdicts", "ClaimRuns", "claims_of", "run_claims", "run_workload",
    "PrefixHitTable", "prefix_hit_table", "summary_table", "workloads_table", "RealVsMetadata",
    "answer_blocks", "compare_real_and_metadata",
    "AttentionWorkspace", "CopiedOnWrite", "PagedBatch", "PrefixCache", "PrefixEvicted", "PrefixHit",
    "PrefixStored", "Sequence", "SequenceManager", "Swapped", "Llama", "LlamaConfig", "TinyConfig", "TinyLlama",
    "contiguous_attention", "paged_attention", "ChatTokenizer", "ModelFileError", "load_model",
    "BlockStep", "BlockWalk", "walk_block_table", "AttentionCall", "AttentionProbe", "PrefillSaving",
    "measure_prefix_hit",
    "ChatReply", "ChatSession", "ChatStep", "ChatStream", "sample",
    "ChunkSizeOptimizer", "LengthRange", "Request", "Scenario", "SweepResult", "SweepRow", "TraceFormatError",
    "Workload", "make_workload", "measure_block_size", "plot_sweep", "read_trace", "sweep", "write_trace",
    "load_trace", "prefix_hit_bound", "prefix_hits", "trace_names",
    "Allocated", "BlockPool", "FastBlockPool", "PyFastBlockPool", "hotpath_compiled", "BlockStatus", "Cached",
    "EngineEvent", "ConfigError",
    "DoubleFreeError", "Event", "EventBus",
    "EventRecorder", "Evicted", "EvictionPolicy", "FIFOPolicy", "Freed", "IllegalTransitionError", "KVBlock",
    "KVDataError", "KVEventError", "KVLabError", "KVSpec", "NoEventsError", "KVStorage", "LFUPolicy", "LRUPolicy",
    "LogicalClock", "Merged",
    "Migrated", "OutOfBlocksError", "RandomPolicy", "RefChanged", "RefcountUnderflowError", "ReferenceManager",
    "Split", "StatusChanged", "UnknownBlockError", "WallClock", "default_device", "make_policy", "torch_threads",
    "ClockPolicy", "FutureUses", "OPTPolicy", "TextbookPool", "TextChunkSizeOptimizer", "text_as_written",
]


def __getattr__(name: str) -> Any:
    """PEP 562: a public name is imported from its module on first read and kept, so later reads are plain
    attribute reads; a folder (``kvlab.serve``) comes with its public modules; a view imports :mod:`kvlab.viz`."""
    if name in _LAZY_VIEWS:
        from kvlab import viz
        return getattr(viz, name)
    if (name in _MODULE_NAMES or name in _WHERE or name in _FOLDERS) and _WHERE.get(name) != "kvlab.core.errors":
        _import_all()  # the error types excepted: the command line reads them before it knows it needs torch
    if name in _MODULE_NAMES:
        value = importlib.import_module(_MODULE_NAMES[name])
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), _RENAMED.get(name, name))
    elif name in _FOLDERS:
        value = importlib.import_module(f"kvlab.{name}")
    else:
        raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
    globals()[name] = value
    return value


def _import_all() -> None:
    """Every public module, once, on the first name read: from then on every dotted path works, as it did when
    ``import kvlab`` imported them all (``kvlab.memory.sizing.GOALS`` even where ``kvlab.memory`` was bound first by
    an import of another of its modules)."""
    for module in _MODULES:
        importlib.import_module(module)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_LAZY_VIEWS})
