"""Finding 5 of issue 14: routes are the coordinator's (signed tickets), not whatever a sender writes.

Real nodes (torch stages on the CPU, the shipped base checkpoint) wired in memory as in
``test_node_pipeline``; every ``gen`` / ``train_in`` / ``train_out`` is stamped by the coordinator's
real ``TicketIssuer``, and each node checks tickets with the coordinator's public key, as after a
real signed welcome. Two members attack (``tests.support.hostile_node``): one names itself stage 0
of a route to ``drop`` an honest generation job's KV cache at stage 1; one names itself stage 1 to
send stage 0 a ``grad`` for an honest micro-batch before the real one. Before tickets both passed the
route check (the sender *was* the neighbour of the route it wrote).
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from engine.net.errors import ProtocolViolation
from engine.net.identity import Identity
from engine.paths import base_checkpoint_dir
from engine.swarm import messages
from engine.swarm.node import Node, NodeConfig
from engine.swarm.run_config import RunConfig
from engine.swarm.tickets import TicketChecker, TicketIssuer
from tests.support.hostile_node import forged_drop, forged_grad
from tests.support.memory_wire import MemoryWire, RecordingCoordinator

pytest.importorskip("torch")

P0, P1, EVIL0, EVIL1 = "peer0000", "peer1111", "evil0000", "evil1111"  # EVIL0 on stage 0, EVIL1 on stage 1
ROUTE = [P0, P1]
PARAMS = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "seed": 7}


def _node(peer_id: str, wire: MemoryWire) -> Node:
    node = Node(NodeConfig("http://127.0.0.1:9", backend="torch", device="cpu",
                           base_checkpoint=str(base_checkpoint_dir())),
                SimpleNamespace(peer_id=peer_id), peers=wire.sender(peer_id), coordinator=RecordingCoordinator())
    wire.attach(peer_id, node.on_peer)
    return node


def _welcome(stage: int) -> dict:
    return {"type": "welcome", "stage": stage, "num_stages": 2, "layer_start": stage, "layer_end": stage + 1,
            "num_layers": 2, "source": "checkpoint", "source_peer": None, "stage_checkpoint": None,
            "version": 0, "run": RunConfig().to_dict(), "run_id": "run-test", "signal_url": "ws://127.0.0.1:9/s"}


async def _until(what: str, check, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)
    return result


def _run(attack: bool) -> dict:
    """Generate one job and train one micro-batch; with ``attack`` the two forgeries go in mid-flight."""
    wire, coordinator = MemoryWire(), Identity.generate()
    issuer, out = TicketIssuer(coordinator), {}

    def send(node: Node, message: dict) -> None:  # as the coordinator's websocket: JSON, stamped
        node.on_coordinator(issuer.stamp(messages.decode_from_coordinator(json.dumps(message))))

    async def scenario(first: Node, last: Node):
        for node in (first, last):
            await node.start_compute()
            send(node, {"type": "members", "stages": [[P0, EVIL0], [P1, EVIL1]], "version": 0})
            node.ctx.tickets = TicketChecker(coordinator.public_key)  # what the signed welcome gives
        send(first, _welcome(0))
        send(last, _welcome(1))
        await _until("both stages ready", lambda: first.ctx.coordinator.of_type(messages.Ready)
                     and last.ctx.coordinator.of_type(messages.Ready))
        loop, attacks = asyncio.get_running_loop(), []

        def strike_back(src, dst, header, payload):  # the attacks go in as soon as the honest job is in flight
            if attack and src == P0 and isinstance(header, messages.Act) and not attacks:
                if header.kind == "gen":
                    attacks.append(loop.create_task(wire.send(EVIL0, P1, forged_drop("g1", [EVIL0, P1]))))
                else:
                    g = forged_grad("0:0", [P0, EVIL1], step=0, mb=0, rows=2, tokens=4,
                                    hidden=first.rt.hidden_size)
                    attacks.append(loop.create_task(wire.send(EVIL1, P0, *g)))
            return header, payload
        wire.mangle = strike_back

        params = {**PARAMS, "stop_ids": [first.rt.vocab_size - 1]}  # all six tokens: six hops to attack
        send(first, {"type": "gen", "job": "g1", "route": ROUTE, "prompt_ids": [[1, 5, 6], [1, 7, 8]],
                     "params": params})
        out["tokens"] = (await _until("gen_done", lambda: last.ctx.coordinator.of_type(messages.GenDone)))[0].tokens
        await asyncio.gather(*attacks)
        attacks.clear()

        send(first, {"type": "train_in", "step": 0, "mb": 0, "route": ROUTE, "inputs": [[1, 5, 6, 9], [1, 7, 8, 10]]})
        send(last, {"type": "train_out", "step": 0, "mb": 0, "route": ROUTE, "targets": [[5, 6, 9, 2], [7, 8, 10, 2]],
                    "mask": [[False, True, True, True]] * 2, "behaviour": [[-1.0] * 4] * 2,
                    "advantages": [1.0, -1.0], "normaliser": 6.0})
        await _until("mb_done", lambda: first.ctx.coordinator.of_type(messages.MbDone))
        await asyncio.gather(*attacks)
        out["stage0_grads"] = await first.compute.run(first.rt.grads)
        out["strikes"] = {k: list(v) for k, v in wire.strikes.items()}
        out["failed"] = first.ctx.coordinator.of_type(messages.MbFailed) + last.ctx.coordinator.of_type(
            messages.JobFailed)
        out["refused"] = first.ctx.tickets.refused + last.ctx.tickets.refused

    async def bounded():
        wire_nodes = [_node(P0, wire), _node(P1, wire)]
        try:
            await asyncio.wait_for(scenario(*wire_nodes), 180)
        finally:
            for node in wire_nodes:
                await node.shutdown()
    asyncio.run(bounded())
    return out


def test_forged_grad_and_drop_from_members_are_refused_and_the_honest_job_is_bit_identical():
    clean, attacked = _run(attack=False), _run(attack=True)
    assert attacked["tokens"] == clean["tokens"] and all(len(row) == 6 for row in clean["tokens"])
    assert sorted(attacked["stage0_grads"]) == sorted(clean["stage0_grads"])
    for name, grad in clean["stage0_grads"].items():
        assert np.array_equal(attacked["stage0_grads"][name].view(np.uint32), grad.view(np.uint32)), name
    assert attacked["refused"] == 2 and clean["refused"] == 0 and not attacked["failed"]
    assert "without a ticket" in attacked["strikes"][(P1, EVIL0)][0]
    assert "without a ticket" in attacked["strikes"][(P0, EVIL1)][0]


def test_a_ticket_is_good_only_for_its_job_and_route_signed_by_the_coordinator_and_unexpired():
    coordinator, other = Identity.generate(), Identity.generate()
    now = [1_000_000.0]
    ticket = TicketIssuer(coordinator, ttl_s=60, clock=lambda: now[0]).issue("g1", ROUTE)
    checker = TicketChecker(coordinator.public_key, clock=lambda: now[0])
    checker.check("act", ticket, "g1", ROUTE)
    checker.check("act", ticket, "g1", ROUTE)  # cached: no second verification needed
    for kind, tk, job, route, why in (
            ("drop", ticket, "g2", ROUTE, "another job"),  # replayed for another job
            ("drop", ticket, "g1", [EVIL0, P1], "another job or route"),  # for a route it names itself in
            ("grad", TicketIssuer(other).issue("g1", ROUTE), "g1", ROUTE, "did not sign"),  # a member's own key
            ("grad", messages.Ticket(job="g1", route=ROUTE, expires_s=ticket.expires_s + 10_000,
                                     signature=ticket.signature), "g1", ROUTE, "did not sign")):  # extended
        with pytest.raises(ProtocolViolation, match=why):
            checker.check(kind, tk, job, route)
    now[0] += 60 + 301  # past its expiry and the allowed clock skew
    with pytest.raises(ProtocolViolation, match="expired"):
        checker.check("act", ticket, "g1", ROUTE)
    assert checker.refused == 5
