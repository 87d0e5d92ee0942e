"""A trainer on links far slower than the swarm's serves generation only, and trains again when its
stage needs it (issue 15 point 5): the policy of ``engine.swarm.link_roles`` and the coordinator's moves."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.paths import base_checkpoint_dir
from engine.swarm.assignment import NodeSlot
from engine.swarm.coordinator import Coordinator, CoordinatorConfig, NodeSession
from engine.swarm.link_roles import MIN_EXCESS_S, node_rtt_s, slow_link_trainers, typical_rtt_s


def _links(rtt_ms: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    return {k: v / 1e3 for k, v in rtt_ms.items()}


def _mesh(slow_ms: dict[str, float], peers: list[str], base_ms: float = 20.0) -> dict[tuple[str, str], float]:
    """Every pair linked, both ends reporting; a link's round trip is ``base_ms`` plus each end's extra."""
    return _links({(a, b): base_ms + slow_ms.get(a, 0.0) + slow_ms.get(b, 0.0)
                   for a in peers for b in peers if a != b})


def test_a_nodes_round_trip_is_the_median_of_its_links_each_the_smaller_of_both_ends():
    reported = _links({("a", "b"): 20, ("a", "c"): 30, ("a", "d"): 200,
                       ("b", "a"): 10, ("c", "a"): 900})  # c says its link to a is slow: a's own 30 ms stands
    assert node_rtt_s("a", reported) == pytest.approx(0.030)  # median of 10, 30 (not c's 900), 200
    assert node_rtt_s("b", reported) is None  # one link only: not judged yet
    assert node_rtt_s("a", reported, without="d") == pytest.approx(0.020)  # median of 10, 30
    assert typical_rtt_s("d", ["a", "b", "c", "d"], reported) == pytest.approx(0.020)  # a 20, b 10, c 30 (not 900)
    assert typical_rtt_s("a", ["a", "b", "c"], reported) is None  # nobody has a link but to a


def test_the_trainer_on_a_far_slower_link_moves_never_the_last_or_fastest_of_its_stage():
    peers = ["a0", "a1", "b0", "b1", "c0"]
    moves = slow_link_trainers([["a0", "a1"], ["b0", "b1"], ["c0"]], _mesh({"b1": 70.0, "c0": 280.0}, peers))
    assert set(moves) == {"b1"} and "90 ms" in moves["b1"]  # c0 is its stage's only trainer: it stays
    both = _mesh({"b0": 180.0, "b1": 280.0}, ["a0", "a1", "b0", "b1", "c0", "c1"])
    assert set(slow_link_trainers([["a0", "a1"], ["b0", "b1"], ["c0", "c1"]], both)) == {"b1"}  # b0 stays
    alike = _mesh({"a1": 15.0, "b1": 8.0}, peers[:4])
    assert slow_link_trainers([["a0", "a1"], ["b0", "b1"]], alike) == {}
    loopback = _mesh({"a1": 1e3 * MIN_EXCESS_S / 2}, peers[:4], base_ms=1.0)  # 26x but 25 ms more: stays
    assert slow_link_trainers([["a0", "a1"], ["b0", "b1"]], loopback) == {}
    alone = _links({("b1", "a0"): 500, ("b1", "b0"): 500})  # nobody else measured
    assert slow_link_trainers([["a0", "a1"], ["b0", "b1"]], alone) == {}


def test_a_slow_node_is_judged_against_the_links_it_is_not_on():
    """A peer with two links, one of them to the slow node, has a median of their mean: judged against
    per-node medians the slow node looked only 2x slower and kept training (seen over ``home``)."""
    reported = _mesh({"h": 70.0}, ["a0", "a1", "b0", "h"])
    for a, b in (("a0", "a1"), ("a1", "a0")):  # a0-a1 never linked (no replica traffic yet)
        del reported[(a, b)]
    assert set(slow_link_trainers([["a0", "a1"], ["b0", "h"]], reported)) == {"h"}


def test_a_liar_reporting_slow_links_to_an_honest_trainer_does_not_move_it():
    reported = _mesh({}, ["h", "x", "y", "liar"])
    reported.update(_links({("liar", p): 5000 for p in ("h", "x", "y")}))
    moves = slow_link_trainers([["h", "x"], ["y", "liar"]], reported)
    assert moves == {}  # h's own figures stand; the honest ends' bound the liar's too


class FakeWs:
    def __init__(self, peer: str, outbox: list) -> None:
        self.peer, self.outbox, self.closed = peer, outbox, False

    async def send_str(self, text: str) -> None:
        self.outbox.append((self.peer, json.loads(text)))

    async def close(self) -> None:
        self.closed = True


@pytest.fixture()
def coordinator(tmp_path):
    c = Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                      num_stages=2))
    c.outbox = []
    for peer, stage in (("a0", 0), ("a1", 0), ("b0", 1), ("b1", 1)):
        c.sessions[peer] = NodeSession(peer, FakeWs(peer, c.outbox), "torch", "cpu", stage=stage, ready=True)
        slot = c.assignment.nodes[peer] = NodeSlot(peer)
        slot.stage = stage
    for peer in c.sessions:  # b1's links are 90 ms, every other link 20 ms
        c.generation.pacer.observe(peer, 0.0, 0.0, {other: 90.0 if "b1" in (peer, other) else 20.0
                                                    for other in c.sessions if other != peer})
    yield c
    c.store.close()


def _sent(c, kind: str) -> list[tuple[str, dict]]:
    return [(peer, m) for peer, m in c.outbox if m["type"] == kind]


def test_the_coordinator_moves_the_slow_trainer_to_generation_only_and_back_when_its_stage_needs_it(coordinator):
    c = coordinator
    asyncio.run(c._review_roles())
    [(peer, welcome)] = _sent(c, "welcome")
    assert peer == "b1" and welcome["role"] == "inference" and "90 ms" in welcome["role_reason"]
    assert welcome["source"] == "peer" and welcome["source_peer"] == "b0"  # the stage leader streams to it
    assert c.sessions["b1"].role == c.assignment.nodes["b1"].role == "inference" and not c.sessions["b1"].ready
    assert c.book.counters["moved_to_inference"] == 1
    assert _sent(c, "members")[-1][1]["inference"] == ["b1"]
    c.sessions["b1"].ready = True  # it reloaded as an inference replica
    assert all("b1" not in r for r in c.members.routes()) and ["a1", "b1"] in c.members.gen_routes()
    c.outbox.clear()
    asyncio.run(c._review_roles())
    assert _sent(c, "welcome") == []  # moved once: b0, now stage 1's only trainer, stays
    asyncio.run(c._node_left(c.sessions["b0"]))  # stage 1 has no trainer left: b1 trains again, on its weights
    [(peer, welcome)] = _sent(c, "welcome")  # (rather than a0 or a1 moved over from stage 0)
    assert peer == "b1" and welcome["role"] == "trainer" and welcome["source"] == "keep"
    assert c.sessions["b1"].role == "trainer" and c.book.counters["moved_to_trainer"] == 1
    assert c.assignment.replicas() == [["a0", "a1"], ["b1"]]


def test_an_inference_only_node_is_never_made_to_train(coordinator):
    c = coordinator
    c.sessions["i1"] = NodeSession("i1", FakeWs("i1", c.outbox), "torch", "cpu", stage=1, ready=True,
                                   role="inference", offered_role="inference")
    slot = c.assignment.nodes["i1"] = NodeSlot("i1", role="inference")
    slot.stage = 1
    asyncio.run(c._node_left(c.sessions["b1"]))
    asyncio.run(c._node_left(c.sessions["b0"]))
    assert c.sessions["i1"].role == "inference"
    assert not any(peer == "i1" and m.get("role") == "trainer" for peer, m in _sent(c, "welcome"))
