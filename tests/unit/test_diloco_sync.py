"""DiLoCo / SparseLoCo replica sync: pseudo-gradients, the outer step, and real nodes that use it.

The maths (``engine.swarm.outer_sync``) on plain arrays, then two real torch replicas of
one stage (the shipped base, wired in memory): between syncs they train on different
micro-batches and differ; at every H-th version they exchange compressed pseudo-gradients
and hold the very same bits; a replica told to resync gets the anchor and the outer momentum.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from engine.paths import base_checkpoint_dir
from engine.swarm import messages, tensor_bundle
from engine.swarm.coordinator import Coordinator, CoordinatorConfig
from engine.swarm.node import Node, NodeConfig
from engine.swarm.outer_sync import OuterSync
from engine.swarm.replica_sync import aggregate, dense_nbytes
from engine.swarm.run_config import ReplicaSyncSettings, RunConfig, apply_overrides
from tests.support.memory_wire import MemoryWire, RecordingCoordinator


def _weights(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a.weight": (scale * rng.normal(size=(64, 48))).astype(np.float32),
            "b.bias": (scale * rng.normal(size=(48,))).astype(np.float32)}


def _sync_round(replicas: dict[str, OuterSync], moved: dict[str, dict[str, np.ndarray]]):
    """One sync as the nodes do it: each compresses, sends bytes, aggregates what it decodes."""
    sent, own = {}, {}
    for peer, outer in replicas.items():
        encoded, own[peer] = outer.compress(moved[peer])
        sent[peer] = tensor_bundle.pack(encoded)
    shapes = {n: a.shape for n, a in own[next(iter(own))].items()}
    out = {}
    for me, outer in replicas.items():
        contributions = {me: own[me]}
        for peer, (entries, payload) in sent.items():
            if peer != me:
                contributions[peer] = tensor_bundle.unpack(entries, payload, shapes, require_all=True)
        out[me] = outer.outer_step(aggregate(contributions), len(contributions))
    return out, sum(len(p) for _, p in sent.values())


@pytest.mark.parametrize("settings", [
    ReplicaSyncSettings(mode="diloco", encoding="topk", topk_fraction=0.02, value_bits=2),
    ReplicaSyncSettings(mode="diloco", encoding="int8", outer_lr=0.7, outer_momentum=0.9),
])
def test_replicas_that_drifted_apart_hold_the_same_bits_after_every_outer_step(settings):
    start = _weights(0)
    replicas = {p: OuterSync(settings, start) for p in ("p0", "p1", "p2")}
    for round_ in range(3):
        moved = {p: {n: replicas[p].anchor[n] + 0.01 * _weights(10 * round_ + i)[n] for n in start}
                 for i, p in enumerate(replicas)}
        synced, _ = _sync_round(replicas, moved)
        first = synced["p0"]
        assert not np.array_equal(first["a.weight"], start["a.weight"])
        for other in list(synced.values())[1:]:
            for name in first:
                assert np.array_equal(first[name], other[name])
        for outer in replicas.values():  # the anchors (and momenta) agree too
            assert all(np.array_equal(outer.anchor[n], first[n]) for n in first)
    if settings.outer_momentum:
        m = [r.momentum_state() for r in replicas.values()]
        assert all(np.array_equal(m[0][n], x[n]) for x in m[1:] for n in m[0])


def test_lossless_diloco_with_unit_outer_lr_and_no_momentum_averages_the_replicas():
    settings = ReplicaSyncSettings(mode="diloco", encoding="fp32")
    start = _weights(0)
    replicas = {p: OuterSync(settings, start) for p in ("p0", "p1")}
    moved = {p: {n: start[n] + 0.1 * _weights(i + 1)[n] for n in start} for i, p in enumerate(replicas)}
    synced, _ = _sync_round(replicas, moved)
    for name in start:
        np.testing.assert_allclose(synced["p0"][name], (moved["p0"][name] + moved["p1"][name]) / 2, atol=1e-6)


def test_sparse_two_bit_pseudo_gradients_are_over_a_hundred_times_smaller_than_dense_fp32():
    settings = ReplicaSyncSettings(mode="diloco", encoding="topk", topk_fraction=0.02, value_bits=2)
    start = {"w": np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)}
    outer = OuterSync(settings, start)
    encoded, decoded = outer.compress({"w": start["w"] + 0.01})
    payload = tensor_bundle.pack(encoded)[1]
    assert dense_nbytes(start) / len(payload) > 100
    assert np.count_nonzero(decoded["w"]) == int(np.ceil(0.02 * start["w"].size))


def test_a_non_finite_aggregate_leaves_every_replica_at_the_anchor():
    settings = ReplicaSyncSettings(mode="diloco", encoding="fp32")
    start = _weights(3)
    outer = OuterSync(settings, start)
    poisoned = {n: np.full(a.shape, np.nan, np.float32) for n, a in start.items()}
    after = outer.outer_step(poisoned, 2)
    assert all(np.array_equal(after[n], start[n]) for n in start)


def test_error_decay_below_one_forgets_part_of_what_was_not_sent():
    def owed(decay: float) -> float:
        settings = ReplicaSyncSettings(mode="diloco", encoding="topk", topk_fraction=0.05, error_decay=decay)
        start = _weights(5)
        outer = OuterSync(settings, start)
        for _ in range(5):
            outer.compress({n: start[n] - 0.1 for n in start})
        return outer.residual_norm()
    assert owed(0.5) < 0.7 * owed(1.0)


def test_diloco_settings_are_typed_and_checked_in_the_run_config():
    run = apply_overrides(RunConfig(), ["replica_sync.mode=diloco", "replica_sync.inner_steps=4"])
    assert run.replica_sync.mode == "diloco" and run.replica_sync.synced_at(8) and not run.replica_sync.synced_at(9)
    assert RunConfig().replica_sync.synced_at(7)  # every step: replicas always agree
    for bad in ("replica_sync.mode=sometimes", "replica_sync.inner_steps=0", "replica_sync.value_bits=3",
                "replica_sync.outer_momentum=1.0", "replica_sync.topk_fraction=0"):
        with pytest.raises(ValueError):
            apply_overrides(RunConfig(), [bad])


# ---------------------------------------------------------------------------- real nodes

P0, P2 = "peer0000", "peer2222"
INPUTS = {P0: [[1, 5, 6, 9, 11], [1, 7, 8, 10, 12]], P2: [[1, 9, 8, 7, 6], [1, 12, 11, 10, 5]]}
TARGETS = {P0: [[5, 6, 9, 11, 2], [7, 8, 10, 12, 2]], P2: [[9, 8, 7, 6, 2], [12, 11, 10, 5, 2]]}
MASK = [[False, False, True, True, True]] * 2


def _node(peer_id: str, wire: MemoryWire) -> Node:
    node = Node(NodeConfig("http://127.0.0.1:9", backend="torch", device="cpu",
                           base_checkpoint=str(base_checkpoint_dir())),
                SimpleNamespace(peer_id=peer_id), peers=wire.sender(peer_id), coordinator=RecordingCoordinator())
    wire.attach(peer_id, node.on_peer)
    return node


def _send(node: Node, message: dict) -> None:
    node.on_coordinator(messages.decode_from_coordinator(json.dumps(message)))


def test_two_real_replicas_differ_between_syncs_agree_bit_for_bit_after_each_and_a_resync_takes_the_anchor():
    pytest.importorskip("torch")
    from tests.unit.test_node_pipeline import _run, _sent, _until

    run = RunConfig(lr=1e-2, activation_encoding="fp32", replica_sync=ReplicaSyncSettings(
        mode="diloco", inner_steps=2, encoding="topk", topk_fraction=0.05, value_bits=2, outer_lr=0.8,
        outer_momentum=0.5))
    wire = MemoryWire()
    nodes: list[Node] = []
    states: list[tuple[dict, dict]] = []
    stepped: list[list[messages.Stepped]] = []
    resynced: dict[str, object] = {}

    async def scenario():
        a, b = _node(P0, wire), _node(P2, wire)
        nodes.extend([a, b])
        for node in nodes:
            await node.start_compute()
            _send(node, {"type": "members", "stages": [[P0, P2]], "version": 0})
            _send(node, {"type": "welcome", "stage": 0, "num_stages": 1, "layer_start": 0, "layer_end": 2,
                         "num_layers": 2, "source": "checkpoint", "source_peer": None, "stage_checkpoint": None,
                         "version": 0, "run": run.to_dict(), "run_id": "run-diloco",
                         "signal_url": "ws://127.0.0.1:9/s"})
        await _until("both replicas ready", lambda: _sent(a, messages.Ready) and _sent(b, messages.Ready))
        states.append((a.rt.state_dict(), b.rt.state_dict()))
        behaviour = {p: (await a.compute.run(a.rt.prox_logprobs, np.asarray(INPUTS[p]), np.asarray(TARGETS[p]),
                                             run.sampling.temperature)).tolist() for p in (P0, P2)}
        for step in range(4):
            for node, peer in ((a, P0), (b, P2)):  # each replica trains on its own micro-batch
                _send(node, {"type": "train_in", "step": step, "mb": 0, "route": [peer], "inputs": INPUTS[peer]})
                _send(node, {"type": "train_out", "step": step, "mb": 0, "route": [peer], "targets": TARGETS[peer],
                             "mask": MASK, "behaviour": behaviour[peer], "advantages": [1.0, -1.0],
                             "normaliser": 12.0})
            for node in nodes:
                await _until("mb_done", lambda n=node, s=step: len(_sent(n, messages.MbDone)) > s)
                _send(node, {"type": "apply", "step": step, "version": step + 1, "replicas": [P0, P2],
                             "checkpoint": False})
            for node in nodes:
                await _until("stepped", lambda n=node, s=step: len(_sent(n, messages.Stepped)) > s)
            states.append((await a.compute.run(a.rt.state_dict), await b.compute.run(b.rt.state_dict)))
            stepped.append([_sent(n, messages.Stepped)[step] for n in nodes])
        # b drifts (as a buggy replica would), then the coordinator tells it to resync from a
        await b.compute.run(b.rt.set_weights, {n: w + 1.0 for n, w in states[-1][1].items()}, 4)
        _send(b, {"type": "sync", "source_peer": P0})
        await _until("resynced", lambda: np.array_equal(b.rt.state_dict()["model.norm.weight"],
                                                         states[-1][0]["model.norm.weight"]))
        resynced["weights"] = await b.compute.run(b.rt.state_dict)
        resynced["momentum"] = (a.replicas._outer.momentum_state(), b.replicas._outer.momentum_state())

    _run(scenario, nodes)
    names = sorted(states[0][0])
    same = [all(np.array_equal(x[n], y[n]) for n in names) for x, y in states]
    assert same == [True, False, True, False, True]  # equal at versions 0, 2, 4 only
    assert not np.array_equal(states[2][0][names[0]], states[0][0][names[0]])  # and they moved
    for version, reports in enumerate(stepped, start=1):
        assert reports[0].checksum == reports[1].checksum if version % 2 == 0 else True
        for r in reports:
            if version % 2:
                assert r.update_bytes == 0  # inner steps send nothing
            else:
                assert 0 < r.update_bytes < 0.1 * r.dense_bytes
    assert all(np.array_equal(resynced["weights"][n], states[-1][0][n]) for n in names)
    ma, mb = resynced["momentum"]
    assert ma and all(np.array_equal(ma[n], mb[n]) for n in ma)


def test_the_coordinator_votes_on_replica_weights_only_at_versions_where_diloco_replicas_agree():
    import asyncio
    from collections import Counter

    from engine.swarm.credit import Credit
    from engine.swarm.step_runner import StepRunner

    votes: list[tuple[int, dict, int]] = []

    async def check_weights(stage, digests, version):
        votes.append((stage, dict(digests), version))

    runner = SimpleNamespace(run=RunConfig(replica_sync=ReplicaSyncSettings(mode="diloco", inner_steps=4)),
                             links=SimpleNamespace(stage_replicas=lambda: [["a", "b"]], check_weights=check_weights),
                             checkpoints={}, checkpoint_versions={}, store=None,
                             book=SimpleNamespace(counters=Counter(), credit=Credit()))

    def reports(version):
        return {p: messages.Stepped(step=version - 1, version=version, grad_norm=1.0, checksum=c, update_bytes=0,
                                    dense_bytes=4, checkpoint_path=None, weights_hash=h)
                for p, c, h in (("a", 1.0, "aa" * 16), ("b", 2.0, "bb" * 16))}

    asyncio.run(StepRunner._check_replicas(runner, reports(5), 5))  # between syncs: differing is expected
    assert votes == []
    asyncio.run(StepRunner._check_replicas(runner, reports(8), 8))  # right after a sync: the digests are voted on
    assert votes == [(0, {"a": "aa" * 16, "b": "bb" * 16}, 8)]
    runner.links.stage_replicas = lambda: [["a"]]  # a lone replica agrees with itself: recorded every version
    asyncio.run(StepRunner._check_replicas(runner, reports(5), 5))  # (credit and export's digest go on)
    assert votes[-1] == (0, {"a": "aa" * 16}, 5)


def test_dense_two_bit_pseudo_gradients_carry_no_indices_and_error_feedback_sends_what_they_round_off():
    settings = ReplicaSyncSettings(mode="diloco", encoding="topk", topk_fraction=1.0, value_bits=2)
    start = {"w": np.random.default_rng(0).normal(size=(128, 128)).astype(np.float32)}
    outer = OuterSync(settings, start)
    drift = {"w": start["w"] - 0.01 * np.random.default_rng(1).normal(size=(128, 128)).astype(np.float32)}
    sent = np.zeros_like(start["w"])
    for _ in range(8):
        encoded, decoded = outer.compress(drift)
        sent += decoded["w"]
    payload = tensor_bundle.pack(encoded)[1]
    assert len(payload) <= start["w"].size // 4 + 4 * 8  # 2 bits a value and one scale per 4096
    np.testing.assert_allclose(sent + outer.compressor._feedback.residual("w"), 8 * (start["w"] - drift["w"]),
                               atol=1e-4)
    assert outer.residual_norm() < 0.2 * float(np.linalg.norm(8 * (start["w"] - drift["w"])))


def test_a_coordinator_refuses_diloco_on_a_tied_model_fully_fine_tuned_and_says_what_to_set(tmp_path):
    tied = tmp_path / "tied-base"
    shutil.copytree(base_checkpoint_dir(), tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    diloco = apply_overrides(RunConfig(), ["replica_sync.mode=diloco"])

    dbs = iter(range(100))

    def start(run: RunConfig, checkpoint, stages: int = 2, db: str | None = None) -> RunConfig:
        c = Coordinator(CoordinatorConfig(db_path=str(tmp_path / (db or f"c{next(dbs)}.db")),
                                          base_checkpoint=str(checkpoint), num_stages=stages, run=run))
        c.store.close()
        return c.run

    with pytest.raises(ValueError, match="lora.enabled=true"):
        start(diloco, tied, db="refused.db")
    lora = apply_overrides(diloco, ["lora.enabled=true"])
    assert start(lora, tied, db="refused.db") == lora  # the refused run was not stored: the fix takes
    start(diloco, base_checkpoint_dir())  # untied: the stages share nothing
    start(diloco, tied, stages=1)  # one stage holds both uses
    start(RunConfig(), tied)  # every step keeps the copies in step


def test_low_bit_pseudo_gradients_take_least_squared_error_scales_when_asked():
    rng = np.random.default_rng(4)
    start = {"w": np.zeros((64, 256), np.float32)}
    drift = {"w": -0.01 * rng.standard_t(3, size=(64, 256)).astype(np.float32)}  # heavy-tailed
    error = {}
    for bits, scale in ((2, "mse"), (2, "absmax"), (1, "mse")):
        settings = ReplicaSyncSettings(mode="diloco", encoding="topk", topk_fraction=1.0, value_bits=bits,
                                       value_scale=scale)
        _, decoded = OuterSync(settings, start).compress(drift)
        error[bits, scale] = float(np.linalg.norm(decoded["w"] + drift["w"]) / np.linalg.norm(drift["w"]))
    assert ReplicaSyncSettings().value_scale == "absmax"  # what the measured recipes ran
    assert error[2, "mse"] < error[1, "mse"] < 0.85 < 2 < error[2, "absmax"]
