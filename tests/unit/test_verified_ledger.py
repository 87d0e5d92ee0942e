"""Finding 9 of issue 14: the ledger credits only work the coordinator observed or verified.

A node's ``report`` is its own word: kept as self-reported figures, never credit. Credit comes from
generation results the scheduler accepted (every stage of the route), micro-batches the dispatcher
saw complete, and steps whose weights the stage's vote decided. Real coordinator, scheduling
parts, store and codec; the swarm is a hostile client or a recording outbox.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections import Counter

import pytest

from engine.paths import base_checkpoint_dir
from engine.swarm import messages
from engine.swarm.coordinator import Coordinator, CoordinatorConfig
from engine.swarm.credit import Credit
from engine.swarm.ledger import read_ledger
from engine.swarm.stats_view import StatsQuery
from engine.swarm.store import Store, StoreUnavailable
from tests.support.hostile_node import join
from tests.support.recording_links import RecordingLinks
from tests.support.scheduling_parts import scheduling_parts
from tests.unit.test_trust_rollouts import ROUTE, _add_group


def test_a_node_that_reports_a_billion_tokens_gets_no_verified_credit_for_them(tmp_path):
    async def main():
        c = Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                          num_stages=2, port=0))
        url = await c.start()
        try:
            link = await join(url)
            assert link.reply["type"] == "welcome"
            boast = messages.Report(tokens_generated=1e9, microbatches_trained=1e9, bytes_sent=5e9,
                                    bytes_received=1e3, uptime_s=60.0, gen_compute_s=30.0)
            await link.send(json.loads(messages.encode(boast)))
            for _ in range(100):
                await asyncio.sleep(0.05)
                if c.store.ledger_totals()["self_reported"]["bytes_sent"]:
                    break
            await asyncio.sleep(2.5)  # past a credit flush
            peer = link.identity.peer_id
            admin, public = c.stats(), c.stats_view.public(StatsQuery(peer=peer))
            await link.close()
            return peer, admin, public
        finally:
            await c.stop()

    peer, admin, public = asyncio.run(asyncio.wait_for(main(), 60))
    row = admin["ledger"][peer]
    assert (row["tokens_generated"], row["microbatches_trained"], row["steps_applied"]) == (0, 0, 0)
    assert row["self_reported"] == {"bytes_sent": 5e9, "bytes_received": 1e3, "uptime_s": 60.0, "gen_compute_s": 30.0}
    assert admin["credit_totals"]["tokens_generated"] == 0 and admin["self_reported"]["bytes_sent"] == 5e9
    assert public["credit"]["tokens_generated"] == 0 and public["credit_totals"]["microbatches_trained"] == 0


def test_an_accepted_generation_result_credits_every_stage_of_its_route_and_a_refused_or_misdirected_one_nobody(
        tmp_path):
    p = scheduling_parts(tmp_path / "c.db", RecordingLinks(ROUTE))
    asyncio.run(p.generation.fill())
    job = next(m for _, m in p.links.sent if isinstance(m, messages.Gen))
    rows = len(job.prompt_ids)
    tokens = [p.codec.encode("12") + [p.codec.eos_id]] * rows
    done = messages.GenDone(job=job.job, tokens=tokens, logprobs=[[-0.1] * len(tokens[0])] * rows, versions=[0, 0])
    p.generation.on_gen_done(ROUTE[0], done)  # not the route's last stage: not its result to give
    assert p.book.credit.pending() == {}
    p.generation.on_gen_done(ROUTE[1], done)
    generated = sum(len(t) for t in tokens)
    assert p.book.credit.pending() == {peer: {"tokens_generated": generated} for peer in ROUTE}

    p.links.sent.clear()
    asyncio.run(p.generation.fill())
    job = next(m for _, m in p.links.sent if isinstance(m, messages.Gen))
    forged = messages.GenDone(job=job.job, tokens=[[p.codec.vocab_size + 7]] * len(job.prompt_ids),
                              logprobs=[[-0.1]] * len(job.prompt_ids), versions=[0, 0])
    p.generation.on_gen_done(ROUTE[1], forged)  # refused at ingestion: no credit
    assert p.generation.flagged[ROUTE[1]] == 1
    assert p.book.credit.pending() == {peer: {"tokens_generated": generated} for peer in ROUTE}
    assert p.book.credit.flush(p.store) and p.book.credit.pending() == {}
    assert {peer: row["tokens_generated"] for peer, row in p.store.ledger().items()} == dict.fromkeys(ROUTE, generated)
    p.store.close()


def test_completed_microbatches_credit_their_routes_trainers_and_a_step_only_the_replicas_the_vote_confirmed(
        tmp_path):
    links = RecordingLinks.grid([["a0", "a1", "a2"], ["b0", "b1", "b2"]])
    p = scheduling_parts(tmp_path / "c.db", links)
    _add_group(p.store, p.codec, [1.0, 0.0, 0.0, 1.0])
    answered: list[tuple[str, ...]] = []

    def node(peer, message):
        if isinstance(message, messages.TrainIn):
            answered.append(tuple(message.route))
            p.steps.microbatches.on_mb_done(message.route[0], messages.MbDone(step=message.step, mb=message.mb))
        elif isinstance(message, messages.Apply):  # b2 holds other weights than its stage's majority
            digest = "ff" * 16 if peer == "b2" else peer[0] * 32
            p.steps.on_stepped(peer, messages.Stepped(step=message.step, version=message.version, grad_norm=0.0,
                                                      checksum=1.0, update_bytes=0, dense_bytes=0,
                                                      checkpoint_path=None, weights_hash=digest))
    links.on_send = node
    assert asyncio.run(p.steps.maybe_train()) is True
    trained = Counter(peer for route in answered for peer in route)
    pending = p.book.credit.pending()
    assert answered and {peer: row.get("microbatches_trained", 0) for peer, row in pending.items()} == \
        {peer: trained[peer] for peer in pending}
    assert {peer for peer, row in pending.items() if row.get("steps_applied")} == {"a0", "a1", "a2", "b0", "b1"}
    assert not any(row.get("tokens_generated") for row in pending.values())  # training is not generation
    p.store.close()


def test_a_microbatch_that_nodes_refuse_is_not_credited(tmp_path):
    p = scheduling_parts(tmp_path / "c.db", RecordingLinks(ROUTE))
    _add_group(p.store, p.codec, [1.0, 0.0, 0.0, 1.0])

    def refuse(peer, message):
        if isinstance(message, messages.TrainIn):
            p.steps.microbatches.on_mb_failed(peer, messages.MbFailed(step=message.step, mb=message.mb, reason="no"))
    p.links.on_send = refuse
    assert asyncio.run(p.steps.maybe_train()) is False
    assert p.book.credit.pending() == {}
    p.store.close()


def test_verified_credit_waits_in_memory_while_the_disk_refuses_and_is_written_in_one_batch(tmp_path, monkeypatch):
    store, credit = Store(tmp_path / "c.db"), Credit()
    credit.add(["a", "b", "a"], tokens_generated=5)  # a peer named twice on a route is credited once
    credit.add(["a"], steps_applied=1)
    with pytest.raises(ValueError):
        credit.add(["a"], bytes_sent=1)  # self-reported figures are never credit

    def full(_credit):
        raise StoreUnavailable("disk is full")
    monkeypatch.setattr(store, "add_credit", full)
    assert credit.flush(store) is False
    assert credit.pending_for("a") == {"tokens_generated": 5, "steps_applied": 1}
    assert credit.pending_totals()["tokens_generated"] == 10
    monkeypatch.undo()
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    assert credit.flush(store) and credit.pending() == {}
    assert statements[0] == "BEGIN" and statements[-1] == "COMMIT"  # every peer in one transaction
    ledger = store.ledger()
    assert (ledger["a"]["tokens_generated"], ledger["a"]["steps_applied"], ledger["b"]["tokens_generated"]) == (5, 1, 5)
    assert store.ledger_totals()["verified"]["tokens_generated"] == 10
    store.close()


def test_a_ledger_from_before_verified_credit_reads_its_claims_as_nothing_and_its_bytes_as_self_reported(tmp_path):
    Store(tmp_path / "c.db").close()
    db = sqlite3.connect(str(tmp_path / "c.db"))
    db.executescript("DROP TABLE ledger; DROP TABLE credit; CREATE TABLE ledger (peer_id TEXT PRIMARY KEY, "
                     "tokens_generated INTEGER NOT NULL DEFAULT 0, microbatches_trained INTEGER NOT NULL DEFAULT 0, "
                     "bytes_sent INTEGER NOT NULL DEFAULT 0, bytes_received INTEGER NOT NULL DEFAULT 0, "
                     "uptime_s REAL NOT NULL DEFAULT 0); "
                     "INSERT INTO ledger VALUES ('old-peer', 1000000000, 99, 100, 50, 7.5);")
    old = read_ledger(db)["old-peer"]  # what `polis export` reads of an old run, read-only
    db.close()
    assert old["tokens_generated"] == 0 and old["microbatches_trained"] == 0
    assert old["self_reported"] == {"bytes_sent": 100.0, "bytes_received": 50.0, "uptime_s": 7.5, "gen_compute_s": 0.0}
    store = Store(tmp_path / "c.db")  # the coordinator resumes it: the credit table is added, the claims stay unread
    assert store.ledger_totals()["verified"]["tokens_generated"] == 0
    store.add_credit({"old-peer": {"tokens_generated": 3}})
    store.add_self_reported("old-peer", gen_compute_s=2.0)
    row = store.ledger()["old-peer"]
    assert row["tokens_generated"] == 3 and row["self_reported"]["gen_compute_s"] == 2.0
    store.close()
