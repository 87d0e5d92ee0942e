"""Bandwidth-aware placement: a node on a slow uplink serves where it uploads least."""

import pytest

from engine.model.config import ModelConfig
from engine.paths import base_checkpoint_dir
from engine.swarm.assignment import Assignment, NodeSlot, assign_new_node
from engine.swarm.bandwidth_placement import BandwidthPlacement, UplinkBook, seconds_per_version
from engine.swarm.membership import Membership, NodeSession
from engine.swarm.run_config import RunConfig
from engine.swarm.stage_traffic import stage_traffic

TINY = ModelConfig.from_file(base_checkpoint_dir() / "config.json")
HOME_MBPS, METRO_MBPS = 10.0, 200.0
VERSION_S = 0.5  # budget: a quarter of it


def _placement() -> BandwidthPlacement:
    return BandwidthPlacement(stage_traffic(RunConfig(), TINY, [1, 1], prompt_tokens=10))


def test_a_measurement_replaces_a_claim_and_the_floor_only_rises():
    book = UplinkBook()
    book.claim("a", 10.0)
    assert book.get("a").rate_bytes_s == pytest.approx(10e6 / 8) and not book.get("a").measured
    book.observe("a", 40.0, 20.0)
    book.claim("a", 10.0)
    book.observe("a", 0.0, 5.0)  # nothing pushed this time: the measurement stands
    assert book.get("a").rate_bytes_s == pytest.approx(40e6 / 8) and book.get("a").floor_bytes_s == 20e6 / 8
    assert book.get("unknown").rate_bytes_s is None


def test_the_last_stage_is_where_a_slow_uplink_uploads_least():
    placement = _placement()
    placement.uplinks.observe("home", HOME_MBPS, HOME_MBPS)
    first, last = placement.upload_s("home", 0, 2), placement.upload_s("home", 1, 2)
    assert last < 0.6 * first
    assert placement.binds("home", 0, 2, VERSION_S) and not placement.binds("home", 1, 2, VERSION_S)
    placement.uplinks.observe("metro", METRO_MBPS, METRO_MBPS)
    assert not placement.binds("metro", 0, 2, VERSION_S)


def test_a_joining_trainer_on_a_known_slow_uplink_takes_the_last_stage_when_both_are_served():
    a = Assignment(stage_layers=[1, 1])
    for peer in ("m0", "m1"):
        assign_new_node(a, NodeSlot(peer))
    placement = _placement()
    placement.uplinks.claim("home", HOME_MBPS)

    def prefer(choice, candidates, trainers):
        return placement.join_stage("home", choice, candidates, trainers, VERSION_S)
    assert assign_new_node(a, NodeSlot("home"), prefer=prefer) == 1  # the compute rules said stage 0
    placement.uplinks.claim("fast", METRO_MBPS)
    assert assign_new_node(a, NodeSlot("fast"), prefer=lambda c, cs, t: placement.join_stage(
        "fast", c, cs, t, VERSION_S)) == 0  # unbound: the compute rules stand


def test_a_stage_without_a_trainer_is_filled_first_even_by_a_slow_node():
    a = Assignment(stage_layers=[1, 1])
    assign_new_node(a, NodeSlot("m1"))  # stage 0
    placement = _placement()
    placement.uplinks.claim("home", HOME_MBPS)
    assert assign_new_node(a, NodeSlot("home"), prefer=lambda c, cs, t: placement.join_stage(
        "home", c, cs, t, VERSION_S)) == 1
    b = Assignment(stage_layers=[1, 1])
    assign_new_node(b, NodeSlot("m0"))
    assign_new_node(b, NodeSlot("m1"))
    b.nodes.pop("m1")  # stage 1 lost its trainer
    assert assign_new_node(b, NodeSlot("new"), prefer=lambda c, cs, t: 0) == 1  # coverage before preference


def test_routes_pair_nodes_whose_uplinks_bind_with_each_other():
    members = Membership(2)
    for peer, stage in (("a0", 0), ("a1", 0), ("b0", 1), ("b1", 1)):
        members.sessions[peer] = NodeSession(peer, None, "torch", "cpu", stage=stage, ready=True)
    assert members.routes() == [["a0", "b0"], ["a1", "b1"]]
    slow = {"a0", "b1"}
    members.route_key = lambda peer, stage, n: peer in slow
    assert members.routes() == [["a1", "b0"], ["a0", "b1"]]  # one slow route, one fast one


def test_seconds_per_version_from_the_recent_versions():
    versions = [{"version": v, "created_at": 100.0 + 0.5 * v} for v in range(30)]
    assert seconds_per_version(versions) == pytest.approx(0.5)
    assert seconds_per_version(versions[:1]) is None


def test_a_node_remembers_its_measured_uplink_for_a_day_for_its_next_hello(tmp_path, monkeypatch):
    import time

    from engine.swarm import node_status

    assert node_status.remembered_uplink(tmp_path) is None
    node_status.remember_uplink(tmp_path / "data", 9.5)
    assert node_status.remembered_uplink(tmp_path / "data") == 9.5
    later = time.time() + node_status.UPLINK_MEMORY_S + 1
    monkeypatch.setattr(node_status.time, "time", lambda: later)
    assert node_status.remembered_uplink(tmp_path / "data") is None  # the machine may be elsewhere now
    (tmp_path / "data" / node_status.UPLINK_FILE).write_text("not json")
    assert node_status.remembered_uplink(tmp_path / "data") is None


def test_the_coordinator_places_a_hello_claiming_a_slow_uplink_on_the_last_stage_even_when_it_asks_for_its_old_one(
        tmp_path):
    import asyncio

    from engine.swarm.coordinator import Coordinator, CoordinatorConfig
    from tests.support.hostile_node import join

    async def main():
        c = Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                          num_stages=2, port=0))
        url = await c.start()
        links = []
        try:
            for _ in range(2):  # the compute rules fill stage 0, then stage 1
                links.append(await join(url, local_host=f"127.0.0.{len(links) + 2}"))
            # the compute rules would put a third node on stage 0; this one asks for it too, as a rejoin, and
            # its 5 Mbit/s would take 0.39 s of a version there (no version measured yet: a second, budget 0.25 s)
            links.append(await join(url, local_host="127.0.0.9", uplink_mbps=5.0, stage=0, num_stages=2,
                                    run_id=c.run_id))
            stats = c.stats()
            return [link.reply.get("stage") for link in links], stats["bandwidth"]
        finally:
            for link in links:
                await link.close()
            await c.stop()
    stages, bandwidth = asyncio.run(main())
    assert stages == [0, 1, 1]
    assert bandwidth["placed_by_uplink"] == 1 and bandwidth["budget_s"] > 0
    assert [s["stage"] for s in bandwidth["bytes_per_version"]] == [0, 1]
