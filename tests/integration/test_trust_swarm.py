"""Issue 14 over real processes: lying hellos do not stop a real 2x2 swarm from training.

A real coordinator and four real torch nodes (WebRTC on 127.0.0.1); two hostile clients
(``tests.support.hostile_node``) join first with correctly signed hellos that lie: one holds
version 2^40, one asks for stage 200. Before the fix the first froze every honest rollout as
stale and the second made ``_welcome`` raise for every later node.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.swarm_harness import Swarm
from tests.support.hostile_node import join

pytestmark = [pytest.mark.network, pytest.mark.slow]


def test_a_far_future_version_and_a_made_up_stage_neither_stop_nor_lock_out_a_real_swarm(tmp_path):
    swarm = Swarm(tmp_path, settings=["prompts_per_step=4", "eval_every_versions=0", "generations_in_flight=2",
                                      "max_versions=40"])
    loop = asyncio.new_event_loop()
    links = []
    try:
        swarm.start_coordinator()
        run_id = swarm.stats()["run_id"]
        links.append(loop.run_until_complete(join(swarm.url, stage=0, num_stages=2, run_id=run_id, version=2**40)))
        links.append(loop.run_until_complete(join(swarm.url, stage=200, num_stages=2, run_id=run_id)))
        assert [link.reply["type"] for link in links] == ["welcome", "welcome"]
        assert swarm.stats()["version"] == 0
        for i in range(4):
            swarm.start_node(f"n{i}")
        # a node that loads last may still be loading when the first two have taken three steps (a busy
        # CI machine): wait for training to advance *and* every honest node to serve, not one snapshot
        stats = swarm.wait(lambda s: s["version"] >= 3 and sum(n["ready"] for n in s["nodes"]) >= 4,
                           timeout_s=420, what="three steps and four ready honest nodes despite the liars")
        honest = [n for n in stats["nodes"] if n["ready"]]
        assert len(honest) == 4 and {n["stage"] for n in honest} == {0, 1}
        assert stats["version"] < 2**40
    finally:
        for link in links:
            loop.run_until_complete(link.close())
        loop.close()
        swarm.stop()
