"""Finding 9 of issue 14: odd admin headers and hostile run ids are refused, not crashes or paths."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from engine.net.errors import ProtocolViolation
from engine.paths import base_checkpoint_dir
from engine.swarm import messages
from engine.swarm.coordinator import Coordinator, CoordinatorConfig
from tests.support.hostile_node import join


def test_a_non_ascii_or_wrong_admin_token_gets_401_and_the_right_one_works(tmp_path):
    async def main():
        c = Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                          num_stages=2, port=0, admin_token="s3cret"))
        url = await c.start()
        try:
            async with aiohttp.ClientSession() as http:
                statuses = []
                for value in ("Bearer s\u00e9cret", "Bearer \u2603", "Bearer wrong", ""):
                    async with http.post(url + "/api/eval", headers={"Authorization": value}) as r:
                        statuses.append(r.status)
                async with http.post(url + "/api/eval", headers={"Authorization": "Bearer s3cret"}) as r:
                    ok = r.status
            return statuses, ok
        finally:
            await c.stop()
    statuses, ok = asyncio.run(main())
    assert statuses == [401, 401, 401, 401] and ok == 200


WELCOME = {"type": "welcome", "stage": 0, "num_stages": 2, "layer_start": 0, "layer_end": 2, "num_layers": 4,
           "source": "checkpoint", "source_peer": None, "stage_checkpoint": None, "version": 0, "run": {},
           "signal_url": "ws://127.0.0.1:9/signal"}


@pytest.mark.parametrize("run_id", ["/any/dir", "../up", "a/b", "..", "run.1", "", "x" * 65])
def test_a_run_id_that_could_name_another_folder_is_refused_on_both_sides(run_id):
    with pytest.raises(ProtocolViolation):
        messages.decode_from_coordinator(json.dumps({**WELCOME, "run_id": run_id}))
    assert messages.decode_from_coordinator(json.dumps({**WELCOME, "run_id": "a1b2-c3_d4"})).run_id == "a1b2-c3_d4"


def test_a_hello_with_a_path_for_a_run_id_is_not_admitted(tmp_path):
    async def main():
        c = Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                          num_stages=2, port=0))
        url = await c.start()
        try:
            link = await join(url, run_id="/any/dir")
            reply = link.reply
            await link.close()
            return reply, dict(c.sessions)
        finally:
            await c.stop()
    reply, sessions = asyncio.run(main())
    assert reply["type"] == "shutdown" and "not admitted" in reply["reason"] and not sessions
