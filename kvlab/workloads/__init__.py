"""What the cache is asked to hold: ``mixes`` (seeded request mixes with arrivals, and trace files),
``traces`` (the real production traces shipped in ``kvlab/data``, and their prefix-sharing bound) and ``race``
(eviction policies raced on a workload).
"""
