"""A running generation job that the coordinator cancels (its hedge won elsewhere) stops on every stage.

Two real torch nodes of the tiny tied Llama wired in memory; the job's stop id is outside the
vocabulary, so only the cancel (or its token budget, far away) can end it.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from engine.swarm import messages
from engine.swarm.node import Node, NodeConfig
from engine.swarm.run_config import RunConfig
from tests.support.memory_wire import MemoryWire
from tests.support.tiny_tied_llama import write_tiny_tied_llama
from tests.unit.test_multi_turn_swarm_episode import P0, P1, _ToScheduler, _welcome_two_stages
from tests.unit.test_node_pipeline import _run, _until

pytest.importorskip("torch")


def test_a_cancelled_job_stops_decoding_frees_its_caches_and_never_reports_a_result(tmp_path):
    model_dir = write_tiny_tied_llama(tmp_path / "tiny", num_layers=4)
    run = RunConfig(activation_encoding="fp32")
    wire, box, nodes = MemoryWire(), {}, {}
    for peer in (P0, P1):
        node = Node(NodeConfig("http://127.0.0.1:9", backend="torch", device="cpu", base_checkpoint=str(model_dir)),
                    SimpleNamespace(peer_id=peer), peers=wire.sender(peer), coordinator=_ToScheduler(peer, box))
        wire.attach(peer, node.on_peer)
        nodes[peer] = node
    box["scheduler"] = SimpleNamespace(on_gen_done=lambda *a: None, on_job_failed=lambda *a: None)

    def caches(node: Node) -> dict:
        return node.ctx.stage.rt._b()._caches

    async def scenario():
        await _welcome_two_stages(nodes, run, "run-cancel")
        await _until("ready", lambda: all(n.ctx.coordinator.of_type(messages.Ready) for n in nodes.values()))
        params = {"max_new_tokens": 4000, "temperature": 1.0, "top_p": 1.0, "seed": 1, "stop_ids": [1 << 20]}
        nodes[P0].on_coordinator(messages.decode_from_coordinator(json.dumps(
            {"type": "gen", "job": "t7", "route": [P0, P1], "prompt_ids": [[5, 6], [7, 8]], "params": params})))
        await _until("decoding", lambda: nodes[P1].generation._last.get("t7") is not None
                     and nodes[P1].generation._last["t7"].steps >= 5)
        nodes[P0].on_coordinator(messages.decode_from_coordinator(messages.encode(
            messages.GenRelease(job="t7", route=[P0, P1], cancel=True))))
        await _until("stopped on both stages", lambda: "t7" not in nodes[P0].generation._first
                     and "t7" not in nodes[P1].generation._last)
        steps = nodes[P1].ctx.counters["gen_steps"]
        await asyncio.sleep(0.5)
        assert nodes[P1].ctx.counters["gen_steps"] <= steps + 2  # at most the steps already under way
        await _until("caches freed", lambda: "t7" not in caches(nodes[P0]) and "t7" not in caches(nodes[P1]))
        assert not any(n.ctx.coordinator.of_type(messages.GenDone) for n in nodes.values())

    _run(scenario, list(nodes.values()))
