"""Nodes wired together in memory: a peer sender and a coordinator that record instead of linking.

``MemoryWire`` carries peer messages between real ``engine.swarm.node.Node``
objects as a link would (msgpack round trip, then the peer-message schemas), and
turns a ``ProtocolViolation`` raised by the receiver into a strike, as
``engine.swarm.peer_links`` does. ``drop`` and ``mangle`` let a test lose or
corrupt messages on the way. No WebRTC, no sockets.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import msgpack

from engine.net.errors import ProtocolViolation
from engine.swarm import messages


class MemoryWire:
    """Delivers messages between attached nodes; see the module docstring."""

    def __init__(self) -> None:
        self.receivers: dict[str, Callable[[str, dict, bytes], None]] = {}
        #: (receiver, sender) -> reasons the receiver struck the sender for
        self.strikes: dict[tuple[str, str], list[str]] = defaultdict(list)
        self.drop: Callable[[str, str, dict], bool] = lambda src, dst, header: False
        self.mangle: Callable[[str, str, dict, bytes], tuple[dict, bytes]] = \
            lambda src, dst, header, payload: (header, payload)

    def sender(self, peer_id: str) -> MemorySender:
        return MemorySender(self, peer_id)

    def attach(self, peer_id: str, on_peer: Callable[[str, dict, bytes], None]) -> None:
        self.receivers[peer_id] = on_peer

    async def send(self, src: str, dst: str, header: dict, payload: bytes = b"") -> None:
        header = messages.PEER_MESSAGES.validate(msgpack.unpackb(msgpack.packb(header)))
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

    async def send(self, peer: str, header: dict, payload: bytes = b"", channel: str = "control") -> None:
        await self.wire.send(self.peer_id, peer, header, payload)

    def strike(self, peer: str, reason: str) -> None:
        self.wire.strikes[(self.peer_id, peer)].append(reason)


class RecordingCoordinator:
    """A :class:`~engine.swarm.node_context.CoordinatorSender` that validates and keeps every message."""

    def __init__(self) -> None:
        self.messages: list[dict] = []

    async def send(self, message: dict) -> None:
        self.messages.append(messages.NODE_TO_COORDINATOR.validate(message))

    def of_type(self, kind: str) -> list[dict]:
        return [m for m in self.messages if m["type"] == kind]
