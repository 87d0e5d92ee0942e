"""Finding 1 of issue 14: a signed hello is advice; the coordinator owns the version and placement.

Real coordinator on loopback, real websockets, correctly signed hellos that lie.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from engine.paths import base_checkpoint_dir
from engine.swarm.assignment import Assignment, NodeSlot, resume_stage
from engine.swarm.coordinator import Coordinator, CoordinatorConfig
from tests.support.hostile_node import join


def _run(tmp_path, body):
    async def main():
        c = Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                          num_stages=2, port=0))
        url = await c.start()
        try:
            return await asyncio.wait_for(body(c, url), 60)
        finally:
            await c.stop()
    return asyncio.run(main())


def test_a_far_future_version_and_a_stage_that_does_not_exist_neither_stall_nor_lock_out(tmp_path):
    async def body(c, url):
        liar = await join(url, stage=0, num_stages=2, run_id=c.run_id, version=2**40)
        assert liar.reply["type"] == "welcome" and liar.reply["version"] == 0
        assert liar.reply["source"] != "keep"  # its weights are not the run's version: it reloads
        assert c.book.version == 0 and c.store.get_meta("version", 0) == 0
        nowhere = await join(url, stage=200, num_stages=2, run_id=c.run_id)
        assert nowhere.reply["type"] == "welcome" and nowhere.reply["stage"] in (0, 1)
        honest = await join(url)
        assert honest.reply["type"] == "welcome" and honest.reply["stage"] in (0, 1)
        assert sorted(c.assignment.coverage()) == [1, 2]
        for link in (liar, nowhere, honest):
            await link.close()
    _run(tmp_path, body)


def test_twenty_identities_naming_one_stage_are_capped_and_spread(tmp_path):
    async def body(c, url):
        links = [await join(url, stage=1, num_stages=2, run_id=c.run_id) for _ in range(20)]
        replies = Counter(link.reply["type"] for link in links)
        cap = c.config.max_nodes_per_address
        assert replies == {"welcome": cap, "shutdown": 20 - cap}  # identities are free, addresses are not
        assert "from your address" in [link.reply for link in links][-1]["reason"]
        stages = Counter(link.reply["stage"] for link in links if link.reply["type"] == "welcome")
        assert abs(stages[0] - stages[1]) <= 2, stages  # a wish is granted within one of the least-covered
        for link in links:
            await link.close()
    _run(tmp_path, body)


def test_a_resuming_node_keeps_its_stage_when_it_does_not_unbalance_the_swarm():
    a = Assignment(stage_layers=[2, 2])
    assert resume_stage(a, NodeSlot("p1"), 1) == 1
    a.nodes["p1"] = NodeSlot("p1", stage=1)
    assert resume_stage(a, NodeSlot("p2"), 1) == 1  # one above the least-covered stage: granted
    a.nodes["p2"] = NodeSlot("p2", stage=1)
    assert resume_stage(a, NodeSlot("p3"), 1) is None  # two above: placed by the coordinator
    assert resume_stage(a, NodeSlot("p3"), 2) is None and resume_stage(a, NodeSlot("p3"), 200) is None
    assert resume_stage(a, NodeSlot("p3", max_layers=1), 0) is None  # cannot hold it


def test_a_node_that_stops_reading_its_socket_is_evicted_after_one_send_deadline(tmp_path, monkeypatch):
    import engine.swarm.membership as membership
    from engine.swarm import messages
    from engine.swarm.membership import Membership, NodeSession

    class StuckWs:
        closed = False
        closes = 0

        async def send_str(self, text):
            await asyncio.sleep(3600)

        async def close(self):
            StuckWs.closes += 1

    monkeypatch.setattr(membership, "SEND_TIMEOUT_S", 0.05)

    async def main():
        m = Membership(1)
        m.sessions["stuck"] = NodeSession("stuck", StuckWs(), "torch", "cpu", stage=0, ready=True)
        assert m.routes() == [["stuck"]]
        assert await m.send("stuck", messages.Sync(source_peer="peer-x")) is False
        assert m.routes() == []  # out of every route at once
        await asyncio.sleep(0.01)
        return StuckWs.closes
    assert asyncio.run(main()) == 1
