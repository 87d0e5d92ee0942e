"""Errors raised by the network layer when a peer (or the network) misbehaves.

Every inbound byte is untrusted: decoders raise :class:`ProtocolViolation` with a
reason in words; the link that received the bytes logs the reason, counts a
strike against the sender and carries on. Nothing here knows about sockets.
"""

from __future__ import annotations


class NetError(RuntimeError):
    """Base class for network-layer failures."""


class ProtocolViolation(NetError, ValueError):
    """Inbound data broke the wire protocol (schema, size, type, shape, dtype, count)."""


class WireFormatError(ProtocolViolation):
    """A tensor or frame could not be decoded (bad header, sizes, dtype or encoding)."""


class AuthenticationError(NetError):
    """A signature, challenge or identity check failed."""


class LinkClosed(NetError):
    """The peer link is closed (or was never established)."""
