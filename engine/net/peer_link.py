"""A framed, hostile-input-proof message link to one peer over aiortc data channels.

A :class:`PeerLink` owns one ``RTCPeerConnection`` with two pre-negotiated,
reliable, ordered data channels: ``"control"`` (small messages) and ``"bulk"``
(tensors). :meth:`PeerLink.send` cuts a (header, payload) message into frames
(:mod:`engine.net.framing`) no larger than the remote's advertised maximum
message size and waits on ``bufferedAmount`` (low-threshold event, no polling)
so a large payload never floods the SCTP queue or delays control messages by
more than ``high_water_bytes``; a peer that does not drain within ``drain_timeout_s`` is taken as
stalled and the link closed (:attr:`PeerLink.closed_reason` = ``"stalled"``). Inbound frames are reassembled under
:class:`~engine.net.framing.FrameLimits`; a bad frame or header is dropped with a
logged reason and a strike against the peer, and a peer over ``max_strikes`` is
disconnected (:attr:`PeerLink.closed_reason` = ``"strikes"``); messages not yet read are
bounded (``inbox_max_messages``, ``inbox_max_bytes``: past them a strike, the message dropped).

This module does not know how the connection was negotiated (see
:mod:`engine.net.peer_manager`), what the messages mean, or who the peer is
beyond its peer id. All methods must be called on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable, Literal

from engine.net.errors import LinkClosed, ProtocolViolation
from engine.net.framing import FrameLimits, Reassembler, frame_count, iter_frames, pack_header
from engine.net.link_config import (
    DEFAULT_REMOTE_MAX_MESSAGE_BYTES,
    IceServer,
    LinkConfig,
    LinkStats,
    enlarge_socket_buffers,
    remote_max_message_bytes,
    rtc_configuration,
)
from engine.net.sctp_tuning import send_rate, tune_sctp
from engine.net.wire import WireMessage

log = logging.getLogger(__name__)

__all__ = ["PeerLink", "Channel", "CHANNEL_IDS", "LinkConfig", "LinkStats", "IceServer", "FrameLimits",
           "DEFAULT_REMOTE_MAX_MESSAGE_BYTES", "enlarge_socket_buffers", "remote_max_message_bytes",
           "rtc_configuration"]

Channel = Literal["control", "bulk"]
#: data-channel label -> SCTP stream id (negotiated out of band, identical on both ends)
CHANNEL_IDS: dict[str, int] = {"control": 0, "bulk": 1}


def _consume_exception(task: asyncio.Task) -> None:
    """Retrieve a finished send task's exception (its caller may have been cancelled)."""
    if not task.cancelled():
        task.exception()


class PeerLink:
    """Messages to and from one peer. Build with :meth:`create` (before the SDP exchange)."""

    def __init__(self, pc, peer_id: str, config: LinkConfig, *,
                 validator: Callable[[dict], Any] | None = None) -> None:
        self._pc = pc
        self.peer_id = peer_id
        self.config = config
        self.stats = LinkStats()
        #: why the link closed: "local", "remote", "strikes", "failed", "stalled" (None while open)
        self.closed_reason: str | None = None
        self._validator = validator
        self._closed = False
        self._closed_event = asyncio.Event()
        self._close_callbacks: list[Callable[["PeerLink"], None]] = []
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._inbox_bytes = 0
        self._channels = {}
        self._reassemblers: dict[str, Reassembler] = {}
        self._send_locks: dict[str, asyncio.Lock] = {}
        self._drained: dict[str, asyncio.Future | None] = {}
        self._next_msg_id: dict[str, int] = {}
        self._queued: dict[str, int] = {}  # multi-frame sends waiting for or holding the channel
        self._frame_bytes = config.frame_bytes
        for name, stream_id in CHANNEL_IDS.items():
            self._reassemblers[name] = Reassembler(config.limits)
            self._send_locks[name] = asyncio.Lock()
            self._drained[name] = None
            self._next_msg_id[name] = 0
            self._queued[name] = 0
            channel = pc.createDataChannel(name, ordered=True, negotiated=True, id=stream_id)
            channel.bufferedAmountLowThreshold = config.low_water_bytes
            channel.on("message", self._make_receiver(name))
            channel.on("bufferedamountlow", self._make_drain_handler(name))
            channel.on("close", self._on_channel_close)
            self._channels[name] = channel
        tune_sctp(pc, config.sctp)  # the channels created the SCTP transport; the association has not started
        pc.on("connectionstatechange", self._on_connection_state)

    @classmethod
    def create(cls, peer_id: str, config: LinkConfig | None = None, *,
               validator: Callable[[dict], Any] | None = None) -> "PeerLink":
        """A new RTCPeerConnection with the two channels; negotiate it, then :meth:`wait_open`."""
        from aiortc import RTCPeerConnection

        config = config or LinkConfig()
        return cls(RTCPeerConnection(rtc_configuration(config.ice_servers)), peer_id, config, validator=validator)

    @property
    def pc(self):
        """The underlying ``RTCPeerConnection`` (for SDP negotiation)."""
        return self._pc

    @property
    def rtt_s(self) -> float | None:
        """SCTP's smoothed round trip to the peer in seconds (None before its first measurement)."""
        srtt = getattr(getattr(self._pc, "sctp", None), "_srtt", None)  # aiortc keeps RFC 4960's SRTT privately
        return float(srtt) if isinstance(srtt, (int, float)) and srtt >= 0 else None

    @property
    def send_rate(self) -> tuple[float, bool] | None:
        """Measured send rate to the peer: (bytes per second, whether the path, not this sender, set it);
        None before any measurement or with stock SCTP (``engine.net.sctp_tuning.send_rate``)."""
        return send_rate(self._pc)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def is_open(self) -> bool:
        return not self._closed and all(ch.readyState == "open" for ch in self._channels.values())

    @property
    def frame_bytes(self) -> int:
        return self._frame_bytes

    def __repr__(self) -> str:
        state = self.closed_reason or ("open" if self.is_open else "connecting")
        return f"PeerLink(peer={self.peer_id}, {state})"

    def add_close_callback(self, callback: Callable[["PeerLink"], None]) -> None:
        """Call ``callback(link)`` once, on the loop, when the link closes."""
        if self._closed:
            callback(self)
        else:
            self._close_callbacks.append(callback)

    async def wait_open(self, timeout_s: float | None = None) -> None:
        """Wait until both channels are open; adopt the remote's max message size."""
        timeout_s = self.config.open_timeout_s if timeout_s is None else timeout_s
        enlarge_socket_buffers(self._pc, self.config.socket_buffer_bytes)
        try:
            await asyncio.wait_for(self._channels_open(), timeout_s)
        except asyncio.TimeoutError:
            raise LinkClosed(f"link to {self.peer_id} did not open within {timeout_s} s") from None
        remote = self._pc.remoteDescription
        remote_max = remote_max_message_bytes(remote.sdp if remote is not None else "")
        self._frame_bytes = self.config.frame_bytes if remote_max is None else min(self.config.frame_bytes, remote_max)
        log.debug("link to %s open (frames of %d bytes)", self.peer_id, self._frame_bytes)

    async def _channels_open(self) -> None:
        loop = asyncio.get_running_loop()
        for channel in self._channels.values():
            while channel.readyState != "open":
                if self._closed or channel.readyState in ("closing", "closed"):
                    raise LinkClosed(f"link to {self.peer_id} closed before opening")
                opened = loop.create_future()
                channel.once("open", lambda f=opened: f.done() or f.set_result(None))
                closed = asyncio.ensure_future(self._closed_event.wait())
                try:
                    await asyncio.wait({opened, closed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    closed.cancel()

    # ----------------------------------------------------------------- sending

    async def send(self, header: dict | WireMessage, payload: bytes | bytearray | memoryview = b"",
                   channel: Channel = "control") -> None:
        """Send one message; returns once all its frames are queued (backpressure applied).

        ``header`` is a typed message (``engine.net.wire``) or a map with a ``"type"``.
        ``payload`` may be any C-contiguous buffer (``array.data``); do not modify it
        until ``send`` returns. Messages on one channel leave in call order. If the
        caller is cancelled mid-message, the remaining frames are still sent, so the
        peer never holds half a message. Raises :class:`LinkClosed` if the link is or
        becomes closed, ValueError for a header or payload over the configured limits.
        """
        if channel not in self._channels:
            raise ValueError(f"unknown channel {channel!r} (use 'control' or 'bulk')")
        if self._closed:
            raise LinkClosed(f"link to {self.peer_id} is closed ({self.closed_reason})")
        raw_header = pack_header(header)
        limits = self.config.limits
        if len(raw_header) > limits.max_header_bytes:
            raise ValueError(f"header of {len(raw_header)} bytes exceeds {limits.max_header_bytes}")
        size = memoryview(payload).nbytes
        if size > limits.max_payload_bytes:
            raise ValueError(f"payload of {size} bytes exceeds {limits.max_payload_bytes}")
        ch = self._channels[channel]
        if (self._queued[channel] == 0 and ch.bufferedAmount <= self.config.high_water_bytes
                and frame_count(len(raw_header), size, self._frame_bytes) == 1):
            self._send_frames_now(channel, raw_header, payload, size)  # one frame, no await: atomic
            return
        self._queued[channel] += 1
        task = asyncio.get_running_loop().create_task(
            self._send_frames(channel, raw_header, payload, size), name=f"polis-send-{self.peer_id}-{channel}")
        task.add_done_callback(_consume_exception)
        await asyncio.shield(task)

    def _take_msg_id(self, channel: str) -> int:
        msg_id = self._next_msg_id[channel]
        self._next_msg_id[channel] = (msg_id + 1) & 0xFFFFFFFF
        return msg_id

    def _send_one(self, ch, frame: bytes) -> None:
        if self._closed or ch.readyState != "open":
            raise LinkClosed(f"link to {self.peer_id} closed while sending ({self.closed_reason})")
        ch.send(frame)
        self.stats.frames_sent += 1
        self.stats.wire_bytes_sent += len(frame)

    def _send_frames_now(self, channel: str, raw_header: bytes, payload, size: int) -> None:
        ch = self._channels[channel]
        for frame in iter_frames(self._take_msg_id(channel), raw_header, payload, self._frame_bytes):
            self._send_one(ch, frame)
        self.stats.messages_sent += 1
        self.stats.payload_bytes_sent += size

    async def _send_frames(self, channel: str, raw_header: bytes, payload, size: int) -> None:
        ch = self._channels[channel]
        try:
            async with self._send_locks[channel]:
                for frame in iter_frames(self._take_msg_id(channel), raw_header, payload, self._frame_bytes):
                    if ch.bufferedAmount > self.config.high_water_bytes:
                        await self._wait_drained(channel)
                    self._send_one(ch, frame)
                self.stats.messages_sent += 1
                self.stats.payload_bytes_sent += size
        finally:
            self._queued[channel] -= 1

    async def _wait_drained(self, channel: str) -> None:
        fut = self._drained[channel]
        if fut is None or fut.done():
            fut = asyncio.get_running_loop().create_future()
            self._drained[channel] = fut
        timeout_s = self.config.drain_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except asyncio.TimeoutError:
            log.warning("peer %s did not drain its %s channel within %g s; closing the link as stalled",
                        self.peer_id, channel, timeout_s)
            self._mark_closed("stalled")
            asyncio.get_running_loop().create_task(self._close_pc(), name=f"polis-link-stalled-{self.peer_id}")
            raise LinkClosed(f"link to {self.peer_id} stalled: nothing drained for {timeout_s:g} s") from None

    def _make_drain_handler(self, name: str) -> Callable[[], None]:
        def on_low() -> None:
            fut = self._drained[name]
            if fut is not None and not fut.done():
                fut.set_result(None)
        return on_low

    async def _send_raw_frame(self, frame: bytes, channel: Channel = "bulk") -> None:
        """Send bytes as one frame, bypassing framing (for robustness tests and benches)."""
        ch = self._channels[channel]
        if ch.bufferedAmount > self.config.high_water_bytes:
            await self._wait_drained(channel)
        if self._closed or ch.readyState != "open":
            raise LinkClosed(f"link to {self.peer_id} is closed")
        ch.send(frame)

    # --------------------------------------------------------------- receiving

    def _make_receiver(self, name: str) -> Callable[[Any], None]:
        reassembler = self._reassemblers[name]

        def on_message(frame: Any) -> None:
            if self._closed:
                return
            self.stats.frames_received += 1
            try:
                size = len(frame)
                self.stats.wire_bytes_received += size
                if isinstance(frame, str):
                    raise ProtocolViolation("text frame on a binary channel")
                message = reassembler.feed(frame)
                if message is None:
                    return
                header, payload = message
                if self._validator is not None:
                    decoded = self._validator(header)
                    if decoded is not None:
                        header = decoded
                if (self._inbox.qsize() >= self.config.inbox_max_messages
                        or self._inbox_bytes + len(payload) > self.config.inbox_max_bytes):
                    raise ProtocolViolation("receive queue full: the peer is sending faster than it is read")
            except ProtocolViolation as exc:
                self._strike(name, str(exc))
                return
            self._inbox_bytes += len(payload)
            self.stats.messages_received += 1
            self.stats.payload_bytes_received += len(payload)
            self._inbox.put_nowait((header, payload))
        return on_message

    def report_violation(self, reason: str, channel: Channel = "control") -> None:
        """Count a strike for a message that passed framing but broke a higher-level rule
        (bad tensor shape, impossible value, ...); disconnects the peer over the limit."""
        if not self._closed:
            self._strike(channel, reason)

    def _strike(self, channel: str, reason: str) -> None:
        self.stats.frames_dropped += 1
        self.stats.strikes += 1
        self.stats.last_violation = reason
        log.warning("peer %s: dropped a %s message: %s (strike %d of %d)", self.peer_id, channel, reason,
                    self.stats.strikes, self.config.max_strikes)
        if self.stats.strikes > self.config.max_strikes and not self._closed:
            log.warning("peer %s: disconnected after %d protocol violations", self.peer_id, self.stats.strikes)
            self._mark_closed("strikes")
            asyncio.get_running_loop().create_task(self._close_pc(), name=f"polis-link-abort-{self.peer_id}")

    async def recv(self) -> tuple[Any, bytes]:
        """The next message ``(header, payload)``; raises LinkClosed once closed and drained.

        ``header`` is what the link's ``validator`` returned for it (a typed message),
        or the decoded map when there is no validator or it returned None."""
        if self._inbox.empty() and self._closed:
            raise LinkClosed(f"link to {self.peer_id} is closed ({self.closed_reason})")
        item = await self._inbox.get()
        if item is None:
            self._inbox.put_nowait(None)  # keep waking other readers
            raise LinkClosed(f"link to {self.peer_id} is closed ({self.closed_reason})")
        self._inbox_bytes -= len(item[1])
        return item

    def __aiter__(self) -> AsyncIterator[tuple[Any, bytes]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[dict, bytes]]:
        while True:
            try:
                yield await self.recv()
            except LinkClosed:
                return

    # ----------------------------------------------------------------- closing

    def _on_channel_close(self) -> None:
        if not self._closed:
            self._mark_closed("remote")
            asyncio.get_running_loop().create_task(self._close_pc(), name=f"polis-link-close-{self.peer_id}")

    async def _on_connection_state(self) -> None:
        state = self._pc.connectionState
        if state in ("failed", "closed") and not self._closed:
            self._mark_closed("failed" if state == "failed" else "remote")
            await self._close_pc()

    def _mark_closed(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        self.closed_reason = reason
        self._closed_event.set()
        self._inbox.put_nowait(None)
        for fut in self._drained.values():
            if fut is not None and not fut.done():
                fut.set_exception(LinkClosed(f"link to {self.peer_id} closed ({reason})"))
                fut.exception()  # mark retrieved: no "never retrieved" warnings
        for reassembler in self._reassemblers.values():
            reassembler.reset()
        log.info("link to %s closed (%s)", self.peer_id, reason)
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # a faulty observer must not break closing
                log.exception("close callback of link %s failed", self.peer_id)

    async def _close_pc(self) -> None:
        try:
            await self._pc.close()
        except Exception as exc:  # aiortc teardown of a dead transport may raise; the link is gone anyway
            log.debug("closing the connection to %s raised %r", self.peer_id, exc)

    async def close(self) -> None:
        """Close both channels and the connection (idempotent)."""
        self._mark_closed("local")
        await self._close_pc()

    async def wait_closed(self) -> None:
        await self._closed_event.wait()
