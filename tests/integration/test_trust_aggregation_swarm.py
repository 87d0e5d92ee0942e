"""Issue 14, finding 6, over real processes and WebRTC: poisoned gradient shares neither steer nor break a stage.

One stage of three real torch replicas (``polis node``; gradient shares over WebRTC on 127.0.0.1),
all in the stage from its first update (``tests.support.gated_coordinator``: a replica that joins a
stage that has stepped lacks its siblings' AdamW moments, diverges and is evicted, which would
test the latecomer, not the attack). Groups train unpacked, one mini-batch per batch, so every
update has more rows than replicas and each replica trains some of them (``RouteWeights.split_rows``
gives every route a row while there are enough): the robust aggregate sees three shares each step.

* One hostile replica (``tests.support.hostile_node``, ``poisons_shares``) sends its share x10,
  sign-flipped x10 and as noise of 10x its norm, one attack per step in turn, and aggregates what
  it sent (so it steps exactly like its siblings, and the vote cannot single it out). Every update
  stays finite and identical on all three: the weight votes never split and evict nobody, training
  advances, and the leader's checkpoint is finite and holds the weights every replica voted for.
* Two colluders (``overflows_shares``) send 3e38 in every entry: the aggregate overflows fp32,
  every replica skips the update (``skipped_updates``), and the weights do not move (the step log's
  digest stays the same) while the versions go on.

What it leaves to ``polis bench trust`` and ``tests/unit/test_trust_aggregation.py``: held-out
accuracy against a clean run, and the aggregate's arithmetic.
"""

from __future__ import annotations

import logging
import math

import pytest

from engine.swarm.weight_votes import weights_digest
from tests.integration.swarm_harness import Swarm
from tests.support.gated_coordinator import gate
from tests.support.swarm_evidence import all_finite, base_stage_digest, ready_peers, stage_checkpoint, stage_steps

pytestmark = [pytest.mark.network, pytest.mark.slow]

log = logging.getLogger(__name__)

RUN = ["prompts_per_step=4", "group_size=4", "pack_groups=false", "updates_per_batch=1", "micro_batch_rows=16",
       "eval_every_versions=0", "generations_in_flight=2", "update_encoding=fp32", "checkpoint_every_versions=2"]
COORDINATOR = ["--step-timeout-s", "60"]
#: updates of the poisoned run: two rounds of the three attacks
POISONED_VERSIONS = 6
#: updates of the overflowing run
OVERFLOWED_VERSIONS = 4


def _swarm(tmp_path, versions: int, honest: list[str], hostile: dict[str, str]) -> Swarm:
    """A one-stage swarm that stops training at ``versions``, with every node started at once (the
    honest ones first: one of them is admitted first and leads) and ready; the coordinator trains only
    once all of them are (``gated_coordinator``)."""
    swarm = Swarm(tmp_path, stages=1, settings=[*RUN, f"max_versions={versions}"], coordinator_args=COORDINATOR,
                  coordinator_command=gate(len(honest) + len(hostile)))
    swarm.start_coordinator()
    for name in honest:
        swarm.start_node(name)
    for name, misbehaviour in hostile.items():
        swarm.start_node(name, misbehaviour=misbehaviour)
    ids = {swarm.peer_id(n) for n in [*honest, *hostile]}
    swarm.wait(lambda s: ready_peers(s) >= ids, timeout_s=180, what="every replica to be ready")
    return swarm


def _trained(swarm: Swarm, versions: int) -> tuple[dict, list[dict]]:
    """Stats once the run made ``versions`` updates and the leader checkpointed the last, and each update's
    figures (every one stepped by all three replicas, or the assertion says which was not)."""
    stats = swarm.wait(lambda s: s["version"] >= versions and len(stage_steps(s)) >= versions, timeout_s=240,
                       what=f"{versions} updates")
    steps = stage_steps(stats)
    assert [s["replicas"] for s in steps] == [3] * versions, steps  # nobody left, nobody joined late
    return stats, steps


def _leader_checkpoint(swarm: Swarm, stats: dict, version: int) -> dict:
    """The stage weights the leader (whoever it is) checkpointed at ``version``."""
    name = next(n for n in swarm.nodes if swarm.peer_id(n) == stats["stages"][0]["leader"])
    swarm.wait(lambda s: (stage_checkpoint(swarm.tmp / name) or (-1, None))[0] >= version, timeout_s=60,
               what=f"the leader {name} to checkpoint version {version}")
    held = stage_checkpoint(swarm.tmp / name)
    assert held is not None and held[0] == version, held
    return held[1]


def test_one_replica_sending_x10_sign_flipped_or_noise_shares_leaves_the_stage_finite_agreed_and_training(tmp_path):
    swarm = _swarm(tmp_path, POISONED_VERSIONS, ["h0", "h1"], {"poisoner": "poisons_shares"})
    try:
        stats, steps = _trained(swarm, POISONED_VERSIONS)
        votes = stats["weight_votes"]
        log.info("updates %s; votes %s; counters %s", steps, votes, stats["counters"])
        poisoned = (tmp_path / "poisoner.log").read_text(errors="replace")
        for attack in ("x10", "flip_x10", "noise"):  # every attack was sent, twice
            assert poisoned.count(f"poisoned its gradient share: {attack}") >= 2, attack
        assert all(math.isfinite(s["grad_norm"]) and not s["skipped"] and s["weights_hash"] for s in steps), steps
        assert steps[-1]["weights_hash"] != base_stage_digest(swarm.checkpoint)  # it trained
        assert votes.get("splits", 0) == 0 and votes.get("resyncs", 0) == 0 and votes.get("evicted", 0) == 0, votes
        assert {swarm.peer_id(n) for n in swarm.nodes} <= ready_peers(stats)
        # what the leader checkpointed last: finite, and exactly the weights all three voted for
        weights = _leader_checkpoint(swarm, stats, POISONED_VERSIONS)
        assert all_finite(weights) and weights_digest(weights) == steps[-1]["weights_hash"]
    finally:
        swarm.stop()


def test_two_colluders_sending_3e38_make_every_update_skip_and_the_weights_stay_as_they_were(tmp_path):
    swarm = _swarm(tmp_path, OVERFLOWED_VERSIONS, ["h0"], {"c1": "overflows_shares", "c2": "overflows_shares"})
    try:
        stats, steps = _trained(swarm, OVERFLOWED_VERSIONS)
        log.info("updates %s; votes %s; counters %s", steps, stats["weight_votes"], stats["counters"])
        base = base_stage_digest(swarm.checkpoint)
        assert all(s["skipped"] for s in steps) and stats["counters"].get("skipped_updates", 0) == len(steps), steps
        assert {s["weights_hash"] for s in steps} == {base}  # the weights never moved from the base
        assert swarm.log_has("h0", "step skipped, weights kept")
        assert stats["weight_votes"].get("splits", 0) == 0, stats["weight_votes"]
        assert swarm.peer_id("h0") in ready_peers(stats)
        weights = _leader_checkpoint(swarm, stats, OVERFLOWED_VERSIONS)
        assert all_finite(weights) and weights_digest(weights) == base
    finally:
        swarm.stop()
