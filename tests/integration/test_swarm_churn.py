"""The swarm survives churn: a node SIGKILLed mid-run, a coordinator restarted from its database.

Real processes on 127.0.0.1: a coordinator and torch nodes that talk over WebRTC.
"""

from __future__ import annotations

import pytest

from tests.integration.swarm_harness import Swarm

pytestmark = [pytest.mark.network, pytest.mark.slow]

SMALL_RUN = ["prompts_per_step=4", "eval_every_versions=0", "generations_in_flight=2"]


def _monotonic(versions: list[dict]) -> bool:
    numbers = [v["version"] for v in versions]
    return numbers == sorted(set(numbers))


def test_a_node_killed_mid_run_loses_no_rollout_and_versions_stay_monotonic(tmp_path):
    swarm = Swarm(tmp_path, settings=SMALL_RUN + ["max_versions=6"])
    try:
        swarm.start_coordinator()
        for i in range(4):
            swarm.start_node(f"n{i}")
        swarm.wait(lambda s: s["version"] >= 2, timeout_s=300, what="two training steps on 4 nodes")
        swarm.nodes["n0"].kill()  # SIGKILL: no goodbye, the coordinator must notice by itself
        stats = swarm.wait(lambda s: s["version"] >= 6 and len(s["nodes"]) == 3, timeout_s=300,
                           what="the run to reach version 6 with the 3 survivors")
        assert _monotonic(stats["versions"])
        assert stats["received_rollouts"] == sum(stats["rollouts"].values())  # every completed rollout stored
        assert all(n["ready"] for n in stats["nodes"])
        assert all(stage["replicas"] for stage in stats["stages"])
    finally:
        swarm.stop()


def test_a_restarted_coordinator_resumes_the_run_from_its_database(tmp_path):
    swarm = Swarm(tmp_path, settings=SMALL_RUN + ["max_versions=40"])
    try:
        swarm.start_coordinator()
        swarm.start_node("a")
        swarm.start_node("b")
        before = swarm.wait(lambda s: s["version"] >= 2, timeout_s=300, what="two training steps")
        swarm.kill_coordinator()
        swarm.start_coordinator()
        after = swarm.wait(lambda s: s["version"] >= before["version"] + 2, timeout_s=300,
                           what="two more steps after the restart")
        assert after["run_id"] == before["run_id"]
        assert after["evals"][0] == before["evals"][0]  # the version-0 eval survived
        assert _monotonic(after["versions"])
        assert {n["peer_id"] for n in after["nodes"]} == {n["peer_id"] for n in before["nodes"]}
    finally:
        swarm.stop()
