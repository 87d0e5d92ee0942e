"""Real nodes (torch stages on the CPU, the shipped base checkpoint) wired in memory, no WebRTC.

The node's composition end to end: welcome and loading, dispatch on message types,
route checks, generation through two stages, a training micro-batch forward and
backward, the optimiser step, and a fresh node loading its stage from a replica.
Only the links are in memory (``tests.support.memory_wire``); messages cross msgpack
and the schemas exactly as on a link or the coordinator's websocket.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from engine.paths import base_checkpoint_dir
from engine.swarm import messages
from engine.swarm.node import Node, NodeConfig
from engine.swarm.run_config import RunConfig
from tests.support.memory_wire import MemoryWire, RecordingCoordinator

pytest.importorskip("torch")

P0, P1, P2 = "peer0000", "peer1111", "peer2222"
PARAMS = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "seed": 7, "stop_ids": [2]}


def _node(peer_id: str, wire: MemoryWire) -> Node:
    node = Node(NodeConfig("http://127.0.0.1:9", backend="torch", device="cpu",
                           base_checkpoint=str(base_checkpoint_dir())),
                SimpleNamespace(peer_id=peer_id), peers=wire.sender(peer_id), coordinator=RecordingCoordinator())
    wire.attach(peer_id, node.on_peer)
    return node


def _welcome(stage: int, source: str = "checkpoint", source_peer: str | None = None) -> dict:
    return {"type": "welcome", "stage": stage, "num_stages": 2, "layer_start": stage, "layer_end": stage + 1,
            "num_layers": 2, "source": source, "source_peer": source_peer, "stage_checkpoint": None,
            "version": 0, "run": RunConfig().to_dict(), "run_id": "run-test", "signal_url": "ws://127.0.0.1:9/s"}


def _send(node: Node, message: dict) -> None:
    """As the coordinator's websocket delivers it: JSON text, decoded into its typed message."""
    node.on_coordinator(messages.decode_from_coordinator(json.dumps(message)))


async def _until(what: str, check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)
    return result


def _sent(node: Node, kind: type) -> list:
    return node.ctx.coordinator.of_type(kind)


async def _two_stages(wire: MemoryWire, nodes: list[Node], *, exact: bool = False) -> tuple[Node, Node]:
    """Stage 0 on P0 and stage 1 on P1, loaded and ready (``exact``: fp32 activations between them:
    int8 rows round a batch's float noise, which comparisons of two runs must not see)."""
    first, last = _node(P0, wire), _node(P1, wire)
    nodes.extend([first, last])
    for node in (first, last):
        await node.start_compute()
        _send(node, {"type": "members", "stages": [[P0], [P1]], "version": 0})
    for stage, node in enumerate((first, last)):
        welcome = _welcome(stage)
        if exact:
            welcome["run"]["activation_encoding"] = "fp32"
        _send(node, welcome)
    await _until("both stages ready", lambda: _sent(first, messages.Ready) and _sent(last, messages.Ready))
    return first, last


def _recording_acts(wire: MemoryWire) -> list[messages.Act]:
    """Every ``Act`` the wire carries from now on, in order."""
    acts: list[messages.Act] = []

    def watch(src, dst, header, payload):
        if isinstance(header, messages.Act):
            acts.append(header)
        return header, payload

    wire.mangle = watch
    return acts


def _run(scenario, nodes: list[Node]) -> None:
    async def bounded():
        try:
            await asyncio.wait_for(scenario(), 120)
        finally:
            for node in nodes:
                await node.shutdown()
    asyncio.run(bounded())


def test_two_real_stages_generate_train_step_and_a_fresh_replica_loads_from_a_peer():
    wire = MemoryWire()
    nodes: list[Node] = []

    async def scenario():
        first, last, fresh = _node(P0, wire), _node(P1, wire), _node(P2, wire)
        nodes.extend([first, last, fresh])
        for node in nodes:
            await node.start_compute()
            _send(node, {"type": "members", "stages": [[P0, P2], [P1]], "version": 0})
        _send(first, _welcome(0))
        _send(last, _welcome(1))
        await _until("both stages ready", lambda: _sent(first, messages.Ready) and _sent(last, messages.Ready))

        # generation: stage 0 embeds, stage 1 samples and reports; tokens go back to stage 0
        route = [P0, P1]
        _send(first, {"type": "gen", "job": "g1", "route": route, "prompt_ids": [[1, 5, 6], [1, 7, 8]],
                      "params": PARAMS})
        done = (await _until("gen_done", lambda: _sent(last, messages.GenDone)))[0]
        assert len(done.tokens) == 2 and all(1 <= len(t) <= PARAMS["max_new_tokens"] for t in done.tokens)
        assert done.versions == [0, 0] and first.ctx.counters["tokens_generated"] > 0

        # one training micro-batch: forward through both stages, loss on the last, backward to stage 0
        inputs = [[1, 5, 6, 9], [1, 7, 8, 10]]
        targets = [[5, 6, 9, 2], [7, 8, 10, 2]]
        _send(first, {"type": "train_in", "step": 0, "mb": 0, "route": route, "inputs": inputs})
        _send(last, {"type": "train_out", "step": 0, "mb": 0, "route": route, "targets": targets,
                     "mask": [[False, True, True, True]] * 2, "behaviour": [[-1.0] * 4] * 2,
                     "advantages": [1.0, -1.0], "normaliser": 6.0})
        loss = (await _until("mb_loss", lambda: _sent(last, messages.MbLoss)))[0]
        assert loss.tokens == 6
        await _until("mb_done", lambda: _sent(first, messages.MbDone))

        # the step: each stage (one replica each) applies and reports a new version
        for node, trainers in ((first, [P0]), (last, [P1])):
            _send(node, {"type": "apply", "step": 0, "version": 1, "replicas": trainers, "checkpoint": False})
        for node in (first, last):
            stepped = (await _until("stepped", lambda n=node: _sent(n, messages.Stepped)))[0]
            assert stepped.version == 1 and stepped.grad_norm > 0 and node.rt.version == 1

        # an activation from a peer the route does not name: refused, a strike against the sender
        assert not wire.strikes[(P1, P2)]
        await wire.send(P2, P1, messages.Drop(job="g1", route=route, hop=1))
        assert "the route says" in wire.strikes[(P1, P2)][0]

        # a fresh node joins stage 0 and loads it from the replica that holds it
        _send(fresh, _welcome(0, source="peer", source_peer=P0))
        ready = (await _until("the fresh replica ready", lambda: _sent(fresh, messages.Ready)))[0]
        assert ready == messages.Ready(stage=0, version=1)
        checksums = [await n.compute.run(n.rt.checksum) for n in (first, fresh)]
        assert checksums[0] == checksums[1]

    _run(scenario, nodes)


def test_the_samples_of_a_prompt_share_one_prefill_and_decode_as_distinct_rows_do():
    """A job whose rows repeat prompts sends each distinct prompt's activations once (``Act.expand``),
    every stage expands its cache, and greedy decoding gives each row what a job of the distinct
    prompts gives; an upstream that sends ``expand`` on a step that continues a cache is struck."""
    wire = MemoryWire()
    nodes: list[Node] = []
    acts = _recording_acts(wire)

    async def scenario():
        first, last = await _two_stages(wire, nodes)
        greedy = {**PARAMS, "temperature": 0.0, "max_new_tokens": 6}
        a, b = [1, 21, 19, 24, 15, 6, 7, 8, 9, 16], [1, 21, 19, 24, 15, 14, 5, 12, 6, 16]  # rev:1234= rev:9071=
        _send(first, {"type": "gen", "job": "distinct", "route": [P0, P1], "prompt_ids": [a, b], "params": greedy})
        plain = (await _until("the distinct job", lambda: _sent(last, messages.GenDone)))[0]
        assert acts[0].expand is None and acts[0].tensor["shape"][0] == 2
        acts.clear()
        _send(first, {"type": "gen", "job": "shared", "route": [P0, P1], "prompt_ids": [b, a, a, b, a],
                      "params": greedy})
        shared = (await _until("the shared job", lambda: _sent(last, messages.GenDone)[1:]))[0]
        assert acts[0].expand == [1, 0, 0, 1, 0] and acts[0].tensor["shape"][0] == 2  # two prompts computed
        assert len(acts) > 1 and all(act.expand is None and act.tensor["shape"][0] == 5 for act in acts[1:])
        assert shared.tokens == [plain.tokens[i] for i in (1, 0, 0, 1, 0)]

        # a hostile upstream: expand on a decoding step, or naming rows the tensor lacks
        def forge(src, dst, header, payload):
            if isinstance(header, messages.Act) and header.job == "forged" and header.tensor["shape"][1] == 1:
                header = msgspec.structs.replace(header, expand=[0] * header.tensor["shape"][0])
            return header, payload

        wire.mangle = forge
        _send(first, {"type": "gen", "job": "forged", "route": [P0, P1], "prompt_ids": [a, b], "params": greedy})
        await _until("a strike", lambda: wire.strikes[(P1, P0)])
        assert "continues a cache" in wire.strikes[(P1, P0)][0]
        with pytest.raises(Exception, match="rows the activations do not have"):
            last.generation._expand(messages.Act(kind="gen", job="x", route=[P0, P1], hop=1, versions=[0],
                                                 tensor=acts[0].tensor, step=0, mb=0,
                                                 params=messages.GenParams(**greedy), expand=[0, 2]),
                                    np.zeros((2, 10, 64), np.float32))

    _run(scenario, nodes)


def test_rows_that_finished_leave_every_stages_cache_and_the_job_samples_what_it_would_have(monkeypatch):
    """Sampled rows end at different steps; once enough have, every stage drops them (``Tok.keep`` /
    ``Act.keep``) and the job's tokens and log-probs are those of a run that decodes every row."""
    from engine.rl import rollout

    def run(drop_share: float) -> tuple[messages.GenDone, list[messages.Act]]:
        monkeypatch.setattr(rollout, "DROP_FINISHED_SHARE", drop_share)
        wire, nodes = MemoryWire(), []
        acts = _recording_acts(wire)
        result = []

        async def scenario():
            first, last = await _two_stages(wire, nodes, exact=True)
            prompt = [1, 21, 19, 24, 15, 6, 7, 8, 9, 16]
            _send(first, {"type": "gen", "job": "g", "route": [P0, P1], "prompt_ids": [prompt] * 12,
                          "params": {**PARAMS, "temperature": 1.5, "max_new_tokens": 10, "seed": 11}})
            result.append((await _until("gen_done", lambda: _sent(last, messages.GenDone)))[0])

        _run(scenario, nodes)
        return result[0], acts

    dropping, dropping_acts = run(0.01)
    keeping, keeping_acts = run(2.0)
    assert len({len(t) for t in keeping.tokens}) > 1  # rows did end at different steps
    assert any(a.keep for a in dropping_acts) and not any(a.keep for a in keeping_acts)
    rows_sent = [a.tensor["shape"][0] for a in dropping_acts[1:]]
    assert rows_sent == sorted(rows_sent, reverse=True) and rows_sent[-1] < 12
    assert dropping.tokens == keeping.tokens
    for a, b in zip(dropping.logprobs, keeping.logprobs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_a_packed_micro_batch_trains_as_its_plain_rows_do():
    """One group's rows as plain rows, then packed (its prompt once, ``segments``): the last stage
    reports the same loss and token count, and stage 0 finishes the backward of both."""
    wire = MemoryWire()
    nodes: list[Node] = []

    async def scenario():
        first, last = await _two_stages(wire, nodes, exact=True)
        route = [P0, P1]
        plain = {"inputs": [[1, 5, 6, 9, 0], [1, 5, 6, 10, 11]], "targets": [[5, 6, 9, 2, 0], [5, 6, 10, 11, 2]],
                 "mask": [[False, False, True, True, False], [False, False, True, True, True]],
                 "behaviour": [[0.0, 0.0, -1.0, -2.0, 0.0], [0.0, 0.0, -1.5, -1.0, -3.0]]}
        packed = {"inputs": [[1, 5, 6, 9, 6, 10, 11]], "targets": [[5, 6, 9, 2, 10, 11, 2]],
                  "mask": [[False, False, True, True, True, True, True]],
                  "behaviour": [[0.0, 0.0, -1.0, -2.0, -1.5, -1.0, -3.0]]}
        _send(first, {"type": "train_in", "step": 0, "mb": 0, "route": route, "inputs": plain["inputs"]})
        _send(last, {"type": "train_out", "step": 0, "mb": 0, "route": route, "targets": plain["targets"],
                     "mask": plain["mask"], "behaviour": plain["behaviour"], "advantages": [1.0, -1.0],
                     "normaliser": 5.0, "proximal": plain["behaviour"]})
        _send(first, {"type": "train_in", "step": 0, "mb": 1, "route": route, "inputs": packed["inputs"],
                      "segments": [[2, 2, 3]]})
        _send(last, {"type": "train_out", "step": 0, "mb": 1, "route": route, "targets": packed["targets"],
                     "mask": packed["mask"], "behaviour": packed["behaviour"], "advantages": [],
                     "token_advantages": [[0.0, 0.0, 1.0, 1.0, -1.0, -1.0, -1.0]], "normaliser": 5.0,
                     "proximal": packed["behaviour"]})  # w = 1: the loss is the PPO term of the new log-probs
        losses = await _until("two mb_loss", lambda: len(_sent(last, messages.MbLoss)) == 2 and
                              _sent(last, messages.MbLoss))
        await _until("two mb_done", lambda: len(_sent(first, messages.MbDone)) == 2)
        by_mb = {m.mb: m for m in losses}
        assert by_mb[0].tokens == by_mb[1].tokens == 5
        assert by_mb[1].loss == pytest.approx(by_mb[0].loss, abs=1e-5) and by_mb[0].loss != 0.0
        assert by_mb[1].clipped_fraction == by_mb[0].clipped_fraction

    _run(scenario, nodes)
