"""KV cache events: follow a real server's prefix cache (vLLM, SGLang) and publish kvlab's own, in vLLM's format.

A serving engine reports each change to its prefix cache, blocks stored and removed, to KV-aware routers over
ZeroMQ. :mod:`~kvlab.kvevents.wire` reads and writes those bytes (both encodings, both engines),
:mod:`~kvlab.kvevents.subscriber` follows a stream on the notebook's asyncio loop (gaps replayed, restarts and bad
input counted), :mod:`~kvlab.kvevents.remote` rebuilds the cache a router sees from the events alone, and
:mod:`~kvlab.kvevents.publisher` makes a kvlab engine publish its own. ``kvlab watch ENDPOINT`` prints a stream.
Needs the ``events`` extra (pyzmq and msgspec): ``pip install "kvlab[events]"``.
"""
from kvlab.kvevents.publisher import KVEventPublisher
from kvlab.kvevents.remote import RemoteBlock, RemoteCache
from kvlab.kvevents.subscriber import Received, Stats, Subscriber
from kvlab.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch", "KVEventPublisher", "Received",
           "RemoteBlock", "RemoteCache", "Stats", "Subscriber", "decode_batch", "encode_batch"]
