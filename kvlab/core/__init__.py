"""The paged KV cache itself, in reading order: ``spec`` (one token's K/V shape and the block size), ``storage``
(the one preallocated KV tensor), ``block`` (block states), ``meta`` (per-block metadata arrays), ``freelists``
(free stacks and the buddy system), ``events``, ``pool`` (fixed-size blocks with states and refcounts: start
here), ``eviction``, ``prefix`` (prefix caching), ``sequence`` (block tables), ``attention`` (reading K/V from the
blocks), ``walk`` (the same read, block by block, as a kernel does it). ``errors`` and ``checks`` hold the typed
errors and every input rule; ``clock`` and ``device`` are small utilities the pool is built with.
"""
