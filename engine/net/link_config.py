"""What a peer link is configured with and what it counts: plus the aiortc knobs behind it.

:class:`LinkConfig` (ICE servers, frame size, backpressure thresholds, inbound
limits, strikes, socket buffers), :class:`IceServer`, :class:`LinkStats`, and
three helpers that touch aiortc/aioice directly: building an
``RTCConfiguration``, reading the remote's ``a=max-message-size`` from its SDP,
and enlarging the UDP buffers of a connection's sockets. It knows nothing about
framing or peers.
"""

from __future__ import annotations

import logging
import re
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.net.framing import FrameLimits
from engine.net.sctp_tuning import SctpTuning

log = logging.getLogger(__name__)

#: RFC 8841: a peer that does not advertise a max message size accepts 64 KiB.
DEFAULT_REMOTE_MAX_MESSAGE_BYTES = 64 * 1024
_MAX_MESSAGE_SIZE_RE = re.compile(r"^a=max-message-size:(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class IceServer:
    """One STUN or TURN server (``urls`` like ``"stun:stun.example.org:3478"``)."""

    urls: tuple[str, ...]
    username: str | None = None
    credential: str | None = None

    def __repr__(self) -> str:  # the TURN credential never reaches a log
        return f"IceServer(urls={self.urls!r}, username={self.username!r})"


@dataclass(frozen=True)
class LinkConfig:
    """How links are built and what they accept.

    ice_servers: STUN/TURN servers; none by default (a LAN or loopback needs none).
    frame_bytes: largest frame sent, further capped by the remote's max message size.
    high_water_bytes: ``send`` waits while a channel's ``bufferedAmount`` is above this.
        aiortc queues all channels of a connection in one FIFO, so this bounds how
        long a control message waits behind bulk data (plus SCTP's in-flight window).
    low_water_bytes: ``bufferedAmountLowThreshold``; waiting senders resume below it.
    limits: caps on inbound frames and messages (see FrameLimits).
    max_strikes: protocol violations tolerated before the peer is disconnected.
    inbox_max_messages, inbox_max_bytes: received messages not yet consumed by
        ``recv``; beyond them the peer is flooding (a strike, the message dropped).
    open_timeout_s: how long the data channels may take to open.
    drain_timeout_s: how long a send may wait for the peer to drain a channel below
        ``low_water_bytes``; past it the peer is taken as stalled (aiortc's SCTP never gives
        up on a peer that stops acknowledging) and the link is closed (``closed_reason``
        ``"stalled"``), so one stuck peer cannot hold its senders forever.
    socket_buffer_bytes: UDP send/receive buffer asked for on the link's sockets
        (the OS clamps it, e.g. to net.core.rmem_max on Linux); 0 = leave the OS
        default. Measured on 2 busy cores: 1 MiB removed the ~1-10 % datagram drops
        of the ~200 KiB default but did not raise two-process goodput, and cut
        one-process throughput by ~1/3 (more SCTP data in flight costs aiortc more
        CPU per SACK) while deepening the queue that delays ICE consent checks.
    sctp: congestion control of the link's SCTP association (see SctpTuning);
        ``engine.net.sctp_tuning.STOCK_SCTP`` keeps aiortc's own Reno.
    """

    ice_servers: tuple[IceServer, ...] = ()
    frame_bytes: int = 255 * 1024
    high_water_bytes: int = 512 * 1024
    low_water_bytes: int = 128 * 1024
    limits: FrameLimits = field(default_factory=FrameLimits)
    max_strikes: int = 16
    inbox_max_messages: int = 10_000
    inbox_max_bytes: int = 512 * 1024 * 1024
    open_timeout_s: float = 20.0
    drain_timeout_s: float = 30.0
    socket_buffer_bytes: int = 0
    sctp: SctpTuning = field(default_factory=SctpTuning)

    def __post_init__(self) -> None:
        if self.frame_bytes < 1024:
            raise ValueError("LinkConfig.frame_bytes must be >= 1024")
        if not 0 <= self.low_water_bytes <= self.high_water_bytes:
            raise ValueError("LinkConfig needs 0 <= low_water_bytes <= high_water_bytes")
        if self.max_strikes < 0 or self.inbox_max_messages < 1 or self.inbox_max_bytes < 1:
            raise ValueError("LinkConfig: max_strikes >= 0, inbox caps >= 1")
        if self.open_timeout_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("LinkConfig.open_timeout_s and drain_timeout_s must be > 0")
        if self.socket_buffer_bytes < 0:
            raise ValueError("LinkConfig.socket_buffer_bytes must be >= 0")


@dataclass
class LinkStats:
    """Counters of one link (wire bytes include framing)."""

    messages_sent: int = 0
    messages_received: int = 0
    payload_bytes_sent: int = 0
    payload_bytes_received: int = 0
    wire_bytes_sent: int = 0
    wire_bytes_received: int = 0
    frames_sent: int = 0
    frames_received: int = 0
    frames_dropped: int = 0
    strikes: int = 0
    last_violation: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def enlarge_socket_buffers(pc, size_bytes: int) -> int:
    """Ask for ``size_bytes`` UDP buffers on the ICE sockets of ``pc``; returns how many
    sockets were adjusted. Best effort: reaches into aioice, which offers no public hook."""
    if size_bytes <= 0:
        return 0
    adjusted = 0
    sctp = getattr(pc, "sctp", None)
    dtls = getattr(sctp, "transport", None)
    ice = getattr(dtls, "transport", None)
    connection = getattr(ice, "_connection", None)
    for protocol in list(getattr(connection, "_protocols", []) or []):
        transport = getattr(protocol, "transport", None)
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None:
            continue
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < size_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size_bytes)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < size_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size_bytes)
            adjusted += 1
        except OSError as exc:
            log.debug("could not enlarge a UDP socket buffer: %s", exc)
    return adjusted


def rtc_configuration(ice_servers: tuple[IceServer, ...]):
    """An aiortc ``RTCConfiguration`` for these ICE servers."""
    from aiortc import RTCConfiguration, RTCIceServer

    return RTCConfiguration(iceServers=[
        RTCIceServer(urls=list(s.urls), username=s.username, credential=s.credential) for s in ice_servers])


def remote_max_message_bytes(remote_sdp: str) -> int | None:
    """The ``a=max-message-size`` the remote advertised (None = unlimited), 64 KiB if absent."""
    match = _MAX_MESSAGE_SIZE_RE.search(remote_sdp or "")
    if match is None:
        return DEFAULT_REMOTE_MAX_MESSAGE_BYTES
    value = int(match.group(1))
    return None if value == 0 else value
