"""Nodes wired together in memory: a peer sender and a coordinator that record instead of linking.

``MemoryWire`` carries peer messages between real ``engine.swarm.node.Node``
objects as a link would (msgpack bytes, decoded into the typed peer messages), and
turns a ``ProtocolViolation`` raised by the receiver into a strike, as
``engine.swarm.peer_links`` does. ``drop`` and ``mangle`` let a test lose or
corrupt messages on the way. No WebRTC, no sockets.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import msgpack

from engine.net.errors import ProtocolViolation
from engine.net.wire import WireMessage
from engine.swarm import messages


class MemoryWire:
    """Delivers messages between attached nodes; see the module docstring."""

    def __init__(self) -> None:
        self.receivers: dict[str, Callable[[str, Any, bytes], None]] = {}
        #: (receiver, sender) -> reasons the receiver struck the sender for
        self.strikes: dict[tuple[str, str], list[str]] = defaultdict(list)
        self.drop: Callable[[str, str, Any], bool] = lambda src, dst, header: False
        self.mangle: Callable[[str, str, Any, bytes], tuple[Any, bytes]] = \
            lambda src, dst, header, payload: (header, payload)

    def sender(self, peer_id: str) -> MemorySender:
        return MemorySender(self, peer_id)

    def attach(self, peer_id: str, on_peer: Callable[[str, Any, bytes], None]) -> None:
        self.receivers[peer_id] = on_peer

    async def send(self, src: str, dst: str, header: Any, payload: bytes = b"") -> None:
        """Deliver ``header`` (a typed message, or a map as a hostile peer might send one)."""
        raw = messages.encode_peer_header(header) if isinstance(header, WireMessage) else msgpack.packb(header)
        header = messages.decode_peer_header(raw)
        if self.drop(src, dst, header):
            return
        header, payload = self.mangle(src, dst, header, bytes(payload))
        try:
            self.receivers[dst](src, header, payload)
        except ProtocolViolation as exc:
            self.strikes[(dst, src)].append(str(exc))


class MemorySender:
    """One node's :class:`~engine.swarm.node_context.PeerSender` on a :class:`MemoryWire`."""

    def __init__(self, wire: MemoryWire, peer_id: str) -> None:
        self.wire = wire
        self.peer_id = peer_id

    async def send(self, peer: str, header: Any, payload: bytes = b"", channel: str = "control") -> None:
        await self.wire.send(self.peer_id, peer, header, payload)

    def strike(self, peer: str, reason: str) -> None:
        self.wire.strikes[(self.peer_id, peer)].append(reason)


class RecordingCoordinator:
    """A :class:`~engine.swarm.node_context.CoordinatorSender` that keeps every message as it arrives.

    Each one is encoded to websocket text and decoded back, as the coordinator would.
    """

    def __init__(self) -> None:
        self.messages: list[Any] = []

    async def send(self, message: Any) -> None:
        self.messages.append(messages.decode_from_node(messages.encode(message)))

    def of_type(self, kind: type) -> list[Any]:
        return [m for m in self.messages if isinstance(m, kind)]
