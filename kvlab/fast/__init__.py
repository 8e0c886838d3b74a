"""Speed only: :class:`~kvlab.fast.pool.FastBlockPool` (the pool with §2.2.5's batch tricks, held equal to
:class:`~kvlab.core.pool.BlockPool` by the tests) and the optional C extensions (``_fastpath.c`` for the pool,
``_paged_attention.c`` for decode attention), loaded by ``compiled``. Nothing outside this folder exists for speed.
"""
