"""kvlab: see how a paged KV cache works (course text §2.2, fixed-size chunking of the KV cache).

The KV data of every block lives in one preallocated torch tensor (:class:`KVStorage`); :class:`BlockPool`
splits it into fixed-size blocks with states, refcounts, an eviction policy and events. ``import kvlab`` never
imports Jupyter packages; the widgets live in :mod:`kvlab.viz` and load only when used.
"""
from .allocator import (AllocationAbandoned, AllocationQueued, AllocationRecord, AllocationServed,
                        DynamicAllocator, Ticket, TicketState)
from .block import BlockStatus, KVBlock
from .clock import LogicalClock, WallClock
from .device import default_device
from .errors import (ConfigError, DoubleFreeError, IllegalTransitionError, KVDataError, KVLabError,
                     OutOfBlocksError, RefcountUnderflowError, UnknownBlockError)
from .events import (Allocated, Cached, Event, EventBus, EventRecorder, Evicted, Freed, Merged, Migrated,
                     RefChanged, Split, StatusChanged)
from .eviction import EvictionPolicy, FIFOPolicy, LFUPolicy, LRUPolicy, RandomPolicy, make_policy
from .fragmentation import DefragmentationStrategy, Defragmented, DefragReport, FragmentationDetector
from .pool import BlockPool
from .preallocation import Preallocator
from .refs import ReferenceManager
from .spec import KVSpec
from .storage import KVStorage

__version__ = "0.1.0"

__all__ = [
    "AllocationAbandoned", "AllocationQueued", "AllocationRecord", "AllocationServed", "DefragReport",
    "DefragmentationStrategy", "Defragmented", "DynamicAllocator", "FragmentationDetector", "Preallocator",
    "Ticket", "TicketState",
    "Allocated", "BlockPool", "BlockStatus", "Cached", "ConfigError", "DoubleFreeError", "Event", "EventBus",
    "EventRecorder", "Evicted", "EvictionPolicy", "FIFOPolicy", "Freed", "IllegalTransitionError", "KVBlock",
    "KVDataError", "KVLabError", "KVSpec", "KVStorage", "LFUPolicy", "LRUPolicy", "LogicalClock", "Merged",
    "Migrated", "OutOfBlocksError", "RandomPolicy", "RefChanged", "RefcountUnderflowError", "ReferenceManager",
    "Split", "StatusChanged", "UnknownBlockError", "WallClock", "default_device", "make_policy",
]
