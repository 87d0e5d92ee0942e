"""Bandwidth-aware placement: a node on a slow uplink serves where it uploads least."""

import pytest

from engine.model.config import ModelConfig
from engine.paths import base_checkpoint_dir
from engine.swarm.assignment import Assignment, NodeSlot, assign_new_node
from engine.swarm.bandwidth_placement import (
    MOVE_INTERVAL_S,
    NODE_MOVE_COOLDOWN_S,
    BandwidthPlacement,
    Move,
    UplinkBook,
    seconds_per_version,
)
from engine.swarm.membership import Membership, NodeSession
from engine.swarm.run_config import RunConfig
from engine.swarm.stage_traffic import stage_traffic

TINY = ModelConfig.from_file(base_checkpoint_dir() / "config.json")
HOME_MBPS, METRO_MBPS = 10.0, 200.0
VERSION_S = 0.5  # budget: a quarter of it


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _placement(clock=None) -> BandwidthPlacement:
    traffic = stage_traffic(RunConfig(), TINY, [1, 1], prompt_tokens=10)
    return BandwidthPlacement(traffic, clock=clock or Clock())


def _fits(peer, stage):
    return True


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


def _two_by_two(placement, home_stage=0):
    stages = [["home", "m0"], ["m1", "m2"]] if home_stage == 0 else [["m0", "m1"], ["home", "m2"]]
    placement.uplinks.observe("home", HOME_MBPS, HOME_MBPS)
    for peer in ("m0", "m1", "m2"):
        placement.uplinks.observe(peer, METRO_MBPS, METRO_MBPS)
    return stages


def test_a_measured_slow_trainer_on_the_heavy_stage_swaps_with_a_fast_one_of_the_light_stage():
    clock = Clock()
    placement = _placement(clock)
    stages = _two_by_two(placement)
    assert placement.propose_move(stages, _fits, VERSION_S) is None  # too early: the nodes have just started
    clock.now = MOVE_INTERVAL_S
    move = placement.propose_move(stages, _fits, VERSION_S)
    assert move == Move("home", 0, 1, partner="m1")
    placement.moved(move)
    swapped = [["m1", "m0"], ["home", "m2"]]
    clock.now += MOVE_INTERVAL_S
    assert placement.propose_move(swapped, _fits, VERSION_S) is None  # where it belongs now
    clock.now += NODE_MOVE_COOLDOWN_S
    assert placement.propose_move(swapped, _fits, VERSION_S) is None  # and it stays there


def _due(placement: BandwidthPlacement, clock: Clock) -> BandwidthPlacement:
    clock.now += MOVE_INTERVAL_S
    placement._last_check = -1e9
    return placement


def test_no_move_on_a_claim_a_fast_enough_uplink_or_a_slow_swarm():
    clock = Clock()
    placement = _placement(clock)
    stages = _two_by_two(placement)
    placement.uplinks._uplinks["home"].measured = False  # only the hello's word for it
    assert _due(placement, clock).propose_move(stages, _fits, VERSION_S) is None
    placement.uplinks._uplinks["home"].measured = True
    assert _due(placement, clock).propose_move(stages, _fits, version_s=5.0) is None  # 0.2 s of a 5 s version
    assert _due(placement, clock).propose_move([["home"], ["m1"]], _fits, VERSION_S) is None  # nobody would
    # keep stage 0's weights (a mover fetches its new stage from a trainer that stays)
    assert _due(placement, clock).propose_move(stages, _fits, VERSION_S) is not None


def test_a_slow_node_with_a_second_replica_beside_it_moves_alone_to_join_the_light_stage():
    clock = Clock()
    placement = _placement(clock)
    placement.uplinks.observe("home", HOME_MBPS, HOME_MBPS)
    placement.uplinks.observe("m0", METRO_MBPS, METRO_MBPS)
    placement.uplinks.observe("m1", METRO_MBPS, METRO_MBPS)
    assert _due(placement, clock).propose_move([["home", "m0"], ["m1"]], _fits, VERSION_S) == Move("home", 0, 1)


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


def test_the_slowest_binding_node_moves_first_and_only_with_a_partner_twice_as_fast():
    clock = Clock()
    placement = _placement(clock)
    placement.uplinks.observe("home", HOME_MBPS, HOME_MBPS)
    placement.uplinks.observe("m0", METRO_MBPS, METRO_MBPS)
    placement.uplinks.observe("near", 1.5 * HOME_MBPS, 1.5 * HOME_MBPS)  # not fast enough to trade places
    placement.uplinks.observe("m2", METRO_MBPS, METRO_MBPS)
    stages = [["home", "m0"], ["near", "m2"]]
    assert _due(placement, clock).propose_move(stages, _fits, VERSION_S) == Move("home", 0, 1, partner="m2")
    placement.uplinks.observe("stuck", 2.0, 2.0)
    assert _due(placement, clock).propose_move([["home", "stuck"], ["near", "m2"]], _fits,
                                               VERSION_S).peer == "stuck"
