"""The text's method names, an adapter around the pool (kvlab/textbook/pool.py): what ``get_memory_usage`` counts."""
from __future__ import annotations

import pytest

import kvlab
from kvlab import BlockPool
from kvlab.textbook.pool import TextbookPool

from _util import small_spec

POOL_CLASSES = [BlockPool, kvlab.PyFastBlockPool, kvlab.FastBlockPool]


@pytest.mark.parametrize("cls", POOL_CLASSES, ids=lambda c: c.__name__)
def test_memory_usage_counts_base_blocks_of_every_owned_state(cls):
    """A buddy pool of 8 base blocks (512 bytes each, sizes 4 and 8 tokens) holding a cached class-1 block (2 base
    blocks), a held block with 3 tokens, a PENDING block and an EVICTING block: ``cached`` is the class-1 block's 2
    base blocks (not 1 block's bytes), ``used`` counts PENDING and EVICTING too (5 base blocks), and
    ``used + free == total``."""
    spec = small_spec()  # 128 bytes a token, 4 tokens a block
    p = cls(8, spec=spec, block_sizes=[4, 8])
    assert p.bytes_per_block == 512
    (cached,) = p.allocate(1, size_class=1)
    p.mark_reusable([cached])
    p.free([cached])
    (held,) = p.allocate(1)
    p.set_token_count(held, 3)
    p.reserve(1)
    (leaving,) = p.allocate(1)
    p.begin_eviction([leaving])
    assert p.arrays.status.tolist() == [2, 2, 2, 1, 3, 0, 0, 0]  # cached x2, held, PENDING, EVICTING, 3 FREE
    # fragmentation: of the 3 free base blocks only the aligned pair 6-7 can serve a class-1 request
    assert TextbookPool(p).get_memory_usage() == {"total": 8 * 512, "used": 5 * 512, "free": 3 * 512, "cached": 2 * 512,
                                    "token_bytes": 3 * 128, "fragmentation": 33}
    p.finish_eviction([leaving])  # EVICTING -> FREE: one base block moves from used to free
    mu = TextbookPool(p).get_memory_usage()
    assert (mu["used"], mu["free"], mu["cached"]) == (4 * 512, 4 * 512, 2 * 512)
    assert mu["used"] + mu["free"] == mu["total"]
