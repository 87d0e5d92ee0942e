"""Finding 8 of issue 14: a coordinator whose disk is full drops no session and resumes by itself;
``finished`` and a pending eval survive a restart.

Real coordinator on loopback, real websockets (``tests.support.hostile_node.join``), a real
SQLite file capped with ``PRAGMA max_page_count`` (the real ``SQLITE_FULL``).
"""

from __future__ import annotations

import asyncio
import json

from engine.paths import base_checkpoint_dir
from engine.rl.run_task import make_run_task
from engine.swarm import messages
from engine.swarm.coordinator import Coordinator, CoordinatorConfig
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.store import Store, StoreUnavailable
from tests.support.hostile_node import join


def _fill_to_the_brim(store: Store) -> None:
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")
    for i in range(100_000):
        try:
            store._set_meta_now(f"filler{i}", "x" * 64)
        except StoreUnavailable:
            return
    raise AssertionError("the capped database never filled")


def test_a_full_disk_pauses_ingestion_drops_no_session_and_resumes(tmp_path):
    async def main():
        c = Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                          num_stages=2, port=0, tick_s=0.02))
        fills = []
        honest_fill = c.generation.fill

        async def counting_fill():
            fills.append(c.store.write_error)
            await honest_fill()
        c.generation.fill = counting_fill
        url = await c.start()
        links = []
        try:
            links.append(await join(url))
            _fill_to_the_brim(c.store)
            fills.clear()
            assert c.stats()["storage_error"]
            links.append(await join(url))  # admitted all the same (its peer row could not be written)
            report = messages.Report(tokens_generated=5, microbatches_trained=1, bytes_sent=10, bytes_received=10,
                                     uptime_s=3)
            for link in links:
                await link.send(json.loads(messages.encode(report)))
            await asyncio.sleep(0.5)  # many ticks while the disk is full
            assert [link.reply["type"] for link in links] == ["welcome", "welcome"]
            assert all(not link.ws.closed for link in links) and len(c.sessions) == 2  # nobody dropped
            assert fills == []  # ingestion paused: no generation was dispatched while the disk was full
            c.store._db.execute("PRAGMA max_page_count = 1000000")  # space is back
            for _ in range(100):
                await asyncio.sleep(0.05)
                if c.stats()["storage_error"] is None:
                    break
            assert c.stats()["storage_error"] is None
            await asyncio.sleep(0.1)
            assert fills and set(fills) == {None}  # and it resumed by itself
            for link in links:
                await link.send(json.loads(messages.encode(report)))
            await asyncio.sleep(0.3)
            reported = sum(p["self_reported"]["bytes_sent"] for p in c.store.ledger().values())
            assert len(c.sessions) == 2 and reported >= 10
        finally:
            for link in links:
                await link.close()
            await c.stop()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_finished_and_a_pending_eval_survive_a_restart(tmp_path):
    store = Store(tmp_path / "c.db")
    task = make_run_task(RunConfig().task, base_checkpoint_dir())
    book, evals = RunBook(store), EvalScheduler(task, store)
    store.record_eval(0, 0.1, 10)
    evals.request(7)
    book.finished = True
    store.close()
    store = Store(tmp_path / "c.db")
    assert RunBook(store).finished is True
    again = EvalScheduler(task, store)
    assert again.wanted == 7
    again.next_batch()  # the round starts; until it is recorded a restart asks for it again
    assert EvalScheduler(task, store).wanted == 7
    store.close()
