"""The text's code of §2.2.2 to §2.2.4, written again so that it behaves as the text's does, flaws included.

kvlab's own classes (:mod:`kvlab.core`, :mod:`kvlab.memory`) and the adapters of :mod:`kvlab.textbook.pool` are
how the text's ideas work. This module is the other thing: the text's classes with the text's names and
signatures, each method doing what the text's does, statement for statement and in the same order (the order
matters: the text's ``KVBlock.allocate`` changes the block before it can fail). The lines are our own; where the
text's behaviour is surprising a comment says so, and no flaw is fixed. The chapters call this code to show what
the text's code really does (``chapters/2_2_2_appendix_errata.ipynb``).

What "the text's pool" means here: ``BlockPool(...)`` exactly as the text constructs it, with every size list empty
(no text code ever puts a block into them). To see what the code *would* do if the pool held blocks, a chapter
fills the lists or ``active_blocks`` by hand (:func:`make_block`) and says so.

The module imports ``time`` at the top, as if the text's code blocks had been pasted into one file;
:func:`kvblock_alone` compiles the block-structure code with only the imports of its own code block, as a
reader who runs that block alone gets it. Two introspection helpers, :func:`mentions` and :func:`adds_to`, answer
"which of the text's methods use this name" over the text's classes: those below and §2.2.1's ``ChunkSizeOptimizer``
(:class:`kvlab.textbook.sizing.TextChunkSizeOptimizer`, written as the text's by the 2.2.1 chapter).
"""
from __future__ import annotations

import ast
import heapq  # noqa: F401  (the text imports it for its wait queue, which nothing ever uses)
import inspect
import random
import textwrap
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, List, Optional

import numpy as np

from kvlab.textbook.sizing import TextChunkSizeOptimizer


# ---------------------------------------------------------------------------- §2.2.2 "块结构设计"
class BlockStatus(Enum):
    FREE = "free"
    ALLOCATED = "allocated"
    PENDING = "pending"
    EVICTING = "evicting"


@dataclass
class KVBlock:
    """The text's block: seven fields, all required. Its capacity is the size of the data it holds *now*."""
    block_id: int
    status: BlockStatus
    token_count: int
    kv_data: Optional[np.ndarray]
    reference_count: int
    last_access_time: float
    creation_time: float

    def __post_init__(self) -> None:
        if self.kv_data is not None:
            self.kv_data = np.ascontiguousarray(self.kv_data)

    @property
    def memory_usage(self) -> int:
        """Bytes of the data held now (0 without data)."""
        return 0 if self.kv_data is None else self.kv_data.nbytes

    def is_compatible(self, required_size: int) -> bool:
        return self.status == BlockStatus.FREE and self.memory_usage >= required_size

    def allocate(self, kv_data: np.ndarray) -> bool:
        if self.status != BlockStatus.FREE:
            return False
        if kv_data.nbytes > self.memory_usage:
            return False
        # The block changes from here on; the two lines after the status can still raise (1-D data: no shape[1];
        # the block's code run alone: no ``time``), and then the block stays ALLOCATED, half set up.
        self.kv_data = np.ascontiguousarray(kv_data)
        self.status = BlockStatus.ALLOCATED
        self.token_count = kv_data.shape[1]  # "the second dimension is the token count"
        self.reference_count = 1
        self.last_access_time = time.time()
        return True

    def release(self) -> bool:
        if self.status != BlockStatus.ALLOCATED:
            return False
        if self.reference_count > 0:
            return False
        self.kv_data = None
        self.status = BlockStatus.FREE
        self.token_count = 0
        self.reference_count = 0
        return True

    def increment_reference(self) -> None:
        if self.status == BlockStatus.ALLOCATED:
            self.reference_count += 1
            self.last_access_time = time.time()

    def decrement_reference(self) -> None:
        if self.status == BlockStatus.ALLOCATED and self.reference_count > 0:
            self.reference_count -= 1


# ---------------------------------------------------------------------------- §2.2.2 "块池管理"
class BlockPool:
    """The text's pool: lists of blocks by size (left empty), a dict of active blocks, statistics and a lock."""

    def __init__(self, total_memory: int, block_sizes: List[int], eviction_policy: str = "lru") -> None:
        self.total_memory = total_memory
        self.block_sizes = sorted(block_sizes)
        self.eviction_policy = eviction_policy
        self.blocks: Dict[int, List[KVBlock]] = {size: [] for size in block_sizes}  # no text code fills them
        self.active_blocks: Dict[int, KVBlock] = {}
        self.wait_queue: List[tuple] = []
        self.stats = {"allocations": 0, "evictions": 0, "fragmentation": 0, "hit_rate": 0.0}
        self.lock = threading.RLock()

    def get_best_block(self, required_size: int) -> Optional[KVBlock]:
        """The first FREE block of the first list whose size is at least ``required_size``. It compares the
        list's size with the request and looks at the status only (never at the block's data), and takes
        nothing: the block stays FREE."""
        with self.lock:
            for size in self.block_sizes:
                if size >= required_size:
                    for block in self.blocks[size]:
                        if block.status == BlockStatus.FREE:
                            return block
            return None

    def allocate_block(self, block_id: int, kv_data: np.ndarray) -> bool:
        with self.lock:
            if block_id not in self.active_blocks:  # only ids already active can be allocated
                return False
            block = self.active_blocks[block_id]
            if block.allocate(kv_data):
                self.stats["allocations"] += 1
                return True
            return False

    def release_block(self, block_id: int) -> bool:
        with self.lock:
            if block_id not in self.active_blocks:
                return False
            block = self.active_blocks[block_id]
            if block.release():
                del self.active_blocks[block_id]  # and it goes into no list
                return True
            return False

    def evict_block(self) -> Optional[KVBlock]:
        with self.lock:
            if not self.active_blocks:
                return None
            candidates = self.active_blocks.values()
            if self.eviction_policy == "lru":
                block = min(candidates, key=lambda b: b.last_access_time)
            elif self.eviction_policy == "fifo":
                block = min(candidates, key=lambda b: b.creation_time)
            elif self.eviction_policy == "random":
                block = random.choice(list(candidates))
            else:
                block = next(iter(candidates))
            if block.reference_count == 0:  # checked after choosing: a referenced victim stops the eviction
                block.release()  # its result is not looked at
                self.stats["evictions"] += 1
                del self.active_blocks[block.block_id]
                return block
            return None

    def get_memory_usage(self) -> Dict[str, int]:
        with self.lock:
            used = sum(b.memory_usage for b in self.active_blocks.values())
            return {"total": self.total_memory, "used": used, "free": self.total_memory - used,
                    "fragmentation": self.calculate_fragmentation()}

    def calculate_fragmentation(self) -> int:
        with self.lock:
            free_blocks = [b for blocks in self.blocks.values() for b in blocks if b.status == BlockStatus.FREE]
            if not free_blocks:
                return 0
            total_free = sum(b.memory_usage for b in free_blocks)
            largest_free = max(b.memory_usage for b in free_blocks)
            share = (total_free - largest_free) / total_free if total_free > 0 else 0
            return int(share * 100)

    def get_stats(self) -> Dict[str, Any]:
        with self.lock:
            return self.stats.copy()


# ---------------------------------------------------------------------------- §2.2.3 "动态分配策略"
class DynamicAllocator:
    """The text's allocator. It finds blocks and returns them; it never allocates one (the block stays FREE)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.allocation_history: List[Any] = []  # never appended to

    def allocate_optimal_block(self, kv_data: np.ndarray) -> Optional[KVBlock]:
        required_size = kv_data.nbytes  # bytes, compared with the pool's block sizes
        block = self.pool.get_best_block(required_size)  # strategy 1
        if block:
            return block
        for size in self.pool.block_sizes:  # strategy 2: asks get_best_block again, for a larger size
            if size > required_size:
                larger = self.pool.get_best_block(size)
                if larger:
                    return larger
        if self.pool.evict_block():  # strategy 3: evict, then look again
            block = self.pool.get_best_block(required_size)
            if block:
                return block
        return self.handle_wait_queue(kv_data)  # strategy 4

    def handle_wait_queue(self, kv_data: np.ndarray) -> Optional[KVBlock]:
        required_size = kv_data.nbytes
        for size in self.pool.block_sizes:
            if size >= required_size * 2:
                large = self.pool.get_best_block(size)
                if large:
                    pieces = self.split_block(large, required_size)
                    if pieces:
                        return pieces[0]
        return None

    def split_block(self, large_block: KVBlock, required_size: int) -> List[KVBlock]:
        return []  # a stub in the text

    def deallocate_block(self, block_id: int) -> bool:
        return self.pool.release_block(block_id)


# ---------------------------------------------------------------------------- §2.2.3 "引用计数管理"
class ReferenceManager:
    """The text's reference counts: its own dict, apart from the blocks' ``reference_count``."""

    def __init__(self) -> None:
        self.references: Dict[int, int] = {}
        self.lock = threading.RLock()

    def add_reference(self, block_id: int) -> None:
        with self.lock:
            self.references[block_id] = self.references.get(block_id, 0) + 1

    def remove_reference(self, block_id: int) -> None:
        with self.lock:
            if block_id in self.references:
                self.references[block_id] -= 1
                if self.references[block_id] == 0:
                    del self.references[block_id]

    def get_reference_count(self, block_id: int) -> int:
        with self.lock:
            return self.references.get(block_id, 0)

    def is_safe_to_evict(self, block_id: int) -> bool:
        with self.lock:
            return self.references.get(block_id, 0) == 0  # an id it never saw counts as 0

    def get_all_references(self) -> Dict[int, int]:
        with self.lock:
            return self.references.copy()


# ---------------------------------------------------------------------------- §2.2.4 "碎片检测", "整理策略"
class FragmentationDetector:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.threshold = 20  # percent

    def detect_fragmentation(self) -> Dict[str, Any]:
        memory_info = self.pool.get_memory_usage()
        percent = memory_info["fragmentation"]
        return {"fragmentation_percent": percent, "should_defragment": percent > self.threshold,
                "memory_info": memory_info, "free_blocks": self._get_free_block_distribution()}

    def _get_free_block_distribution(self) -> Dict[int, int]:
        return {size: sum(1 for b in blocks if b.status == BlockStatus.FREE)
                for size, blocks in self.pool.blocks.items()}


class DefragmentationStrategy:
    """The text's defragmentation. Its private methods keep the text's names; each also has a public alias
    without the underscore, because chapters may not touch private names (tests/test_notebooks.py)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.minimum_fragmentation = 15  # never used again

    def defragment(self) -> bool:
        if not FragmentationDetector(self.pool).detect_fragmentation()["should_defragment"]:
            return False
        if self._merge_adjacent_blocks():
            return True
        if self._reallocate_active_blocks():
            return True
        return False

    def _merge_adjacent_blocks(self) -> bool:
        return False  # a stub in the text

    def _reallocate_active_blocks(self) -> bool:
        active = sorted(self.pool.active_blocks.values(), key=lambda b: b.memory_usage)
        for block in active:
            if block.memory_usage < 1024 * 1024:  # "small": under 1 MiB of data held now
                larger = self.pool.get_best_block(block.memory_usage * 2)
                if larger and self._migrate_block_data(block, larger):
                    self.pool.release_block(block.block_id)
                    return True  # after the first move
        return False

    def _migrate_block_data(self, source: KVBlock, target: KVBlock) -> bool:
        try:
            if target.memory_usage < source.memory_usage:
                return False
            target.kv_data = source.kv_data.copy()  # type: ignore[union-attr]  # None raises, caught below
            target.status = BlockStatus.ALLOCATED
            target.token_count = source.token_count
            self.pool.active_blocks[target.block_id] = target  # adds an entry to active_blocks
            return True
        except Exception as e:  # the text catches everything, prints, and reports failure
            print(f"数据迁移失败 (migration failed): {e}")
            return False

    # public aliases (see the class docstring)
    merge_adjacent_blocks = _merge_adjacent_blocks
    reallocate_active_blocks = _reallocate_active_blocks
    migrate_block_data = _migrate_block_data


# ---------------------------------------------------------------------------- not the text's: helpers
#: The text's classes, in the order the text shows them (what :func:`mentions` and :func:`adds_to` search).
TEXT_CLASSES = (TextChunkSizeOptimizer, BlockStatus, KVBlock, BlockPool, DynamicAllocator, ReferenceManager,
                FragmentationDetector, DefragmentationStrategy)


def make_block(block_id: int, kv_data: Optional[np.ndarray] = None, status: BlockStatus = BlockStatus.FREE,
               reference_count: int = 0, at: float = 0.0) -> KVBlock:
    """The text's seven-field ``KVBlock(...)`` with the fields a hand-filled pool does not care about set:
    no tokens, created and last used at time ``at``. No text code creates a block; this is how a chapter
    fills a pool by hand."""
    return KVBlock(block_id, status, 0, kv_data, reference_count, at, at)


def kvblock_alone() -> tuple[type, type]:
    """``(KVBlock, BlockStatus)`` compiled from this module's source with only the names the text's block-structure
    code block imports (numpy as ``np``, ``dataclass``, ``Optional``, ``List``, ``Enum``): the classes a reader
    gets who runs that code block by itself, without the pool's block that imports ``time``."""
    source = textwrap.dedent(inspect.getsource(BlockStatus)) + "\n\n" + textwrap.dedent(inspect.getsource(KVBlock))
    namespace: Dict[str, Any] = {"np": np, "dataclass": dataclass, "Optional": Optional, "List": List,
                                 "Enum": Enum, "__name__": "kvblock_alone"}
    # dont_inherit: not this module's ``from __future__ import annotations`` (the text's code block has none)
    exec(compile(source, "<the text's block-structure code, run alone>", "exec", dont_inherit=True), namespace)
    return namespace["KVBlock"], namespace["BlockStatus"]


def _methods() -> list[tuple[str, ast.FunctionDef]]:
    """``("Class.method", node)`` for every method of :data:`TEXT_CLASSES`, named as in the text (aliases are not
    methods)."""
    out = []
    for cls in TEXT_CLASSES:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                out.append((f"{cls.__name__.removeprefix('Text')}.{node.name}", node))  # the text's class name
    return out


def mentions(name: str) -> list[str]:
    """The text's methods whose body uses ``name``: as a variable, an attribute (``x.name``) or a string (a dict
    key such as ``"hit_rate"``). A method's own name in its ``def`` line does not count, so ``[]`` means that no
    text code calls, reads or writes it."""
    found = []
    for where, node in _methods():
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Name) and sub.id == name) or (isinstance(sub, ast.Attribute) and sub.attr == name) \
                    or (isinstance(sub, ast.Constant) and sub.value == name):
                found.append(where)
                break
    return found


def adds_to(name: str) -> list[str]:
    """The text's methods that put something into the container ``x.name``: ``x.name[key] = ...``,
    ``x.name.append(...)`` / ``extend`` / ``insert``, or ``x.name[key].append(...)`` (a list inside it)."""
    def container(e: ast.expr) -> bool:
        if isinstance(e, ast.Subscript):
            e = e.value
        return isinstance(e, ast.Attribute) and e.attr == name

    found = []
    for where, node in _methods():
        for sub in ast.walk(node):
            stores = isinstance(sub, ast.Assign) and any(isinstance(t, ast.Subscript) and container(t.value)
                                                         for t in sub.targets)
            grows = (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                     and sub.func.attr in ("append", "extend", "insert") and container(sub.func.value))
            if stores or grows:
                found.append(where)
                break
    return found
