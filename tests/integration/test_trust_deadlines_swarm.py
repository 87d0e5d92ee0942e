"""Issue 14, finding 2, over real processes and WebRTC: silent peers cost deadlines, not the run.

One 2x2 swarm of real torch nodes, in two windows. The clean window sets the pace (versions per
minute over ``CLEAN_WINDOW_S`` once training runs). Then three hostile real nodes
(``tests.support.hostile_node``) join the same swarm: one ignores its training messages, one stops
reading its coordinator websocket, one stops draining SCTP (the last two once they get work: they
join behind the stage and catch up first, as an honest late joiner does). The hostile window opens
when their processes start, so their start-up, their time in the routes and their eviction are all
inside it, and it is long enough to hold them (``HOSTILE_WINDOW_S``). The run must keep at least half the
clean pace in it; each hostile node must be out of the training routes for good within two step
deadlines of first becoming ready (a node that drops out and comes back counts from its first
ready to its last exit); and no honest node may be evicted (an honest trainer paired with a
hostile one shares its misses: ``engine.swarm.route_health`` must tell them apart).

One swarm rather than a clean one and a hostile one (as before): the same processes and links
measure both paces, so the ratio compares like with like, and the test starts four torch nodes
instead of eleven (it took 5.5 min on 2 cores, and once ran past the 600 s test timeout).
"""

from __future__ import annotations

import time

import pytest

from tests.integration.swarm_harness import Swarm
from tests.support.swarm_evidence import ready_peers

pytestmark = [pytest.mark.network, pytest.mark.slow]

STEP_TIMEOUT_S = 20.0
RUN = ["prompts_per_step=4", "eval_every_versions=0", "generations_in_flight=2", "updates_per_batch=1",
       "micro_batch_rows=16", "microbatch_timeout_s=5"]
COORDINATOR = ["--step-timeout-s", str(STEP_TIMEOUT_S), "--job-timeout-s", "15"]
HONEST = ["n0", "n1", "n2", "n3"]
HOSTILE = {"h-ignore": "ignore_train_in", "h-deaf": "stop_reading_ws", "h-stall": "stop_draining_sctp"}
#: the clean window opens once training has run this many versions (the first steps warm up)
WARM_VERSIONS = 5
CLEAN_WINDOW_S = 45.0
#: from the hostile processes' start: their start-up (13-23 s on 2 busy cores), their time in the
#: routes (10-30 s measured) and the run after them; as long as the window of the two-swarm test
#: before (which opened after their start-up): at 90 s one run of six kept 52 % of the pace
HOSTILE_WINDOW_S = 120.0
#: how long four honest nodes may take to start, join, load and pass the "before" eval
START_TIMEOUT_S = 180.0


def _window(swarm: Swarm, seconds: float, watch: dict[str, str] | None = None) -> tuple[float, dict, dict]:
    """Versions per minute over the next ``seconds``; for each watched peer id when it was first
    ready and when it last left the ready nodes (None: never / still ready), relative to the start."""
    watch = watch or {}
    seen: dict[str, dict] = {name: {"ready_at": None, "gone_at": None} for name in watch}
    stats = swarm.stats() or {}
    started, first = time.monotonic(), stats.get("version", 0)
    now = started
    while now - started < seconds:
        time.sleep(0.5)
        stats = swarm.stats() or stats
        now = time.monotonic()
        ready = ready_peers(stats)
        for name, peer in watch.items():
            if peer in ready:
                if seen[name]["ready_at"] is None:
                    seen[name]["ready_at"] = round(now - started, 1)
                seen[name]["gone_at"] = None
            elif seen[name]["ready_at"] is not None and seen[name]["gone_at"] is None:
                seen[name]["gone_at"] = round(now - started, 1)
    return (stats["version"] - first) * 60.0 / (now - started), seen, stats


def test_peers_that_ignore_train_in_stop_reading_or_stop_draining_cost_under_half_the_pace_and_are_evicted(
        tmp_path):
    swarm = Swarm(tmp_path, settings=RUN, coordinator_args=COORDINATOR)
    try:
        began = time.monotonic()
        swarm.start_coordinator()
        honest = {swarm.peer_id(name) for name in HONEST}
        hostile = {name: swarm.peer_id(name) for name in HOSTILE}
        for name in HONEST:
            swarm.start_node(name)
        swarm.wait(lambda s: ready_peers(s) >= honest and s["evals"] and s["version"] >= WARM_VERSIONS,
                   timeout_s=START_TIMEOUT_S, what=f"four honest nodes to train {WARM_VERSIONS} versions")
        warm_s = time.monotonic() - began
        clean_pace, _, _ = _window(swarm, CLEAN_WINDOW_S)
        for name, misbehaviour in HOSTILE.items():
            swarm.start_node(name, misbehaviour=misbehaviour)
        pace, seen, stats = _window(swarm, HOSTILE_WINDOW_S, watch=hostile)
    finally:
        swarm.stop()
    in_routes = {name: round(t["gone_at"] - t["ready_at"], 1) for name, t in seen.items()
                 if t["ready_at"] is not None and t["gone_at"] is not None}
    print(f"honest swarm trained {WARM_VERSIONS} versions after {warm_s:.0f} s; clean {clean_pace:.1f} "
          f"versions/min, with three hostile peers {pace:.1f}; hostile (s after they started): {seen}; "
          f"in the routes (s): {in_routes}; counters {stats.get('counters')}")
    assert pace >= 0.5 * clean_pace, (pace, clean_pace, stats.get("counters"))
    for name, times in seen.items():
        assert times["ready_at"] is not None and times["gone_at"] is not None, (name, seen, stats.get("counters"))
        assert times["gone_at"] - times["ready_at"] <= 2 * STEP_TIMEOUT_S + 2.0, (name, seen)
    ready = ready_peers(stats)
    assert not ready & set(hostile.values()), (ready, hostile)  # none of them got back in
    assert honest <= ready, (honest - ready, swarm.log_tails())  # no honest node was evicted
