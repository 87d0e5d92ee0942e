"""The coordinator with trainers and inference replicas: who generates, who trains, who loads from whom."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.net.errors import ProtocolViolation
from engine.paths import base_checkpoint_dir
from engine.swarm import messages
from engine.swarm.coordinator import Coordinator, CoordinatorConfig, NodeSession


class FakeWs:
    def __init__(self, peer: str, outbox: list) -> None:
        self.peer, self.outbox, self.closed = peer, outbox, False

    async def send_str(self, text: str) -> None:
        self.outbox.append((self.peer, json.loads(text)))


def handle(c, session, message: dict) -> None:
    """A node message as the coordinator gets it: decoded into its typed struct, then dispatched."""
    c.reports.handle(session, messages.NODE_TO_COORDINATOR.convert(message))


@pytest.fixture()
def coordinator(tmp_path):
    c = Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                      num_stages=2))
    c.outbox = []
    for peer, stage, role, ready in (("trn0", 0, "trainer", True), ("trn1", 1, "trainer", True),
                                     ("inf0", 0, "inference", True), ("inf1", 1, "inference", False)):
        c.sessions[peer] = NodeSession(peer, FakeWs(peer, c.outbox), "torch", "cpu", stage=stage, ready=ready,
                                       role=role)
    yield c
    c.store.close()


def test_generation_uses_every_ready_replica_but_training_and_apply_use_trainers(coordinator):
    c = coordinator
    assert c.members.routes() == [["trn0", "trn1"]]
    assert c.members.gen_routes() == [["trn0", "trn1"], ["inf0", "trn1"]]
    assert c.members.stage_replicas() == [["trn0"], ["trn1"]] and c.members.inference_replicas() == [["inf0"], []]
    c.sessions["inf1"].ready = True
    assert c.members.gen_routes() == [["trn0", "trn1"], ["inf0", "inf1"]]

    def stepped_on_apply(peer, message):
        if message["type"] == "apply":
            c.steps.on_stepped(peer, messages.Stepped(step=message["step"], version=message["version"], grad_norm=0.0,
                                                      checksum=1.0, update_bytes=0, dense_bytes=0,
                                                      checkpoint_path=None))

    async def apply():
        ws_send = FakeWs.send_str

        async def send_and_answer(self, text):
            await ws_send(self, text)
            stepped_on_apply(self.peer, json.loads(text))
        FakeWs.send_str = send_and_answer
        try:
            return await c.steps._apply(0)
        finally:
            FakeWs.send_str = ws_send

    assert asyncio.run(apply())
    applies = {peer: m for peer, m in c.outbox if m["type"] == "apply"}
    assert sorted(applies) == ["trn0", "trn1"]  # inference replicas never train
    assert applies["trn0"]["inference"] == ["inf0"] and applies["trn1"]["inference"] == ["inf1"]
    assert c.book.version == 1


def test_an_inference_replica_loads_from_its_stage_leader_and_trainers_keep_the_old_rule(coordinator):
    c = coordinator
    fresh = None  # a node that holds no stage
    newcomer = NodeSession("inf2", FakeWs("inf2", c.outbox), "torch", "cpu", role="inference")
    welcome = c._welcome(newcomer, 0, fresh)
    assert welcome.source == "peer" and welcome.source_peer == "trn0"  # even at version 0: start the stream
    trainer = NodeSession("trn2", FakeWs("trn2", c.outbox), "torch", "cpu")
    assert c._welcome(trainer, 0, fresh).source == "checkpoint"  # version 0: the base is as good
    c.book.version = 3
    assert c._welcome(trainer, 0, fresh).source_peer == "trn0"
    del c.sessions["trn0"]  # no trainer left on stage 0: a trainer may copy the inference replica
    assert c._welcome(trainer, 0, fresh).source_peer == "inf0"
    assert c._welcome(newcomer, 0, fresh).source_peer == "inf0"  # it then waits for a leader's stream


def test_stream_reports_are_checked_against_roles_and_stages_and_shown_in_stats(coordinator):
    c = coordinator
    entry = {"peer": "inf0", "checksum": 2.5, "delta_bytes": 10, "dense_bytes": 40, "residual_max_abs": 1e-7}
    handle(c, c.sessions["trn0"], {"type": "streamed", "version": 1, "streams": [entry]})
    with pytest.raises(ProtocolViolation):  # inf0 is not on trn1's stage
        handle(c, c.sessions["trn1"], {"type": "streamed", "version": 1, "streams": [entry]})
    with pytest.raises(ProtocolViolation):
        handle(c, c.sessions["trn0"], {"type": "streamed", "version": 1,
                                              "streams": [{**entry, "peer": "trn1"}]})
    with pytest.raises(ProtocolViolation):
        handle(c, c.sessions["trn0"], {"type": "served", "version": 1, "checksum": 2.5, "source": "trn0",
                                              "full": False})
    with pytest.raises(ProtocolViolation):
        handle(c, c.sessions["inf0"], {"type": "stepped", "step": 0, "version": 1, "grad_norm": 0.0,
                                              "checksum": 0.0, "update_bytes": 0, "dense_bytes": 0,
                                              "checkpoint_path": None})
    handle(c, c.sessions["inf0"], {"type": "served", "version": 1, "checksum": 2.5, "source": "trn0",
                                          "full": False})
    stats = c.stats()
    assert {n["peer_id"]: n["role"] for n in stats["nodes"]} == {"trn0": "trainer", "trn1": "trainer",
                                                                 "inf0": "inference", "inf1": "inference"}
    assert stats["stages"][0]["replicas"] == ["trn0"] and stats["stages"][0]["inference"] == ["inf0"]
    replica = stats["weight_stream"]["replicas"]["inf0"]
    assert replica["in_sync"] and replica["served_version"] == 1 and c.sessions["inf0"].version == 1
    assert stats["weight_stream"]["ratio_vs_dense_fp32"] == 0.25


def test_a_trainer_ready_behind_its_stage_catches_up_from_the_leader_before_it_is_taken_in(coordinator):
    """Its stage stepped while it loaded: stepping on those weights would hand its siblings a gradient of old
    weights and lose the next vote. It is sent to catch up (``sync`` with ``catch_up``) and taken in when it
    says ready at the stage's version, or after ``MAX_CATCH_UPS`` tries, whatever it holds. The steps wait
    only for a catch-up after one it finished, a bounded while."""
    from engine.swarm.membership import CATCH_UP_HOLD_S
    from engine.swarm.node_reports import MAX_CATCH_UPS

    c = coordinator
    c.sessions["trn0"].version = 40
    late = c.sessions["trn2"] = NodeSession("trn2", FakeWs("trn2", c.outbox), "torch", "cpu", stage=0)

    async def ready(version: int) -> None:
        handle(c, late, {"type": "ready", "stage": 0, "version": version})
        await asyncio.sleep(0.05)  # the sync goes out on its own task

    async def scenario() -> None:
        await ready(19)
        assert not late.ready and c.members.routes() == [["trn0", "trn1"]]
        syncs = [m for peer, m in c.outbox if peer == "trn2" and m["type"] == "sync"]
        assert len(syncs) == 1 and syncs[0]["source_peer"] == "trn0" and syncs[0]["catch_up"]
        # a first catch-up holds no step: a node that goes dark while it loads costs the run nothing
        assert late.catching_up and not c.members.catching_up()
        c.sessions["trn0"].version = 42
        await ready(40)  # it loaded, and its stage stepped meanwhile: told again, and now the steps wait
        assert not late.ready and c.members.catching_up()
        late.holds_steps_since -= CATCH_UP_HOLD_S  # told a hold ago and still loading: steps go on without it
        assert not late.ready and not c.members.catching_up()
        await ready(42)  # caught up
        assert late.ready and late.version == 42 and not c.members.catching_up()
        late.ready, c.sessions["trn0"].version = False, 90  # moved, and its stage ran ahead again
        await ready(43)  # its third catch-up in this session: the last (they are counted over its life)
        assert not late.ready and late.catch_ups == MAX_CATCH_UPS == 3
        await ready(43)  # taken in as it is: the next vote resyncs it (no node stalls the steps for long)
        assert late.ready and not c.members.catching_up()
    asyncio.run(scenario())


def test_a_trainer_ready_at_its_stage_version_while_a_step_from_it_is_in_flight_catches_up_first(coordinator):
    """Its siblings were told to step to the next version and have not said 'stepped' yet: taken in now, it
    would join the next step one version behind them and lose the next weight vote (CI saw one resync)."""
    c = coordinator
    c.sessions["trn0"].version = 42
    c.book.begin_apply(43)  # the step 42 -> 43 is in flight
    late = c.sessions["trn2"] = NodeSession("trn2", FakeWs("trn2", c.outbox), "torch", "cpu", stage=0)

    async def scenario() -> None:
        handle(c, late, {"type": "ready", "stage": 0, "version": 42})
        await asyncio.sleep(0.05)  # the sync goes out on its own task
        assert not late.ready and late.catching_up
        assert [m["catch_up"] for peer, m in c.outbox if peer == "trn2" and m["type"] == "sync"] == [True]
        c.sessions["trn0"].version = 43  # the step landed
        handle(c, late, {"type": "ready", "stage": 0, "version": 43})
        assert late.ready and late.version == 43
    asyncio.run(scenario())
