"""The text's own API, made real as adapters around :mod:`kvlab.core`: ``pool`` (§2.2.2's ``BlockPool``
methods and ``KVBlock``, as :class:`~kvlab.textbook.pool.TextbookPool`) and ``refs`` (§2.2.3's
``ReferenceManager``); and ``sizing``, §2.2.1's ``ChunkSizeOptimizer`` as written (no adapter: it runs as the
text's code does, to reproduce its errors); and ``as_written``, the text's §2.2.2-§2.2.4 classes written again to
behave as the text's do, flaws included (``kvlab.text_as_written``). The chapters use them where they show the
text's names or what the text's code really does.
"""
