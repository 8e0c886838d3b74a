"""Memory management around the pool: ``allocator`` (how one request for blocks is served, §2.2.3),
``fragmentation`` (measuring and undoing it, §2.2.4), ``preallocation`` (§2.2.5), ``sizing`` (choosing the block
size, §2.2.1) and ``baseline`` (the contiguous, pre-paging allocator that §2.2.6 compares against).
"""
