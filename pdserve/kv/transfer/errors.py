"""Errors of the KV transfer library.

Every `TransferError` message says what failed and with which peer (the remote region's
transport, address and name), so an engine can put it in a request's failure reason as is.
"""

from __future__ import annotations


class TransferError(Exception):
    """A KV transfer failed (base class; the message names the operation and the peer)."""


class TransferTimeoutError(TransferError):
    """The peer did not answer within the transport's timeout."""


class ChecksumError(TransferError):
    """The payload that arrived does not match the checksum the sender computed."""


class PeerUnavailableError(TransferError):
    """The peer cannot be reached: connection refused or broken, or the region is unknown."""


class LayoutMismatchError(ValueError):
    """Two KV layouts (or a layout and a block table) cannot be used together; the message
    names the field and both values."""
