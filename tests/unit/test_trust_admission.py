"""Finding 7 of issue 14: admission by address, placement and leaders by the coordinator, and the
coordinator's identity proven to nodes.

Real coordinators on loopback, real websockets. Hostile clients (``tests.support.hostile_node``)
connect from other loopback addresses (127.0.0.2, ...), which the coordinator sees as other
machines. The node side is the real ``CoordinatorSession`` (hello with its own nonce, welcome check).
Malformed run ids are refused in ``test_trust_inputs``.
"""

from __future__ import annotations

import asyncio
import base64
from collections import Counter

import pytest

from engine.net.errors import AuthenticationError
from engine.net.identity import Identity, pin_url, split_pinned_url
from engine.paths import base_checkpoint_dir
from engine.swarm.coordinator import Coordinator, CoordinatorConfig
from engine.swarm.coordinator_session import CoordinatorSession
from engine.swarm.node_context import TaskSpawner
from tests.support.hostile_node import join

SYBIL_HOST = "127.0.0.2"


def _coordinator(tmp_path, name: str = "c", **config) -> Coordinator:
    return Coordinator(CoordinatorConfig(db_path=str(tmp_path / f"{name}.db"), port=0, num_stages=2,
                                         base_checkpoint=str(base_checkpoint_dir()), **config))


def _run(body, *coordinators: Coordinator):
    async def main():
        urls = [await c.start() for c in coordinators]
        try:
            return await asyncio.wait_for(body(*urls), 60)
        finally:
            for c in coordinators:
                await c.stop()
    return asyncio.run(main())


def test_twenty_identities_from_one_address_are_capped_spread_and_none_leads(tmp_path):
    c = _coordinator(tmp_path, max_nodes_per_address=8)

    links: list = []

    async def body(url):
        try:
            await attack(url)
        finally:
            await asyncio.gather(*(link.close() for link in links), return_exceptions=True)

    async def attack(url):
        sybils = [await join(url, stage=1, num_stages=2, run_id=c.run_id, local_host=SYBIL_HOST) for _ in range(20)]
        links.extend(sybils)
        welcomed = [s for s in sybils if s.reply["type"] == "welcome"]
        assert len(welcomed) == 8 and c.book.counters["refused_address_cap"] == 12
        stages = Counter(s.reply["stage"] for s in welcomed)
        assert stages[0] >= 3 and stages[1] <= 5  # all asked for stage 1: granted within one of the least covered
        honest = [await join(url, local_host=f"127.0.0.{i}") for i in (3, 4, 5, 6)]
        links.extend(honest)
        assert {h.reply["stage"] for h in honest} == {0, 1}  # placed by the coordinator, where fewest serve
        for link in welcomed + honest:  # all of them say they are ready; the sybils came first
            await link.send({"type": "ready", "stage": link.reply["stage"], "version": 0})
        await asyncio.sleep(0.3)
        for stage in (0, 1):  # each stage is led by a node of an address that runs one identity
            assert c.members.leader(stage) in {h.identity.peer_id for h in honest if h.reply["stage"] == stage}
        assert sum(len(r) for r in c.members.stage_replicas()) == 12
    _run(body, c)


def _session(url: str, welcomes: list) -> CoordinatorSession:
    async def on_welcome(welcome):
        welcomes.append(welcome)

    async def idle():
        await asyncio.sleep(3600)
    return CoordinatorSession(
        url, Identity.generate(), TaskSpawner(),
        hello_fields=lambda: {"backend": "torch", "device": "cpu", "max_layers": None, "stage": None,
                              "num_stages": None, "version": 0, "run_id": None, "has_base": True, "role": "trainer"},
        on_welcome=on_welcome, on_message=lambda m: None, on_members=lambda m: None, while_connected=idle,
        emit=lambda *a, **k: None, set_state=lambda *a: None)


async def _connect(session: CoordinatorSession, welcomes: list) -> None:
    """One handshake: returns once welcomed (the session keeps serving in the background)."""
    running = asyncio.Event()
    running.set()
    task = asyncio.get_running_loop().create_task(session._connect_once(asyncio.Event(), running))
    while not welcomes and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # raises what the handshake raised
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await session.tasks.cancel_all()


def test_a_node_pinned_to_the_coordinators_key_joins_it_and_refuses_a_rogue_one(tmp_path):
    real, rogue = _coordinator(tmp_path, "real"), _coordinator(tmp_path, "rogue")

    async def body(real_url, rogue_url):
        assert split_pinned_url(real.swarm_url) == (real_url, real.identity.public_key)
        welcomes: list = []
        honest = _session(real.swarm_url, welcomes)
        await _connect(honest, welcomes)
        assert honest.coordinator_key == real.identity.public_key and len(welcomes) == 1

        # the rogue answers at the address the node was given, with its own key: refused
        pinned_elsewhere = pin_url(rogue_url, real.identity.public_key)
        refused: list = []
        with pytest.raises(AuthenticationError, match="another key"):
            await _connect(_session(pinned_elsewhere, refused), refused)
        # ... or naming the real key, which it cannot sign for: refused
        rogue.public_key_b64 = base64.b64encode(real.identity.public_key).decode()
        with pytest.raises(AuthenticationError, match="does not match"):
            await _connect(_session(pinned_elsewhere, refused), refused)
        assert not refused  # nothing was loaded from either

        # unpinned, the first proven key is kept: the same session later refuses another coordinator
        rogue.public_key_b64 = base64.b64encode(rogue.identity.public_key).decode()
        tofu_welcomes: list = []
        tofu = _session(real_url, tofu_welcomes)
        await _connect(tofu, tofu_welcomes)
        tofu.url = rogue_url
        tofu_welcomes.clear()
        with pytest.raises(AuthenticationError, match="another key"):
            await _connect(tofu, tofu_welcomes)
    _run(body, real, rogue)


def test_the_coordinator_keeps_its_key_across_restarts_and_the_lan_advert_pins_it(tmp_path):
    from engine.net.discovery import ServiceAdvert

    first, again = _coordinator(tmp_path), _coordinator(tmp_path)
    assert first.identity.public_key == again.identity.public_key  # next to its database, 0600
    assert (tmp_path / "c.db.ed25519.key").stat().st_mode & 0o077 == 0
    advert = ServiceAdvert(role="coordinator", peer_id="0123456789ab", signalling_url="http://127.0.0.1:8700",
                           version="0.1", coordinator_key=first.identity.public_key)
    parsed = ServiceAdvert.from_properties({k.encode(): v.encode() for k, v in advert.to_properties().items()})
    assert split_pinned_url(parsed.coordinator_url) == ("http://127.0.0.1:8700", first.identity.public_key)
    for store in (first.store, again.store):
        store.close()
