"""Issue 14, finding 2, over real processes and WebRTC: silent peers cost deadlines, not the run.

A clean 2x2 swarm of real torch nodes sets the pace (versions per minute over a fixed window
once training has started). Then the same 2x2 swarm trains with three hostile real nodes
(``tests.support.hostile_node``) beside it: one ignores its training messages, one stops
reading its coordinator websocket, one stops draining SCTP. The pace is measured from the moment
training may start (the "before" eval is recorded), so what the hostile nodes cost is inside the
window. The run must keep at least half the clean pace, and each hostile node must leave the
training routes within two step deadlines of becoming ready.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.integration.swarm_harness import Swarm

pytestmark = [
    pytest.mark.network, pytest.mark.slow,
    # 7 node processes + a clean and a hostile run: 5.5 min when it passed on 2 cores, and past the
    # 600 s test timeout in one fresh-clone CI run (cause not yet found); run it with
    # POLIS_TRUST_SWARM_TEST=1 until it is made shorter and steady
    pytest.mark.skipif(os.environ.get("POLIS_TRUST_SWARM_TEST") != "1",
                       reason="a 6-10 minute swarm of 7 processes: set POLIS_TRUST_SWARM_TEST=1"),
]

STEP_TIMEOUT_S = 20.0
RUN = ["prompts_per_step=4", "eval_every_versions=0", "generations_in_flight=2", "updates_per_batch=1",
       "micro_batch_rows=16", "microbatch_timeout_s=5"]
COORDINATOR = ["--step-timeout-s", str(STEP_TIMEOUT_S), "--job-timeout-s", "15"]
WINDOW_S = 120.0
HOSTILE = {"h-ignore": "ignore_train_in", "h-deaf": "stop_reading_ws", "h-stall": "stop_draining_sctp"}


def _pace(swarm: Swarm, watch: dict[str, str] | None = None) -> tuple[float, dict[str, dict], dict]:
    """Versions per minute over ``WINDOW_S`` from when training may start (the "before" eval is
    recorded); for each watched peer id when it was first ready and when it first left the ready
    nodes after that."""
    watch = watch or {}
    seen = {name: {"ready_at": None, "gone_at": None} for name in watch}
    started, first = None, None
    deadline = time.monotonic() + 420 + WINDOW_S
    stats: dict = {}
    while time.monotonic() < deadline:
        stats = swarm.stats() or stats
        now = time.monotonic()
        ready = {n["peer_id"] for n in stats.get("nodes", []) if n["ready"]}
        for name, peer in watch.items():
            if peer in ready and seen[name]["ready_at"] is None:
                seen[name]["ready_at"] = now
            if peer not in ready and seen[name]["ready_at"] is not None and seen[name]["gone_at"] is None:
                seen[name]["gone_at"] = now
        if stats.get("evals") and started is None:
            started, first = now, stats["version"]
        if started is not None and now - started >= WINDOW_S:
            return (stats["version"] - first) * 60.0 / (now - started), seen, stats
        time.sleep(0.5)
    raise AssertionError(f"training never ran for {WINDOW_S} s; last stats: {stats}; logs in {swarm.tmp}")


def test_peers_that_ignore_train_in_stop_reading_or_stop_draining_cost_under_half_the_pace_and_are_evicted(
        tmp_path):
    (tmp_path / "clean").mkdir()
    clean = Swarm(tmp_path / "clean", settings=RUN, coordinator_args=COORDINATOR)
    try:
        clean.start_coordinator()
        for i in range(4):
            clean.start_node(f"n{i}")
        clean_pace, _, _ = _pace(clean)
    finally:
        clean.stop()

    (tmp_path / "hostile").mkdir()
    swarm = Swarm(tmp_path / "hostile", settings=RUN, coordinator_args=COORDINATOR)
    try:
        swarm.start_coordinator()
        peers = {name: swarm.peer_id(name) for name in HOSTILE}
        for name, misbehaviour in HOSTILE.items():
            swarm.start_node(name, misbehaviour=misbehaviour)
        for i in range(4):
            swarm.start_node(f"n{i}")
        pace, seen, stats = _pace(swarm, peers)
    finally:
        swarm.stop()
    gone_after = {name: round(t["gone_at"] - t["ready_at"], 1) for name, t in seen.items() if t["gone_at"]}
    print(f"clean {clean_pace:.1f} versions/min, with three hostile peers {pace:.1f}; out of the routes "
          f"after (s): {gone_after}; counters {stats.get('counters')}")
    assert pace >= 0.5 * clean_pace, (pace, clean_pace, stats.get("counters"))
    for name, times in seen.items():
        assert times["ready_at"] is not None and times["gone_at"] is not None, (name, seen, stats.get("counters"))
        assert times["gone_at"] - times["ready_at"] <= 2 * STEP_TIMEOUT_S + 2.0, (name, seen)
    ready = {n["peer_id"] for n in stats["nodes"] if n["ready"]}
    assert not ready & set(peers.values()), (ready, peers)  # none of them got back in
