"""One node at a quarter of the others' speed costs the swarm no more than its share (issue 15 point 5).

Real processes on 127.0.0.1: a coordinator and four torch trainers, two stages x two replicas,
measured twice in one test: every node at full speed, then the same swarm with one node (on
whichever stage it was placed) throttled to 1/4 (``tests.support.throttled_node``: each compute
call is followed by a sleep of 3x its own time, which leaves the CPU to the others).

What "its share" means here. A pipeline runs at the pace of its slowest stage. The throttled
node is half of its stage's capacity; at 1/4 speed that stage keeps 1/2 + 1/2 x 1/4 = 5/8 of it, so
a swarm that gives each route work in proportion to its speed keeps 5/8 of its versions per
minute (``IDEAL``). A swarm that shares work equally does worse: every training pass waits for
the slow route's equal rows (4x their time), and the slow route's generation jobs hold the
replay buffer's room. On a shared 2-core machine the clean run is CPU-bound, so the throttled
node's sleep gives the others CPU back and the measured ratio can exceed the ideal; the bar is
``IDEAL`` less the run-to-run noise of such short windows (``NOISE``).
"""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from tests.integration.swarm_harness import Swarm

pytestmark = [pytest.mark.network, pytest.mark.slow]

log = logging.getLogger(__name__)

SLOWDOWN = 4.0
IDEAL = 0.5 + 0.5 / SLOWDOWN  # 5/8 of the clean swarm's versions per minute
NOISE = 0.1
#: the window over which versions per minute are counted (after the warm-up)
WINDOW_S = 40.0
#: versions before the window: every route measured (jobs and passes) before counting
WARM_VERSIONS = 2

RUN = ["task.eval_size=16", "prompts_per_step=4", "group_size=4", "prompts_per_job=1", "updates_per_batch=1",
       "eval_every_versions=0", "max_versions=0"]


def _nodes_in(stats: dict) -> int:
    return sum(1 for n in stats["nodes"] if n["stage"] is not None)


def _versions_per_min(tmp_path, slow: bool, equal_shares: bool = False) -> tuple[float, dict]:
    """Versions per minute over ``WINDOW_S`` after the warm-up, and the last stats."""
    from tests.support.equal_shares import coordinator_argv

    tmp_path.mkdir()
    swarm = Swarm(tmp_path, settings=RUN, coordinator_command=coordinator_argv if equal_shares else None)
    try:
        swarm.start_coordinator()
        for k, name in enumerate(["n0", "n1", "n2", "n3"]):  # joined one by one
            swarm.start_node(name, slowdown=SLOWDOWN if slow and name == "n3" else None)
            swarm.wait(lambda s, k=k: _nodes_in(s) > k, timeout_s=60, what=f"node {name} to join")
        stats = swarm.wait(lambda s: s["version"] >= WARM_VERSIONS and all(n["ready"] for n in s["nodes"]),
                           timeout_s=150, what=f"{WARM_VERSIONS} versions with every node ready")
        v0, t0 = stats["version"], time.monotonic()
        time.sleep(WINDOW_S)
        stats = swarm.stats()
        rate = (stats["version"] - v0) * 60.0 / (time.monotonic() - t0)
        window = [s for s in stats["steps"] if s["version"] > v0]
        train_s = sum(s["train_s"] for s in window) / max(1, len(window))
        log.info("%s%s: %.1f versions/min, %.3f s of micro-batches a step; route weights %s; counters %s",
                 "slow" if slow else "clean", " (equal shares)" if equal_shares else "", rate, train_s,
                 stats["route_weights"], stats["counters"])
        return rate, {**stats, "throttled": swarm.peer_id("n3")}
    finally:
        swarm.stop()


def test_a_node_at_a_quarter_speed_cuts_versions_per_minute_by_no_more_than_its_share(tmp_path):
    clean, clean_stats = _versions_per_min(tmp_path / "clean", slow=False)
    slowed, stats = _versions_per_min(tmp_path / "slow", slow=True)
    # replicas that joined a stage which had stepped took their siblings' AdamW moments with the weights:
    # no weight vote found an honest replica apart, so none was resynced or evicted
    for run in (clean_stats, stats):
        assert run["weight_votes"].get("resyncs", 0) == 0 and run["weight_votes"].get("evicted", 0) == 0, \
            run["weight_votes"]
    ratio = slowed / clean
    log.info("versions/min clean %.1f, one node at 1/%g speed %.1f: ratio %.2f (ideal %.3f)", clean, SLOWDOWN,
             slowed, ratio, IDEAL)
    assert clean > 0
    assert ratio >= IDEAL - NOISE, (clean, slowed, stats["route_weights"])
    # the slow node is seen: of all nodes, the route weights send the least generation work through the
    # throttled one (the sum of jobs/s over the routes it is on: 12.9-20.8 vs 28.9-84 for the others in three
    # runs; here the mean over every route of the 2 x 2 grid). The figures list only routes that have
    # finished a job, so a route that finished none counts as 0 jobs/s: two runs listed 3 of the 4, and
    # left out, the missing route (the throttled node's) made a fast node's mean or sum the lowest. Not a
    # route's job time: the in-flight limits give a slow route fewer jobs at once, so a job's latency there
    # stayed level with the others' (~0.08 s); nor the weakest single route: the throttled node may sit on
    # stage 0 or 1, and its stage-mate's routes share its slow partner
    listed = {tuple(route["route"]): route["jobs_per_s"] for route in stats["route_weights"]["generation"]}
    stages = [sorted({route[i] for route in listed}) for i in range(2)]
    rates: dict[str, list[float]] = {}
    for first in stages[0]:
        for second in stages[1]:
            for peer in (first, second):
                rates.setdefault(peer, []).append(listed.get((first, second), 0.0))
    through = {peer: sum(r) / len(r) for peer, r in rates.items()}
    assert stats["throttled"].startswith(min(through, key=through.get)), json.dumps([stats["throttled"],
                                                                                     stats["route_weights"]])


@pytest.mark.skipif(os.environ.get("POLIS_SLOW_NODE_BASELINE") != "1",
                    reason="a 3-minute measurement, run on request: POLIS_SLOW_NODE_BASELINE=1")
def test_with_a_quarter_speed_node_weighted_routes_beat_equal_shares(tmp_path):
    """The same throttled swarm twice: route weights on, then off (``tests.support.equal_shares``).
    Both runs free the same CPU, so what differs is only how work is shared."""
    weighted, _ = _versions_per_min(tmp_path / "weighted", slow=True)
    equal, _ = _versions_per_min(tmp_path / "equal", slow=True, equal_shares=True)
    log.info("one node at 1/%g speed: versions/min weighted %.1f, equal shares %.1f (%.2fx)", SLOWDOWN, weighted,
             equal, weighted / max(equal, 1e-9))
    assert weighted >= (1 - NOISE) * equal
