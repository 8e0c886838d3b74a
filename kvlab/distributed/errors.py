"""The typed errors of a KV transfer between processes (all :class:`kvlab.KVLabError`).

Each is raised on the rank that survives the fault, within the group's timeout, after that rank has given back
every block the transfer held, so its pool passes ``check_invariants()``.
"""
from __future__ import annotations

from kvlab.core.errors import ConfigError, KVLabError


class TransferError(KVLabError):
    """A KV transfer between ranks failed; the message names the peer, the step and what was moving."""


class PeerLostError(TransferError):
    """The peer rank went away (its process exited or its connection closed) while this rank waited on it."""


class TransferTimeoutError(TransferError):
    """The peer did not answer within the group's timeout."""


class SpecMismatchError(TransferError, ConfigError):
    """The two ranks' KV layouts (layers, KV heads, head size, dtype) differ: refused before any block moves."""


class ProtocolError(TransferError):
    """The peer sent a control message the protocol does not allow (not JSON, the wrong shape or types, a size
    out of range, a plan that does not cover this rank's blocks exactly once): refused before any byte of K/V
    lands, and the step's blocks given back."""
