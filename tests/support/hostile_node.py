"""A hostile participant for trust tests: speaks the real coordinator protocol, lies where told.

Two forms, one harness. A real node that misbehaves in one named way
(``python -m tests.support.hostile_node MISBEHAVIOUR polis-args...``; :func:`node_argv`
builds that command line; :data:`MISBEHAVIOURS` lists the ways): it is the real
``polis node`` (weights, WebRTC, compute) with one behaviour patched in this process only,
switched on once the node reports ``ready`` (or, for :data:`ARMED_BY_WORK`, once the coordinator
hands it its first work: a node that joins behind its stage first catches up). And a bare
websocket client, :func:`join`, which opens a real ``/node`` websocket to a running
coordinator, answers the challenge with a correctly signed hello whose other fields the test
chooses (a stage that does not exist, a version from the far future, ...), and returns the coordinator's first reply
(``welcome`` or ``shutdown``) with the socket still open, so the test can go on sending
whatever the misbehaviour needs; it never computes anything.

In-process misbehaviours of a real ``engine.swarm.node.Node`` are separate small pieces below
(each named for what it does): :class:`ServesRandomWeights` / :func:`claim_honest_digest`
(finding 3), :func:`forged_result` (finding 4), :func:`forged_drop` / :func:`forged_grad`
(finding 5), :func:`poisoned_share` (finding 6).

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
    "serves_random_weights": "trains honestly but serves random weights (ServesRandomWeights) and reports "
                             "their digest",
    "forges_routes": "for the first activations it gets, sends every other member forged 'drop's and "
                     "'grad's (routes it wrote itself, no ticket) for that job and its neighbours",
    "forges_rollouts": "as a last stage, forges its gen_done results, one forgery per result in turn "
                       "(forged_result): ids beyond the vocabulary after a stop id, version 2^40, "
                       "behaviour log-probs of -40 on every token",
    "poisons_shares": "sends (and aggregates) its gradient share x10, sign-flipped x10 and as noise of 10x its "
                      "norm, one attack per step in turn (poisoned_share)",
    "overflows_shares": "sends (and aggregates) a gradient share of 3e38 in every entry (poisoned_share): two "
                        "such replicas of three overflow fp32",
}

#: misbehaviours that begin with the first work the coordinator hands the node (it is in the routes
#: then): a node that says ready behind its stage is told to catch up first, and one that went dark at
#: that ``ready`` would never be taken in, so what a silent peer costs the run would go unmeasured
ARMED_BY_WORK = ("stop_reading_ws", "stop_draining_sctp")
#: what the coordinator hands a node only once it is in the routes
WORK_MESSAGES = (messages.Gen, messages.TrainIn, messages.TrainOut, messages.Apply)

#: forgery rounds of a ``forges_routes`` node (bounded: each forgery is a strike at its receiver)
FORGERY_ROUNDS = 3
#: what a ``forges_rollouts`` node does to its results, in turn: the first two break a rule of the
#: coordinator's ingestion (``engine.swarm.rollout_checks``), the third only the log-prob audit sees
ROLLOUT_FORGERIES = ("ids_after_stop", "future_version", "forged_logprobs")
#: behaviour log-prob a forged result reports on every token (blows up exp(p - b) if trained on)
FORGED_LOGPROB = -40.0
#: the attack of a share-poisoning node at each step, in turn (``engine.bench.trust.attacked``)
SHARE_ATTACKS = {"poisons_shares": ("x10", "flip_x10", "noise"), "overflows_shares": ("3e38",)}

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
    see: ``state_dict`` / ``snapshot`` / ``snapshot_with_moments`` (what ``weights`` answers and
    weight streams carry, and what its own digest is computed from) return random tensors of the
    right shapes, fixed per version.
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

    def snapshot_with_moments(self) -> tuple[dict, int, dict]:
        """What a sibling trainer that joins or resyncs gets: random weights, its honest AdamW moments."""
        _, version, moments = self.inner.snapshot_with_moments()
        return self.state_dict(), version, moments

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


# ---------------------------------------------------------------- misbehaviour: forged rollouts (finding 4)
def forged_result(done: Any, forgery: str, *, vocab_size: int, stop_id: int) -> Any:
    """The ``gen_done`` ``done`` with one of :data:`ROLLOUT_FORGERIES`: every row cut after its first
    ``stop_id`` (one added where it has none) and two ids beyond the vocabulary appended; every
    stage's version 2^40 (the largest the wire allows); or every behaviour log-prob
    :data:`FORGED_LOGPROB` (ids and versions honest: no ingestion rule can tell)."""
    from engine.swarm import messages

    if forgery == "ids_after_stop":
        cut = [row[:row.index(stop_id) + 1] if stop_id in row else [*row, stop_id] for row in done.tokens]
        tokens = [[*row, vocab_size, vocab_size + 1] for row in cut]
        kept = [list(lps[:len(row)]) for row, lps in zip(cut, done.logprobs)]
        logprobs = [[*lps, *[-1.0] * (len(row) - len(lps))] for row, lps in zip(tokens, kept)]
        return messages.GenDone(job=done.job, tokens=tokens, logprobs=logprobs, versions=done.versions)
    if forgery == "future_version":
        return messages.GenDone(job=done.job, tokens=done.tokens, logprobs=done.logprobs,
                                versions=[2**40] * len(done.versions))
    if forgery == "forged_logprobs":
        return messages.GenDone(job=done.job, tokens=done.tokens, versions=done.versions,
                                logprobs=[[FORGED_LOGPROB] * len(lps) for lps in done.logprobs])
    raise ValueError(f"unknown forgery {forgery!r}; choose from {', '.join(ROLLOUT_FORGERIES)}")


# ---------------------------------------------------------------- misbehaviour: poisoned shares (finding 6)
def poisoned_share(grads: dict, attack: str, rng: Any) -> dict:
    """What a hostile replica puts in its gradient share instead of ``grads`` (the bench's attacks:
    ``engine.bench.trust.attacked``), as float32 like an honest share."""
    import numpy as np

    from engine.bench.trust import attacked

    return {name: np.asarray(g, dtype=np.float32) for name, g in attacked(grads, attack, rng).items()}


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
    from engine.swarm.pipeline_hops import encode_with

    g = np.random.default_rng(seed).standard_normal((rows, tokens, hidden)).astype(np.float32) * 1e3
    tensor, payload = encode_with(g, "fp32", {})
    return messages.Grad(job=job, route=route, hop=0, tensor=tensor, step=step, mb=mb), payload


def _neighbours(job: str) -> list[str]:
    """``job`` and the ids the coordinator gave just before and after it (``t41``; ``3:1`` step:mb)."""
    if ":" in job:
        head, mb = job.rsplit(":", 1)
        return [job] + [f"{head}:{m}" for m in (int(mb) - 1, int(mb) + 1) if m >= 0]
    prefix = job.rstrip("0123456789")
    n = int(job[len(prefix):] or 0)
    return [job] + [f"{prefix}{m}" for m in (n - 1, n + 1) if m >= 0]


async def _forge(node: Any, act: Any) -> None:
    """Send every member off ``act``'s route a forged ``drop`` (generation) or ``grad`` (training) of
    the job ``act`` belongs to and its neighbours, naming this node as the receiver's upstream."""
    me = node.ctx.peer_id
    others = [p for ids in node.ctx.membership.stages for p in ids if p != me and p not in act.route]
    for peer in others:
        for job in _neighbours(act.job):
            try:
                if act.kind == "gen":
                    await node.ctx.peers.send(peer, forged_drop(job, [me, peer]))
                else:
                    rows, tokens, hidden = act.tensor["shape"]
                    header, payload = forged_grad(job, [peer, me], step=act.step, mb=act.mb, rows=rows,
                                                  tokens=tokens, hidden=hidden)
                    await node.ctx.peers.send(peer, header, payload)
                log.warning("hostile node sent a forged %s for %s to %s", act.kind, job, peer)
            except Exception as exc:  # noqa: BLE001 - a hostile node goes on forging
                log.warning("hostile node could not forge to %s: %s", peer, exc)


# ---------------------------------------------------------------------------- a real misbehaving node
def node_argv(misbehaviour: str, *polis_args: str) -> list[str]:
    """argv of a real ``polis node`` process (``polis_args``, from ``node`` on) that misbehaves."""
    if misbehaviour not in MISBEHAVIOURS:
        raise ValueError(f"unknown misbehaviour {misbehaviour!r}; choose from {', '.join(MISBEHAVIOURS)}")
    return [sys.executable, "-m", "tests.support.hostile_node", misbehaviour, *polis_args]


def _patch(misbehaviour: str) -> None:
    """Install ``misbehaviour`` in this process: it starts when the node first reports ``ready``, or
    gets its first work (:data:`ARMED_BY_WORK`)."""
    from engine.swarm.coordinator_session import CoordinatorSession
    from engine.swarm.node import Node
    from engine.swarm.training import Training

    armed = asyncio.Event()
    honest_ready, honest_on_coordinator = Node._ready, Node.on_coordinator

    def arm(node: Node) -> None:
        log.warning("hostile node %s now misbehaves: %s", node.ctx.peer_id, MISBEHAVIOURS[misbehaviour])
        armed.set()
        if misbehaviour == "serves_random_weights":
            node.ctx.stage.rt = ServesRandomWeights(node.ctx.stage.rt)
        if misbehaviour == "stop_reading_ws":
            ws = node.session._ws
            if ws is not None and ws._conn is not None and ws._conn.transport is not None:
                ws._conn.transport.pause_reading()

    async def ready(self) -> None:
        await honest_ready(self)
        if not armed.is_set() and misbehaviour not in ARMED_BY_WORK:
            arm(self)
    Node._ready = ready

    def on_coordinator(self, msg) -> None:
        honest_on_coordinator(self, msg)
        if not armed.is_set() and misbehaviour in ARMED_BY_WORK and isinstance(msg, WORK_MESSAGES):
            arm(self)
    Node.on_coordinator = on_coordinator

    if misbehaviour == "forges_rollouts":
        _forge_rollouts(armed)
    elif misbehaviour in SHARE_ATTACKS:
        _poison_shares(armed, SHARE_ATTACKS[misbehaviour])

    if misbehaviour == "forges_routes":
        honest_on_peer, rounds = Node.on_peer, [0]

        def on_peer(self, sender, header, payload) -> None:
            honest_on_peer(self, sender, header, payload)
            if armed.is_set() and isinstance(header, messages.Act) and rounds[0] < FORGERY_ROUNDS:
                rounds[0] += 1
                self.ctx.tasks.spawn(_forge(self, header), name=f"polis-hostile-forge-{rounds[0]}")
        Node.on_peer = on_peer

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
            if armed.is_set():  # a reconnect: it goes deaf again at its first work
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


def _forge_rollouts(armed: asyncio.Event) -> None:
    """Once ``armed``, every ``gen_done`` this process sends carries the next of :data:`ROLLOUT_FORGERIES`
    (the last stage learns each job's stop ids from its sampling parameters)."""
    from engine.swarm import messages
    from engine.swarm.coordinator_session import CoordinatorSession
    from engine.swarm.generation import Generation

    stops: dict[str, int] = {}
    vocab: list[int] = []
    honest_sample, honest_send, sent = Generation._sample, CoordinatorSession.send, [0]

    async def sample(self, job, route, params, *args, **kwargs) -> None:
        if params is not None and params.stop_ids:
            if len(stops) > 4096:
                stops.clear()
            stops[job] = int(params.stop_ids[0])
            if not vocab:
                vocab.append(int(self.ctx.stage.rt.vocab_size))
        await honest_sample(self, job, route, params, *args, **kwargs)

    async def send(self, message) -> None:
        if armed.is_set() and isinstance(message, messages.GenDone) and message.job in stops and vocab:
            forgery = ROLLOUT_FORGERIES[sent[0] % len(ROLLOUT_FORGERIES)]
            sent[0] += 1
            message = forged_result(message, forgery, vocab_size=vocab[0], stop_id=stops.pop(message.job))
            log.warning("hostile node forged its result of %s: %s", message.job, forgery)
        await honest_send(self, message)
    Generation._sample, CoordinatorSession.send = sample, send


def _poison_shares(armed: asyncio.Event, attacks: tuple[str, ...]) -> None:
    """Once ``armed``, the gradient this process compresses for its share (and its own part of the
    aggregate, so it steps like its honest siblings) is the next of ``attacks``, one per step."""
    import numpy as np

    from engine.swarm.replica_sync import ReplicaCompressor

    honest_compress, rng, steps = ReplicaCompressor.compress, np.random.default_rng(666), [0]

    def compress(self, grads):
        if armed.is_set():
            attack = attacks[steps[0] % len(attacks)]
            steps[0] += 1
            grads = poisoned_share(dict(grads), attack, rng)
            log.warning("hostile replica poisoned its gradient share: %s", attack)
        return honest_compress(self, grads)
    ReplicaCompressor.compress = compress


def main(argv: list[str]) -> int:
    misbehaviour, polis_args = argv[0], argv[1:]
    if misbehaviour not in MISBEHAVIOURS:
        raise SystemExit(f"usage: python -m tests.support.hostile_node {{{','.join(MISBEHAVIOURS)}}} node ...")
    _patch(misbehaviour)
    from engine.cli import main as polis_main

    return polis_main(polis_args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
