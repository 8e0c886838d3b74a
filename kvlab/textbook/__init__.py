"""The text's own API, made real as adapters around :mod:`kvlab.core`: ``pool`` (§2.2.2's ``BlockPool``
methods and ``KVBlock``, as :class:`~kvlab.textbook.pool.TextbookPool`) and ``refs`` (§2.2.3's
``ReferenceManager``). The chapters use them where they show the text's names.
"""
