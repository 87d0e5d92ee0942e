"""`polis export --coordinator`: fetched weights are checked against the swarm's agreed digest, permits are
narrow, and a run record sent by a coordinator writes the same export as the local database."""

import asyncio
import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from engine.model.export.hf_export import export_version, write_export
from engine.model.export.run_record import RunRecord
from engine.model.export.stage_files import read_stage
from engine.swarm import messages
from engine.swarm.export_api import ExportStage
from engine.swarm.export_fetch import WeightsRefused, verify_stage
from engine.swarm.export_permits import ExportPermits
from engine.swarm.messages import ExportPermit
from engine.swarm.weight_votes import WeightAuthority, weights_digest


def _weights():
    rng = np.random.default_rng(0)
    return {"model.layers.1.mlp.up_proj.weight": rng.standard_normal((8, 4)).astype(np.float32),
            "model.norm.weight": np.ones(4, np.float32)}


def _stage(weights_hash):
    return ExportStage(stage=1, layer_start=1, layer_end=2, leader="peer-leader-1", leader_version=5,
                       weights_hash=weights_hash, checkpoint_path=None)


def test_fetched_weights_that_miss_the_agreed_hash_are_refused_naming_the_stage():
    honest = _weights()
    agreed = weights_digest(honest)
    tampered = {k: v.copy() for k, v in honest.items()}
    tampered["model.norm.weight"][2] += 1e-6  # one entry, one ulp-ish: still not the swarm's weights
    with pytest.raises(WeightsRefused, match=r"stage 1: the weights from peer x \(WebRTC\) hash to [0-9a-f]{32}, "
                                             rf"not {agreed}.*version 5; refused, nothing written"):
        verify_stage(_stage(agreed), 5, 5, tampered, source="peer x (WebRTC)", lora=None, base=None)
    ok = verify_stage(_stage(agreed), 5, 5, honest, source="peer x (WebRTC)", lora=None, base="/b")
    assert (ok.stage, ok.version, ok.sha256, ok.hash_kind, ok.layers) == (1, 5, agreed, "blake2b-128", (1, 2))


def test_fetched_weights_of_another_version_or_without_an_agreed_hash_are_refused():
    honest = _weights()
    with pytest.raises(WeightsRefused, match="stage 1: peer x holds version 6, not 5.*export version 6"):
        verify_stage(_stage(weights_digest(honest)), 5, 6, honest, source="peer x", lora=None, base=None)
    with pytest.raises(WeightsRefused, match="no agreed digest of its weights at version 5"):
        verify_stage(_stage(None), 5, 5, honest, source="peer x", lora=None, base=None)


def test_a_lone_replicas_digest_is_the_stages_agreed_hash_for_the_last_versions():
    authority = WeightAuthority()
    for version in range(1, 12):
        authority.vote(0, {"a": f"{version:032x}"}, version)
    assert authority.decided(0, 11) == f"{11:032x}"
    assert authority.decided(0, 2) is None  # only the last KEEP_VERSIONS are kept
    authority.vote(1, {"a": "1" * 32, "b": "1" * 32, "c": "2" * 32}, 4)
    assert authority.decided(1, 4) == "1" * 32


def test_an_export_permit_lets_only_its_exporter_fetch_only_its_stage_until_it_expires():
    now = [1000.0]
    permits = ExportPermits(clock=lambda: now[0])
    permits.grant(ExportPermit(peer="exporter-1", stage=1, expires_s=1600))
    assert permits.allows("exporter-1") and permits.allows("exporter-1", 1)
    assert not permits.allows("exporter-1", 0) and not permits.allows("someone-else")
    now[0] = 1600 + 301  # past the expiry and the clock skew allowance
    assert not permits.allows("exporter-1")


def test_a_run_record_sent_by_the_coordinator_writes_the_same_export_as_the_local_database(tmp_path):
    pytest.importorskip("torch")
    from engine.paths import base_checkpoint_dir
    from tests.support.stage_run import make_run

    run = make_run(tmp_path / "run", base_checkpoint_dir(), num_stages=2, steps=2)
    try:
        local = export_version(run.run_dir, tmp_path / "local")
        record = RunRecord.open(run.run_dir)
        sent = RunRecord.from_dict(json.loads(json.dumps(record.to_dict())), origin="http://127.0.0.1:1")
        assert sent.to_dict() == record.to_dict() and sent.source == "http://127.0.0.1:1"
        stages = [read_stage(record, s, local.version) for s in range(record.num_stages)]
        remote = write_export(sent, stages, tmp_path / "remote")
    finally:
        run.close()
    for shard in local.shards:
        assert (tmp_path / "local" / shard).read_bytes() == (tmp_path / "remote" / shard).read_bytes()
    manifest = json.loads((tmp_path / "remote" / "polis_model.json").read_text())
    assert manifest["source"] == "http://127.0.0.1:1" and remote.version == local.version == 2


class _Stage:
    """The stage runtime part a leader serves weights from (a node's compute thread calls it)."""

    def __init__(self) -> None:
        self.weights, self.version = _weights(), 7
        self.backend = object()
        self.model_config = SimpleNamespace(to_hf_dict=lambda: {"model_type": "llama"})

    def snapshot(self):
        return {n: w.copy() for n, w in self.weights.items()}, self.version


def test_a_stage_leader_sends_its_weights_to_an_exporter_only_with_the_coordinators_permit():
    from backends.base import StageSpec
    from engine.swarm import tensor_bundle
    from engine.swarm.node import Node, NodeConfig
    from engine.swarm.run_config import RunConfig
    from tests.support.memory_wire import MemoryWire, RecordingCoordinator

    wire, got = MemoryWire(), []
    leader, exporter = "leader-0001", "exporter-1"
    node = Node(NodeConfig("http://127.0.0.1:9"), SimpleNamespace(peer_id=leader), peers=wire.sender(leader),
                coordinator=RecordingCoordinator())
    wire.attach(leader, node.on_peer)
    wire.attach(exporter, lambda sender, header, payload: got.append((header, payload)))
    node.ctx.stage.rt, node.ctx.stage.spec, node.ctx.stage.run_cfg = _Stage(), StageSpec(1, 2, 1, 2), RunConfig()
    node.ctx.membership.update([["other-0001"], [leader]], [])

    async def settle():
        for _ in range(400):
            await asyncio.sleep(0.005)
            if not node.ctx.tasks.pending():
                return

    async def scenario():
        try:
            await wire.send(exporter, leader, messages.WeightsReq(stage=1))
            await settle()
            assert not got and "not a replica of ours" in wire.strikes[(leader, exporter)][-1]
            node.on_coordinator(messages.decode_from_coordinator(messages.encode(
                ExportPermit(peer=exporter, stage=1, expires_s=int(time.time()) + 600))))
            assert node.export_permits.allows(exporter)  # its links accept the exporter now
            await wire.send(exporter, leader, messages.WeightsReq(stage=0))  # another stage than permitted
            await wire.send(exporter, leader, messages.WeightsReq(stage=1, stream=True))  # no stream for it
            await settle()
            assert not got and len(wire.strikes[(leader, exporter)]) == 3
            await wire.send(exporter, leader, messages.WeightsReq(stage=1))
            await settle()
        finally:
            await node.ctx.tasks.cancel_all()
            node.compute.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    (header, payload), = got
    tensors = tensor_bundle.unpack(header.tensors, payload, {n: w.shape for n, w in _weights().items()},
                                   require_all=True)
    assert (header.stage, header.version) == (1, 7) and weights_digest(tensors) == weights_digest(_weights())


def test_the_export_api_refuses_malformed_requests_and_versions_the_run_does_not_have():
    from engine.swarm.export_api import MAX_REQUEST_BYTES, ExportRefused, plan_export

    source = SimpleNamespace(book=SimpleNamespace(version=4))
    for body, why in ((b"{", "not an export request"), (b'{"peer_id": "exporter-1", "admin": true}', "not an export"),
                      (b'{"peer_id": "x"}', "not an export request"), (b" " * (MAX_REQUEST_BYTES + 1), "over"),
                      (b'{"peer_id": "exporter-1", "version": 5}', "the run is at version 4; it has no version 5")):
        with pytest.raises(ExportRefused, match=why):
            asyncio.run(plan_export(source, body))
