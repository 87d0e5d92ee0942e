"""The node's weight-stream glue, with two or three nodes wired in memory (real handlers, no WebRTC).

Headers cross msgpack and the peer-message schemas exactly as on a link; compute runs inline.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from types import SimpleNamespace

import msgpack
import numpy as np

from backends.base import StageSpec
from engine.net.errors import ProtocolViolation
from engine.swarm import messages, tensor_bundle
from engine.swarm.inference_replica import InferenceReplica
from engine.swarm.node_jobs import NodeJobs

LEAD, OTHER, INF = "lead0000", "lead1111", "zinf0000"  # sorted: the leader first, the replica last


class FakeRuntime:
    def __init__(self, weights: dict, version: int) -> None:
        self.weights = {n: np.array(w, np.float32) for n, w in weights.items()}
        self.version = version
        self.backend = object()
        self.model_config = SimpleNamespace(to_hf_dict=lambda: {"model_type": "llama"})

    def state_dict(self):
        return {n: w.copy() for n, w in self.weights.items()}

    def snapshot(self):
        return self.state_dict(), self.version

    def shapes(self):
        return {n: w.shape for n, w in self.weights.items()}

    def set_weights(self, weights, version):
        for n, w in weights.items():
            assert w.shape == self.weights[n].shape
            self.weights[n] = np.array(w, np.float32)
        self.version = version

    def checksum(self):
        return tensor_bundle.checksum(self.weights)


class FakeCompute:
    async def run(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


class FakeLink:
    def __init__(self) -> None:
        self.violations: list[str] = []

    def report_violation(self, reason: str, channel: str = "control") -> None:
        self.violations.append(reason)


class Wire:
    """Delivers messages between fake nodes; ``drop`` decides which never arrive."""

    def __init__(self) -> None:
        self.nodes: dict[str, FakeNode] = {}
        self.drop = lambda src, dst, header: False
        self.mangle = lambda src, dst, header, payload: (header, payload)

    async def send(self, src: str, dst: str, header: dict, payload: bytes) -> None:
        header = messages.PEER_MESSAGES.validate(msgpack.unpackb(msgpack.packb(header)))
        if self.drop(src, dst, header):
            return
        header, payload = self.mangle(src, dst, header, bytes(payload))
        node = self.nodes[dst]
        try:
            node._on_peer(src, header, payload)
        except ProtocolViolation as exc:
            node.links[src].report_violation(str(exc))


class FakeNode(NodeJobs, InferenceReplica):
    def __init__(self, peer_id: str, role: str, weights: dict, version: int, wire: Wire) -> None:
        self.config = SimpleNamespace(inference_only=role == "inference")
        self.identity = SimpleNamespace(peer_id=peer_id)
        self.rt = FakeRuntime(weights, version)
        self.compute = FakeCompute()
        self.spec = StageSpec(0, 2, 0, 1)
        self.members = [[LEAD, OTHER, INF], []]
        self.links: dict[str, FakeLink] = defaultdict(FakeLink)
        self._pm = SimpleNamespace(link=lambda peer: self.links[peer])
        self._weights_waiter = None
        self._weights_from = None
        self.to_coordinator: list[dict] = []
        self._tasks: set[asyncio.Task] = set()
        self.wire = wire
        wire.nodes[peer_id] = self
        self._init_weight_stream()
        self.inference_peers = {INF}
        self._stream_after_load()

    async def _send(self, peer, header, payload=b"", channel="control"):
        await self.wire.send(self.identity.peer_id, peer, header, payload)

    async def _send_coordinator(self, message):
        self.to_coordinator.append(messages.NODE_TO_COORDINATOR.validate(message))

    def _spawn(self, coro, name):
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _emit_status(self, force=False):
        pass

    def _expect_weights(self, peer):
        self._weights_waiter = asyncio.get_running_loop().create_future()
        self._weights_from = peer
        return self._weights_waiter


async def _settle(*nodes: FakeNode) -> None:
    """Everything runs inline on this loop: a few hundred passes let every message land."""
    for _ in range(300):
        await asyncio.sleep(0)
    assert not any(n._stream_inbox for n in nodes)


def _run(scenario) -> None:
    async def bounded():
        task = asyncio.ensure_future(scenario())
        try:
            await asyncio.wait_for(task, 30)
        finally:
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()
    asyncio.run(bounded())


def _step(node: FakeNode, rng, version: int) -> None:
    node.rt.weights = {n: (w - np.float32(1e-3) * np.sign(rng.standard_normal(w.shape))).astype(np.float32)
                       for n, w in node.rt.weights.items()}
    node.rt.version = version


def _apply_msg(version: int, leader: str = LEAD) -> dict:
    return {"type": "apply", "step": version - 1, "version": version, "replicas": sorted({leader, OTHER}),
            "checkpoint": False, "inference": [INF]}


def _bits(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[n].view(np.uint32), b[n].view(np.uint32)) for n in a)


def _served(node: FakeNode) -> list[dict]:
    return [m for m in node.to_coordinator if m["type"] == "served"]


def test_replica_syncs_then_follows_deltas_and_resyncs_after_a_lost_or_bad_delta_or_a_new_leader():
    async def scenario():
        rng = np.random.default_rng(0)
        weights = {"model.layers.0.mlp.up_proj.weight": rng.standard_normal((48, 32)).astype(np.float32),
                   "model.layers.0.input_layernorm.weight": np.ones(32, np.float32)}
        wire = Wire()
        lead = FakeNode(LEAD, "trainer", weights, 3, wire)
        other = FakeNode(OTHER, "trainer", weights, 3, wire)
        inf = FakeNode(INF, "inference", {n: np.zeros_like(w) for n, w in weights.items()}, 0, wire)

        # 1. the leader holds no stream for the replica: wlead -> full weights with a stream
        await lead._stream_after_step(_apply_msg(3))
        await _settle(lead, inf)
        assert _served(inf)[-1]["full"] and inf.rt.version == 3 and _bits(inf.rt.weights, lead.rt.weights)
        assert lead._stream_leader.has(INF)

        # 2. deltas: the replica serves exactly the leader's shadow, one residual behind the trainer
        for version in range(4, 12):
            _step(lead, rng, version)
            await lead._stream_after_step(_apply_msg(version))
            await _settle(lead, inf)
            assert inf.rt.version == version
            assert _bits(inf.rt.weights, lead._stream_leader.shadow(INF))
            assert max(np.abs(inf.rt.weights[n] - w).max() for n, w in lead.rt.weights.items()) < 1e-3 / 100
        streamed = [m for m in lead.to_coordinator if m["type"] == "streamed"]
        assert len(streamed) == 8 and streamed[-1]["streams"][0]["checksum"] == _served(inf)[-1]["checksum"]
        assert _served(inf)[-1]["full"] is False and inf.stream_stats["full_loads"] == 1

        # 3. a lost delta: the next one is out of sequence -> full weights again, no strike
        wire.drop = lambda src, dst, h: h["type"] == "wdelta" and h["version"] == 12
        _step(lead, rng, 12)
        await lead._stream_after_step(_apply_msg(12))
        wire.drop = lambda src, dst, h: False
        _step(lead, rng, 13)
        await lead._stream_after_step(_apply_msg(13))
        await _settle(lead, inf)
        assert inf.stream_stats["full_loads"] == 2 and not inf.links[LEAD].violations
        assert inf.rt.version == 13 and _bits(inf.rt.weights, lead.rt.weights)

        # 4. a malformed delta: a strike against the sender, the replica untouched, then a resync
        before = {n: w.copy() for n, w in inf.rt.weights.items()}

        def corrupt(src, dst, header, payload):
            if header["type"] == "wdelta":
                entry = header["delta"]["tensors"][0]
                entry[1] = {**entry[1], "shape": [32, 48]}
            return header, payload
        wire.mangle = corrupt
        _step(lead, rng, 14)
        await lead._stream_after_step(_apply_msg(14))
        wire.mangle = lambda src, dst, header, payload: (header, payload)
        await _settle(lead, inf)
        assert len(inf.links[LEAD].violations) == 1 and "bad weight delta" in inf.links[LEAD].violations[0]
        assert inf.stream_stats["full_loads"] == 3 and _bits(inf.rt.weights, lead.rt.weights)
        assert not _bits(before, inf.rt.weights)

        # 5. the leader changes: the new one holds no stream -> wlead -> full weights from it
        other.rt.weights, other.rt.version = lead.rt.state_dict(), 14
        _step(other, rng, 15)
        await lead._stream_after_step(_apply_msg(15, leader=OTHER))  # lead is no longer first: drops streams
        assert not lead._stream_leader.peers()
        await other._stream_after_step({**_apply_msg(15), "replicas": [OTHER, "zz-trainer"]})
        await _settle(other, inf)
        assert inf._stream_follower.source == OTHER and inf.rt.version == 15
        _step(other, rng, 16)
        await other._stream_after_step({**_apply_msg(16), "replicas": [OTHER, "zz-trainer"]})
        await _settle(other, inf)
        assert _served(inf)[-1] == {**_served(inf)[-1], "version": 16, "source": OTHER, "full": False}

        # 6. stream messages from a peer that does not train our stage, or to a trainer: refused
        inf._on_peer(INF, {"type": "wlead", "stage": 0, "version": 99}, b"")
        await _settle(inf)
        assert inf.links[INF].violations and inf.rt.version == 16
        try:
            lead._on_peer(OTHER, {"type": "wlead", "stage": 0, "version": 99}, b"")
            raise AssertionError("a trainer accepted a weight stream")
        except ProtocolViolation:
            pass
        # a trainer of our stage may not ask for a stream (only inference replicas follow one)
        await wire.send(LEAD, OTHER, {"type": "weights_req", "stage": 0, "stream": True}, b"")
        assert other.links[LEAD].violations

    _run(scenario)


def test_an_inference_replica_ignores_training_work_from_the_coordinator():
    async def scenario():
        wire = Wire()
        inf = FakeNode(INF, "inference", {"w": np.zeros((2, 2), np.float32)}, 0, wire)
        for kind in ("train_in", "train_out", "apply", "abort", "sync"):
            inf._on_coordinator({"type": kind, "step": 0, "mb": 0, "source_peer": LEAD})
        await asyncio.sleep(0)
        assert not inf._tasks and not inf.to_coordinator
        assert inf.role == "inference" and FakeNode(LEAD, "trainer", {}, 0, wire).role == "trainer"

    _run(scenario)
