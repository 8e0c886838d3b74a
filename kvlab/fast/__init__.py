"""Speed only. Each part here is a twin of a reference in :mod:`kvlab.core`, held equal to it by the tests, and
:func:`choose` is the one place that picks twin or reference for what the engine and the model run:

* ``pool``: :class:`~kvlab.fast.pool.FastBlockPool`, the pool with §2.2.5's batch tricks (its hot methods compiled
  from ``_fastpath.c`` where it was built, else :class:`~kvlab.fast.pool.PyFastBlockPool`);
* ``append``: :class:`~kvlab.fast.pool.FastSequenceManager`, the engine's append loop over a batch (in C);
* ``prefix``: :class:`~kvlab.fast.pool.FastPrefixCache`, the prefix cache's hash-chain walk (in C);
* ``decode``: :func:`kvlab.fast.attention.paged_attention`, decode attention by ``_paged_attention.c``, which
  reads K/V blocks in place.

``compiled`` loads the C extensions (``KVLAB_PURE_PYTHON=1`` switches them off) and says, without torch, which
are compiled and why not (:func:`kvlab.fast.compiled.compiled_report`, the ``kvlab --version`` line): this package
imports the twins, and so torch, only when :func:`choose` runs. ``docs/benchmarks.md`` lists each
part's lines and what it gains end to end, measured by running with ``KVLAB_REFERENCE`` naming it.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from kvlab.core.errors import ConfigError

if TYPE_CHECKING:
    from kvlab.core.pool import BlockPool
    from kvlab.core.prefix import PrefixCache
    from kvlab.core.sequence import SequenceManager

PARTS = ("pool", "append", "prefix", "decode")


class Paths(NamedTuple):
    """What the engine and the model run: a pool class, a sequence manager class, a prefix cache class and the
    paged attention function."""
    pool: type[BlockPool]
    manager: type[SequenceManager]
    prefix_cache: type[PrefixCache]
    attention: Callable[..., Any]


def choose(reference: Iterable[str] | None = None) -> Paths:
    """Each part's fast twin, except the parts named in ``reference`` (some of :data:`PARTS`, or ``"all"``),
    which run the reference. By default ``reference`` is read from the environment variable ``KVLAB_REFERENCE``
    (a comma-separated list), so a benchmark can measure what one part gains with everything else unchanged."""
    from kvlab.core.attention import paged_attention as reference_attention
    from kvlab.core.pool import BlockPool
    from kvlab.core.prefix import PrefixCache
    from kvlab.core.sequence import SequenceManager
    from kvlab.fast.attention import paged_attention as fast_attention
    from kvlab.fast.pool import FastBlockPool, FastPrefixCache, FastSequenceManager

    if reference is None:
        reference = [p for p in os.environ.get("KVLAB_REFERENCE", "").replace(" ", "").split(",") if p]
    elif isinstance(reference, str):
        reference = [reference]
    names = set(reference)
    if "all" in names:
        names = set(PARTS)
    if names - set(PARTS):
        raise ConfigError(f"KVLAB_REFERENCE / reference names no part {sorted(names - set(PARTS))}; "
                          f"the parts are {', '.join(PARTS)} (or all)")
    return Paths(BlockPool if "pool" in names else FastBlockPool,
                 SequenceManager if "append" in names else FastSequenceManager,
                 PrefixCache if "prefix" in names else FastPrefixCache,
                 reference_attention if "decode" in names else fast_attention)
