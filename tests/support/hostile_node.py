"""A hostile participant for trust tests: speaks the real coordinator protocol, lies where told.

Two forms, one harness. A real node that misbehaves in one named way
(``python -m tests.support.hostile_node MISBEHAVIOUR polis-args...``; :func:`node_argv`
builds that command line; :data:`MISBEHAVIOURS` lists the ways): it is the real
``polis node`` (weights, WebRTC, compute) with one behaviour patched in this process only,
switched on once the node reports ``ready``. And a bare websocket client, :func:`join`,
which opens a real ``/node`` websocket to a running coordinator, answers the challenge
with a correctly signed hello whose other fields the test chooses (a stage that does not
exist, a version from the far future, ...), and returns the coordinator's first reply
(``welcome`` or ``shutdown``) with the socket still open, so the test can go on sending
whatever the misbehaviour needs; it never computes anything.

What it does not know: what the real node computes (``engine.swarm.node``); why a test wants a liar.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import sys
from typing import Any

import aiohttp

from engine.net.identity import Identity
from engine.swarm import messages
from engine.swarm.node import hello_bytes

log = logging.getLogger(__name__)

#: what a hostile real node can be told to do once it is ready
MISBEHAVIOURS = {
    "ignore_train_in": "drops every train_in and train_out (its routes' micro-batches never finish)",
    "stop_reading_ws": "stops reading its coordinator websocket (TCP reads paused)",
    "stop_draining_sctp": "its SCTP stops taking in chunks: peers' sends to it back up, nothing is acknowledged",
}

#: an honest-looking hello of a fresh node (override any field to lie)
HONEST_HELLO: dict[str, Any] = {"backend": "torch", "device": "cpu", "max_layers": None, "stage": None,
                                "num_stages": None, "version": 0, "run_id": None, "has_base": True,
                                "role": "trainer"}


class HostileLink:
    """One open ``/node`` session; ``reply`` is what the coordinator answered the hello with."""

    def __init__(self, http: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse,
                 identity: Identity, reply: dict[str, Any]) -> None:
        self.http, self.ws, self.identity, self.reply = http, ws, identity, reply

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(message))

    async def close(self) -> None:
        await self.ws.close()
        await self.http.close()


async def join(url: str, identity: Identity | None = None, timeout_s: float = 10.0, **hello: Any) -> HostileLink:
    """Connect to ``url`` (the coordinator's http URL) with a signed hello of ``HONEST_HELLO | hello``."""
    identity = identity or Identity.generate()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=timeout_s))
    ws = await http.ws_connect(url.rstrip("/") + "/node", max_msg_size=messages.MAX_WS_MESSAGE_CHARS)
    challenge = json.loads((await ws.receive(timeout=timeout_s)).data)
    key = identity.public_key
    fields = {**HONEST_HELLO, **hello}
    await ws.send_str(json.dumps({
        "type": "hello", "peer_id": identity.peer_id, "public_key": base64.b64encode(key).decode(),
        "signature": base64.b64encode(identity.sign(hello_bytes(challenge["nonce"], key))).decode(), **fields}))
    while True:
        msg = await ws.receive(timeout=timeout_s)
        if msg.type != aiohttp.WSMsgType.TEXT:
            return HostileLink(http, ws, identity, {"type": "closed"})
        reply = json.loads(msg.data)
        if reply["type"] in ("welcome", "shutdown"):
            return HostileLink(http, ws, identity, reply)


# ---------------------------------------------------------------------------- a real misbehaving node
def node_argv(misbehaviour: str, *polis_args: str) -> list[str]:
    """argv of a real ``polis node`` process (``polis_args``, from ``node`` on) that misbehaves."""
    if misbehaviour not in MISBEHAVIOURS:
        raise ValueError(f"unknown misbehaviour {misbehaviour!r}; choose from {', '.join(MISBEHAVIOURS)}")
    return [sys.executable, "-m", "tests.support.hostile_node", misbehaviour, *polis_args]


def _patch(misbehaviour: str) -> None:
    """Install ``misbehaviour`` in this process: it starts when the node first reports ``ready``."""
    from engine.swarm.coordinator_session import CoordinatorSession
    from engine.swarm.node import Node
    from engine.swarm.training import Training

    armed = asyncio.Event()
    honest_ready = Node._ready

    async def ready(self) -> None:
        await honest_ready(self)
        if not armed.is_set():
            log.warning("hostile node %s now misbehaves: %s", self.ctx.peer_id, MISBEHAVIOURS[misbehaviour])
            armed.set()
            if misbehaviour == "stop_reading_ws":
                ws = self.session._ws
                if ws is not None and ws._conn is not None and ws._conn.transport is not None:
                    ws._conn.transport.pause_reading()
    Node._ready = ready

    if misbehaviour == "ignore_train_in":
        honest_in, honest_out = Training.on_train_in, Training.on_train_out

        def on_train_in(self, msg) -> None:
            if not armed.is_set():
                honest_in(self, msg)

        def on_train_out(self, msg) -> None:
            if not armed.is_set():
                honest_out(self, msg)
        Training.on_train_in, Training.on_train_out = on_train_in, on_train_out
    elif misbehaviour == "stop_reading_ws":
        honest_connect = CoordinatorSession._connect_once

        async def connect_once(self, stop, running):
            if armed.is_set():  # a reconnect: it stays deaf, reading nothing after the welcome
                armed.clear()
            await honest_connect(self, stop, running)
        CoordinatorSession._connect_once = connect_once
    elif misbehaviour == "stop_draining_sctp":
        from aiortc.rtcsctptransport import RTCSctpTransport

        honest_receive = RTCSctpTransport._receive_chunk

        async def receive_chunk(self, chunk) -> None:
            if not armed.is_set():
                await honest_receive(self, chunk)
        RTCSctpTransport._receive_chunk = receive_chunk


def main(argv: list[str]) -> int:
    misbehaviour, polis_args = argv[0], argv[1:]
    if misbehaviour not in MISBEHAVIOURS:
        raise SystemExit(f"usage: python -m tests.support.hostile_node {{{','.join(MISBEHAVIOURS)}}} node ...")
    _patch(misbehaviour)
    from engine.cli import main as polis_main

    return polis_main(polis_args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
