"""A hostile participant for trust tests: speaks the real coordinator protocol, lies where told.

:func:`join` opens a real ``/node`` websocket to a running coordinator, answers the
challenge with a correctly signed hello whose other fields the test chooses (a stage that
does not exist, a version from the far future, ...), and returns the coordinator's first
reply (``welcome`` or ``shutdown``) with the socket still open, so the test can go on
sending whatever the misbehaviour needs. It is a test helper: it never computes anything.

In-process misbehaviours of a real ``engine.swarm.node.Node`` are separate small pieces below
(each named for what it does): :class:`ServesRandomWeights` / :func:`claim_honest_digest`
(finding 3), :func:`forged_drop` / :func:`forged_grad` (finding 5).

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


async def join(url: str, identity: Identity | None = None, timeout_s: float = 10.0, local_host: str | None = None,
               **hello: Any) -> HostileLink:
    """Connect to ``url`` (the coordinator's http URL) with a signed hello of ``HONEST_HELLO | hello``;
    ``local_host``: the address to connect from (any of 127.0.0.0/8 on loopback: another "machine")."""
    identity = identity or Identity.generate()
    connector = aiohttp.TCPConnector(local_addr=(local_host, 0)) if local_host else None
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=timeout_s), connector=connector)
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


# ---------------------------------------------------------------- misbehaviour: random weights (finding 3)
class ServesRandomWeights:
    """A stage runtime wrapper for a replica that trains honestly but serves random weights.

    Everything reads through to ``inner`` (gradients, steps, shapes), except the weights others
    see: ``state_dict`` / ``snapshot`` (what ``weights`` answers and weight streams carry, and what
    its own digest is computed from) return random tensors of the right shapes, fixed per version.
    ``set_weights`` installs into ``inner``, and it goes on serving random ones. With
    :func:`claim_honest_digest` its ``stepped`` reports the digest of the honest weights instead:
    the lie a vote cannot see, which only a follower that checks what it was sent can catch.
    """

    def __init__(self, inner: Any, seed: int = 666) -> None:
        self.inner = inner
        self.seed = seed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def state_dict(self) -> dict:
        import numpy as np

        rng = np.random.default_rng([self.seed, int(self.inner.version)])
        return {n: rng.standard_normal(a.shape).astype(np.float32) for n, a in sorted(self.inner.state_dict().items())}

    def snapshot(self) -> tuple[dict, int]:
        return self.state_dict(), self.inner.version

    def checksum(self) -> float:
        from engine.swarm.tensor_bundle import checksum

        return checksum(self.state_dict())


def claim_honest_digest(node: Any) -> None:
    """Make ``node`` (a real ``engine.swarm.node.Node`` whose runtime is :class:`ServesRandomWeights`)
    report in ``stepped`` the checksum and digest of the weights it hides, not of those it serves."""
    from engine.swarm.tensor_bundle import checksum
    from engine.swarm.weight_votes import weights_digest

    def honest() -> tuple[float, str]:
        weights = node.ctx.stage.rt.inner.state_dict()
        return checksum(weights), weights_digest(weights)
    node.replicas._fingerprints = honest


# ---------------------------------------------------------------- misbehaviour: forged routes (finding 5)
def forged_drop(job: str, route: list[str]) -> Any:
    """A ``drop`` of someone else's generation job along a ``route`` the sender wrote itself
    (naming itself the receiver's upstream), with no ticket: it frees that job's KV cache if obeyed."""
    from engine.swarm import messages

    return messages.Drop(job=job, route=route, hop=len(route) - 1)


def forged_grad(job: str, route: list[str], *, step: int, mb: int, rows: int, tokens: int,
                hidden: int, seed: int = 13) -> tuple[Any, bytes]:
    """``(header, payload)`` of a ``grad`` of random values for an honest micro-batch, back along a
    ``route`` that names the sender as the next stage, with no ticket."""
    import numpy as np

    from engine.swarm import messages
    from engine.swarm.pipeline_hops import encode_activation

    g = np.random.default_rng(seed).standard_normal((rows, tokens, hidden)).astype(np.float32) * 1e3
    tensor, payload = encode_activation(g, "fp32")
    return messages.Grad(job=job, route=route, hop=0, tensor=tensor, step=step, mb=mb), payload
