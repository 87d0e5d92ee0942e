"""The node's weight stream end to end: real ``Node`` objects wired in memory (no WebRTC).

Each node is the product's composition (dispatch, weight-stream leader, inference
replica, compute thread); only the links (``tests.support.memory_wire``) and the
stage runtime (a few fp32 tensors instead of a model) are stand-ins. Headers cross
msgpack and the peer-message schemas exactly as on a link.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

from backends.base import StageSpec
from engine.net.errors import ProtocolViolation
from engine.swarm import messages, tensor_bundle
from engine.swarm.node import Node, NodeConfig
from engine.swarm.weight_votes import weights_digest
from tests.support.memory_wire import MemoryWire, RecordingCoordinator

LEAD, OTHER, INF = "lead0000", "lead1111", "zinf0000"  # sorted: the leader first, the replica last


class TensorRuntime:
    """A stage runtime that is only named tensors and a version (what the weight stream touches)."""

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


def _node(peer_id: str, role: str, weights: dict, version: int, wire: MemoryWire) -> Node:
    node = Node(NodeConfig("http://127.0.0.1:9", inference_only=role == "inference"),
                SimpleNamespace(peer_id=peer_id), peers=wire.sender(peer_id), coordinator=RecordingCoordinator())
    wire.attach(peer_id, node.on_peer)
    node.ctx.stage.rt = TensorRuntime(weights, version)
    node.ctx.stage.spec = StageSpec(0, 2, 0, 1)
    node.ctx.membership.update([[LEAD, OTHER, INF], []], [INF], [LEAD, None])
    node.replica.after_load()
    return node


async def _settle(*nodes: Node, timeout_s: float = 10.0) -> None:
    """Until every node is quiet: no task but the follower's, nothing queued or being applied."""
    def quiet(node: Node) -> bool:
        busy = {t for t in node.ctx.tasks.pending() if t.get_name() != "polis-wstream-follow"}
        return not busy and node.replica.idle()

    deadline, calm = time.monotonic() + timeout_s, 0
    while calm < 3:
        assert time.monotonic() < deadline, "the nodes did not settle"
        await asyncio.sleep(0.005)
        calm = calm + 1 if all(quiet(n) for n in nodes) else 0


def _run(scenario, nodes: list[Node]) -> None:
    async def bounded():
        try:
            await asyncio.wait_for(scenario(), 60)
        finally:
            for node in nodes:
                await node.ctx.tasks.cancel_all()
                node.compute.stop()
    asyncio.run(bounded())


def _step(node: Node, rng, version: int) -> None:
    rt = node.rt
    rt.weights = {n: (w - np.float32(1e-3) * np.sign(rng.standard_normal(w.shape))).astype(np.float32)
                  for n, w in rt.weights.items()}
    rt.version = version


def _apply_msg(version: int, leader: str = LEAD, replicas: list[str] | None = None) -> messages.Apply:
    return messages.Apply(step=version - 1, version=version, replicas=replicas or sorted({leader, OTHER}),
                          checkpoint=False, inference=[INF], leader=leader)


def _bits(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[n].view(np.uint32), b[n].view(np.uint32)) for n in a)


def _served(node: Node) -> list[messages.Served]:
    return node.ctx.coordinator.of_type(messages.Served)


def test_replica_syncs_then_follows_deltas_and_resyncs_after_a_lost_or_bad_delta_or_a_new_leader():
    rng = np.random.default_rng(0)
    weights = {"model.layers.0.mlp.up_proj.weight": rng.standard_normal((48, 32)).astype(np.float32),
               "model.layers.0.input_layernorm.weight": np.ones(32, np.float32)}
    wire = MemoryWire()
    nodes: list[Node] = []

    async def scenario():
        lead = _node(LEAD, "trainer", weights, 3, wire)
        other = _node(OTHER, "trainer", weights, 3, wire)
        inf = _node(INF, "inference", {n: np.zeros_like(w) for n, w in weights.items()}, 0, wire)
        nodes.extend([lead, other, inf])

        # 1. the leader holds no stream for the replica: wlead -> full weights with a stream
        await lead.leader.stream_step(_apply_msg(3))
        await _settle(lead, inf)
        assert _served(inf)[-1].full and inf.rt.version == 3 and _bits(inf.rt.weights, lead.rt.weights)
        assert _served(inf)[-1].weights_hash == weights_digest(lead.rt.weights)  # checked against the majority
        assert lead.leader.state.has(INF)

        # 2. deltas: the replica serves exactly the leader's shadow, one residual behind the trainer
        for version in range(4, 12):
            _step(lead, rng, version)
            await lead.leader.stream_step(_apply_msg(version))
            await _settle(lead, inf)
            assert inf.rt.version == version
            assert _bits(inf.rt.weights, lead.leader.state.shadow(INF))
            assert max(np.abs(inf.rt.weights[n] - w).max() for n, w in lead.rt.weights.items()) < 1e-3 / 100
        streamed = lead.ctx.coordinator.of_type(messages.Streamed)
        assert len(streamed) == 8 and streamed[-1].streams[0].checksum == _served(inf)[-1].checksum
        assert _served(inf)[-1].full is False and inf.stream_stats["full_loads"] == 1
        assert lead.stream_stats["deltas_sent"] == 8 and inf.stream_stats["deltas_applied"] == 8

        # 3. a lost delta: the next one is out of sequence -> full weights again, no strike
        wire.drop = lambda src, dst, h: isinstance(h, messages.WDelta) and h.version == 12
        _step(lead, rng, 12)
        await lead.leader.stream_step(_apply_msg(12))
        wire.drop = lambda src, dst, h: False
        _step(lead, rng, 13)
        await lead.leader.stream_step(_apply_msg(13))
        await _settle(lead, inf)
        assert inf.stream_stats["full_loads"] == 2 and not wire.strikes[(INF, LEAD)]
        assert inf.rt.version == 13 and _bits(inf.rt.weights, lead.rt.weights)

        # 4. a malformed delta: a strike against the sender, the replica untouched, then a resync
        before = {n: w.copy() for n, w in inf.rt.weights.items()}

        def corrupt(src, dst, header, payload):
            if isinstance(header, messages.WDelta):
                entry = header.delta["tensors"][0]
                entry[1] = {**entry[1], "shape": [32, 48]}
            return header, payload
        wire.mangle = corrupt
        _step(lead, rng, 14)
        await lead.leader.stream_step(_apply_msg(14))
        wire.mangle = lambda src, dst, header, payload: (header, payload)
        await _settle(lead, inf)
        assert len(wire.strikes[(INF, LEAD)]) == 1 and "bad weight delta" in wire.strikes[(INF, LEAD)][0]
        assert inf.stream_stats["full_loads"] == 3 and _bits(inf.rt.weights, lead.rt.weights)
        assert not _bits(before, inf.rt.weights)

        # 5. a trainer the coordinator did not name leader: its wlead and deltas are ignored and counted
        other.rt.weights, other.rt.version = lead.rt.state_dict(), 14
        _step(other, rng, 15)
        await other.leader.stream_step(_apply_msg(15, leader=OTHER))  # OTHER believes it leads; INF does not
        await _settle(other, inf)
        assert inf.stream_stats["not_leader"] == 1 and inf.rt.version == 14
        assert inf.replica.follower.source == LEAD and not wire.strikes[(INF, OTHER)]
        other.leader.state.clear()

        # 6. the coordinator names a new leader: it holds no stream -> wlead -> full weights from it
        inf.ctx.membership.update([[LEAD, OTHER, INF], []], [INF], [OTHER, None])
        await lead.leader.stream_step(_apply_msg(15, leader=OTHER))  # lead no longer leads: drops streams
        assert not lead.leader.state.peers()
        await other.leader.stream_step(_apply_msg(15, leader=OTHER, replicas=[OTHER, "zz-trainer"]))
        await _settle(other, inf)
        assert inf.replica.follower.source == OTHER and inf.rt.version == 15
        _step(other, rng, 16)
        await other.leader.stream_step(_apply_msg(16, leader=OTHER, replicas=[OTHER, "zz-trainer"]))
        await _settle(other, inf)
        last = _served(inf)[-1]
        assert (last.version, last.source, last.full) == (16, OTHER, False)

        # 7. stream messages from a peer that does not train our stage, or to a trainer: refused
        inf.on_peer(INF, messages.WLead(stage=0, version=99), b"")
        await _settle(inf)
        assert wire.strikes[(INF, INF)] and inf.rt.version == 16
        with pytest.raises(ProtocolViolation):
            lead.on_peer(OTHER, messages.WLead(stage=0, version=99), b"")
        # a trainer of our stage may not ask for a stream (only inference replicas follow one)
        await wire.send(LEAD, OTHER, messages.WeightsReq(stage=0, stream=True), b"")
        assert wire.strikes[(OTHER, LEAD)]

    _run(scenario, nodes)


def test_an_inference_replica_ignores_training_work_from_the_coordinator():
    wire = MemoryWire()
    nodes: list[Node] = []

    async def scenario():
        inf = _node(INF, "inference", {"w": np.zeros((2, 2), np.float32)}, 0, wire)
        trainer = _node(LEAD, "trainer", {}, 0, wire)
        nodes.extend([inf, trainer])
        rows = [[1, 2]]
        for msg in (messages.TrainIn(step=0, mb=0, route=[INF], inputs=rows),
                    messages.TrainOut(step=0, mb=0, route=[INF], targets=rows, mask=[[True, True]],
                                      behaviour=[[0.0, 0.0]], advantages=[1.0], normaliser=1.0),
                    _apply_msg(1), messages.Abort(step=0), messages.Sync(source_peer=LEAD)):
            inf.on_coordinator(msg)
        await asyncio.sleep(0)
        assert not inf.ctx.tasks.pending() and not inf.ctx.coordinator.messages
        assert inf.role == "inference" and trainer.role == "trainer"

    _run(scenario, nodes)
