"""Tied embeddings and LoRA in the swarm: real torch stages of the tiny tied Llama, wired in memory.

Stage 0 (embedding) and stage 1 (head) each hold ``model.embed_tokens.weight``. After a few
training steps through the nodes (micro-batch forward and backward, then ``apply``, where the
two ends exchange their gradients of the shared matrix and clip as one unit) both copies are
bit-identical, have moved, and equal the in-process pipeline's (``LocalPipeline``, which sums
the tied gradient in process) on the same batches. Under LoRA only adapters train, travel to a
new replica (which reads the frozen base from its own files) and go into the stage checkpoint.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from engine.rl.objective import compute_objective
from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm.node import Node, NodeConfig
from engine.swarm.run_config import LoraSettings, RunConfig
from tests.support.memory_wire import MemoryWire, RecordingCoordinator
from tests.support.tiny_tied_llama import write_tiny_tied_llama
from tests.unit.test_node_pipeline import _run, _sent, _until

pytest.importorskip("torch")

P0, P1 = "peer0000", "peer1111"
TIED = "model.embed_tokens.weight"
STEPS = 3
INPUTS = [[1, 5, 6, 9, 11], [1, 7, 8, 10, 12]]
TARGETS = [[5, 6, 9, 11, 2], [7, 8, 10, 12, 2]]
MASK = [[False, False, True, True, True]] * 2
ADVANTAGES = [1.0, -1.0]


def _node(peer_id: str, wire: MemoryWire, model_dir) -> Node:
    node = Node(NodeConfig("http://127.0.0.1:9", backend="torch", device="cpu", base_checkpoint=str(model_dir)),
                SimpleNamespace(peer_id=peer_id), peers=wire.sender(peer_id), coordinator=RecordingCoordinator())
    wire.attach(peer_id, node.on_peer)
    return node


def _send(node: Node, message: dict) -> None:
    node.on_coordinator(messages.decode_from_coordinator(json.dumps(message)))


async def _two_ready_stages(wire: MemoryWire, model_dir, run: RunConfig, nodes: list[Node]) -> tuple[Node, Node]:
    """The nodes of stage 0 (P0) and stage 1 (P1), added to ``nodes``, welcomed to ``run`` and ready."""
    first, last = _node(P0, wire, model_dir), _node(P1, wire, model_dir)
    nodes.extend([first, last])
    for node in nodes:
        await node.start_compute()
        _send(node, {"type": "members", "stages": [[P0], [P1]], "version": 0})
    for stage, node in enumerate(nodes):
        _send(node, _welcome(stage, run))
    await _until("both stages ready", lambda: _sent(first, messages.Ready) and _sent(last, messages.Ready))
    return first, last


def test_the_two_copies_of_a_tied_embedding_stay_bit_identical_and_equal_the_in_process_pipeline(tmp_path):
    model_dir = write_tiny_tied_llama(tmp_path / "tiny", num_layers=4)
    # a large lr and a clip that bites (copies drift if mishandled); lossless activations, to compare with in-process
    run = RunConfig(lr=1e-2, max_grad_norm=0.05, activation_encoding="fp32")
    # the in-process pipeline on the same batches: the tied gradient summed in process, one clip unit
    from backends.base import OptimizerConfig
    from engine.rl.pipeline import LocalPipeline

    pipe = LocalPipeline.from_checkpoint(model_dir, 2, "torch", device="cpu", optimizer=OptimizerConfig(lr=run.lr))
    rules = UpdateRules(objective=run.objective, max_grad_norm=run.max_grad_norm)
    inputs, targets, temperature = np.asarray(INPUTS), np.asarray(TARGETS), run.sampling.temperature
    behaviour = pipe.token_logprobs(inputs, targets, temperature=temperature).tolist()  # as if sampled by v0
    expected = []
    for _ in range(STEPS):
        logp = pipe.token_logprobs(inputs, targets, key="k", temperature=temperature)
        result = compute_objective(logp, logp.copy(), np.asarray(behaviour, dtype=np.float32),
                                   np.asarray(ADVANTAGES, dtype=np.float32), np.asarray(MASK), run.objective,
                                   normaliser=6.0)
        pipe.backward("k", result.grad)
        pipe.step(rules.stage_clip_scales(pipe.grad_sq_norms(), pipe.clip_units()))
        expected.append(pipe.backends[0].state_dict()[TIED])
    np.testing.assert_array_equal(expected[-1], pipe.backends[-1].state_dict()[TIED])

    wire = MemoryWire()
    nodes: list[Node] = []
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    initial: dict[str, np.ndarray] = {}

    async def scenario():
        first, last = await _two_ready_stages(wire, model_dir, run, nodes)
        assert first.rt.tied_names == last.rt.tied_names == (TIED,)
        initial[TIED] = first.rt.state_dict()[TIED].copy()
        route = [P0, P1]
        for step in range(STEPS):
            _send(first, {"type": "train_in", "step": step, "mb": 0, "route": route, "inputs": INPUTS})
            _send(last, {"type": "train_out", "step": step, "mb": 0, "route": route, "targets": TARGETS,
                         "mask": MASK, "behaviour": behaviour, "advantages": ADVANTAGES, "normaliser": 6.0})
            await _until("mb_done", lambda s=step: len(_sent(first, messages.MbDone)) > s)
            for node, trainers in ((first, [P0]), (last, [P1])):
                _send(node, {"type": "apply", "step": step, "version": step + 1, "replicas": trainers,
                             "checkpoint": False})
            for node in nodes:
                await _until("stepped", lambda n=node, s=step: len(_sent(n, messages.Stepped)) > s)
            copies.append((first.rt.state_dict()[TIED], last.rt.state_dict()[TIED]))
            assert first.ctx.counters.get("tied_missing", 0) == last.ctx.counters.get("tied_missing", 0) == 0

    _run(scenario, nodes)
    for a, b in copies:
        np.testing.assert_array_equal(a, b)  # bit for bit, every step
    assert not np.array_equal(copies[-1][0], initial[TIED])
    for (a, _), want in zip(copies, expected):
        np.testing.assert_allclose(a, want, rtol=0, atol=1e-6)


def test_under_lora_only_adapters_train_travel_and_checkpoint_and_a_new_replica_takes_its_base_from_files(
        tmp_path, monkeypatch):
    monkeypatch.setenv("POLIS_DATA_DIR", str(tmp_path / "data"))  # where the stage checkpoint goes
    model_dir = write_tiny_tied_llama(tmp_path / "tiny", num_layers=4)
    run = RunConfig(lr=1e-2, activation_encoding="fp32", lora=LoraSettings(enabled=True, rank=4))
    wire = MemoryWire()
    nodes: list[Node] = []
    seen: dict[str, object] = {}
    P2 = "peer2222"
    sent_kinds: list[str] = []
    wire.drop = lambda src, dst, header: sent_kinds.append(type(header).__name__) and False

    async def scenario():
        first, last, fresh = (_node(p, wire, model_dir) for p in (P0, P1, P2))
        nodes.extend([first, last, fresh])
        for node in nodes:
            await node.start_compute()
            _send(node, {"type": "members", "stages": [[P0, P2], [P1]], "version": 0})
        for stage, node in enumerate((first, last)):
            _send(node, _welcome(stage, run))
        await _until("both stages ready", lambda: _sent(first, messages.Ready) and _sent(last, messages.Ready))
        assert first.rt.tied_names == last.rt.tied_names == ()  # the embedding is frozen: nothing to sum
        route = [P0, P1]
        _send(first, {"type": "train_in", "step": 0, "mb": 0, "route": route, "inputs": INPUTS})
        behaviour = [[-6.0] * 5] * 2
        _send(last, {"type": "train_out", "step": 0, "mb": 0, "route": route, "targets": TARGETS, "mask": MASK,
                     "behaviour": behaviour, "advantages": ADVANTAGES, "normaliser": 6.0})
        await _until("mb_done", lambda: _sent(first, messages.MbDone))
        for node, trainers in ((first, [P0]), (last, [P1])):
            _send(node, {"type": "apply", "step": 0, "version": 1, "replicas": trainers, "checkpoint": True})
        for node in (first, last):
            await _until("stepped", lambda n=node: _sent(n, messages.Stepped))
        seen["names"] = set(first.rt.state_dict())
        seen["stepped"] = _sent(first, messages.Stepped)[0]
        # a new replica of stage 0: its base from its own files, the adapters from the replica
        _send(fresh, _welcome(0, run, source="peer", source_peer=P0, version=1))
        await _until("the fresh replica ready", lambda: _sent(fresh, messages.Ready))
        seen["checksums"] = (first.rt.checksum(), fresh.rt.checksum())
        seen["merged"] = (first.rt.backend.merged_state_dict(), fresh.rt.backend.merged_state_dict())

    _run(scenario, nodes)
    names, stepped = seen["names"], seen["stepped"]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert stepped.grad_norm > 0 and "TiedGrad" not in sent_kinds
    from safetensors.numpy import load_file

    assert set(load_file(stepped.checkpoint_path)) == names  # the stage checkpoint: adapters only
    a, b = seen["checksums"]
    assert a == b
    merged_first, merged_fresh = seen["merged"]
    assert set(merged_first) == set(merged_fresh) and "model.embed_tokens.weight" in merged_first
    for name in merged_first:
        np.testing.assert_array_equal(merged_first[name], merged_fresh[name])


def _welcome(stage: int, run: RunConfig, *, source: str = "checkpoint", source_peer: str | None = None,
             version: int = 0) -> dict:
    return {"type": "welcome", "stage": stage, "num_stages": 2, "layer_start": 2 * stage, "layer_end": 2 * stage + 2,
            "num_layers": 4, "source": source, "source_peer": source_peer, "stage_checkpoint": None,
            "version": version, "run": run.to_dict(), "run_id": "run-tied", "signal_url": "ws://127.0.0.1:9/s"}


def test_a_stage_whose_other_end_never_sends_the_tied_gradient_steps_two_peer_waits_after_apply(tmp_path):
    """The head's node never applies (silent): the embedding's node waits for its tied gradient
    until two of ``apply``'s ``peer_wait_s`` have passed, not its own 120 s, and steps on its own
    gradient (``tied_missing``), in time for the coordinator's step deadline."""
    import time

    model_dir = write_tiny_tied_llama(tmp_path / "tiny", num_layers=4)
    run = RunConfig(activation_encoding="fp32")
    wire = MemoryWire()
    nodes: list[Node] = []
    took: list[float] = []

    async def scenario():
        first, last = await _two_ready_stages(wire, model_dir, run, nodes)
        route = [P0, P1]
        _send(first, {"type": "train_in", "step": 0, "mb": 0, "route": route, "inputs": INPUTS})
        _send(last, {"type": "train_out", "step": 0, "mb": 0, "route": route, "targets": TARGETS,
                     "mask": MASK, "behaviour": [[-1.0] * 5] * 2, "advantages": ADVANTAGES, "normaliser": 6.0})
        await _until("mb_done", lambda: _sent(first, messages.MbDone))
        started = time.monotonic()
        _send(first, {"type": "apply", "step": 0, "version": 1, "replicas": [P0], "checkpoint": False,
                      "peer_wait_s": 0.25})
        await _until("stepped", lambda: _sent(first, messages.Stepped))
        took.append(time.monotonic() - started)
        assert first.ctx.counters.get("tied_missing", 0) == 1

    _run(scenario, nodes)
    assert 0.5 <= took[0] < 3.0, took
