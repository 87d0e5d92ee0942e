"""A hostile participant for trust tests: speaks the real coordinator protocol, lies where told.

:func:`join` opens a real ``/node`` websocket to a running coordinator, answers the
challenge with a correctly signed hello whose other fields the test chooses (a stage that
does not exist, a version from the far future, ...), and returns the coordinator's first
reply (``welcome`` or ``shutdown``) with the socket still open, so the test can go on
sending whatever the misbehaviour needs. It is a test helper: it never computes anything.

What it does not know: stages, weights, the node's real pipeline (``engine.swarm.node``).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import aiohttp

from engine.net.identity import Identity
from engine.swarm import messages
from engine.swarm.node import hello_bytes

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
