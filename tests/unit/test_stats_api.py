"""Finding 9 of issue 14: ``/api/stats`` is public and cheap, ``/api/admin/stats`` needs the admin token.

The public view has no admin fields; the admin route answers 401 without the token (one check,
shared with the POST routes); repeated calls read nothing from SQLite (counts are kept as the
store writes, pages and ledger rows are cached until their table changes); long lists come a
bounded page at a time. Real coordinator and store.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from engine.paths import base_checkpoint_dir
from engine.swarm.coordinator import Coordinator, CoordinatorConfig
from engine.swarm.stats_view import DEFAULT_PAGE, MAX_PAGE, REFRESH_S, StatsQuery
from tests.support.hostile_node import join

#: what only the admin view shows
ADMIN_ONLY = {"ledger", "self_reported", "counters", "logprob_audit", "weight_votes", "weight_stream", "in_flight",
              "route_weights", "storage_error", "staleness_histogram", "update_bytes", "dense_update_bytes",
              "jobs_in_flight", "serve"}


def _coordinator(tmp_path) -> Coordinator:
    return Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                         num_stages=2, port=0, admin_token="s3cret"))


def test_a_stats_call_without_the_token_sees_no_admin_fields_and_the_admin_route_answers_401(tmp_path):
    async def main():
        c = _coordinator(tmp_path)
        url = await c.start()
        try:
            link = await join(url)
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/api/stats") as r:
                    public = (r.status, await r.json())
                statuses = []
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer s\u00e9cret"}):
                    async with http.get(url + "/api/admin/stats", headers=headers) as r:
                        statuses.append((r.status, "ledger" in await r.text()))
                async with http.get(url + "/api/admin/stats", headers={"Authorization": "Bearer s3cret"}) as r:
                    admin = (r.status, await r.json())
                bad = []
                for query in ("limit=9999", "after=-1", "limit=x", "peer=../../etc", "sort=1"):
                    async with http.get(f"{url}/api/stats?{query}") as r:
                        bad.append(r.status)
            await link.close()
            return public, statuses, admin, bad
        finally:
            await c.stop()

    public, statuses, admin, bad = asyncio.run(asyncio.wait_for(main(), 60))
    assert public[0] == 200 and not ADMIN_ONLY & public[1].keys()
    assert [set(n) for n in public[1]["nodes"]] == [{"peer_id", "stage", "ready", "role", "version"}]
    assert statuses == [(401, False)] * 3
    assert admin[0] == 200 and ADMIN_ONLY <= admin[1].keys() and public[1].keys() <= admin[1].keys()
    assert {"backend", "refused_results", "logprob_mismatch"} <= admin[1]["nodes"][0].keys()
    assert bad == [400] * 5


def _fill(c: Coordinator, versions: int) -> None:
    for v in range(1, versions + 1):
        c.store.record_version(v, reward_mean=0.5, samples=4, info={"version": v, "seconds": 1.0})
    for v in (0, versions // 2, versions):
        c.store.record_eval(v, 0.25, 8)
    c.store.add_rollouts([dict(group_id=f"g{i // 4}", prompt="1+1", tokens=[5, 6], behaviour_logprobs=[-0.1, -0.2],
                               versions=[0, 0], min_version=0, reward=1.0, advantage=0.0) for i in range(64)])
    c.store.upsert_peer("peer-a", "key-a", role="trainer")
    c.store.add_credit({"peer-a": {"tokens_generated": 40}})
    c.store.add_self_reported("peer-a", bytes_sent=1e6)


def test_repeated_stats_calls_do_not_rescan_tables(tmp_path):
    c = _coordinator(tmp_path)
    _fill(c, 50)
    now = [0.0]
    c.stats_view.cache.clock = lambda: now[0]
    statements: list[str] = []
    c.store._db.set_trace_callback(statements.append)
    c.stats()
    c.stats_view.public(StatsQuery(peer="peer-a"))
    first = list(statements)
    assert first and not [s for s in first if "rollouts" in s or "COUNT(" in s.upper() or "GROUP BY" in s.upper()]
    statements.clear()
    for _ in range(5):
        admin = c.stats()
        public = c.stats_view.public(StatsQuery(peer="peer-a"))
    assert statements == []  # nothing read again: counts kept in memory, pages and ledger rows cached
    assert admin["rollouts"] == {"ready": 64} and admin["page"]["versions_total"] == 50
    assert public["credit"]["tokens_generated"] == 40 and admin["credit_totals"]["tokens_generated"] == 40

    c.store.record_version(51, reward_mean=0.5, samples=4, info={"version": 51})
    c.book.credit.add(["peer-a"], tokens_generated=2)  # credit not written yet is shown at once
    statements.clear()
    stats = c.stats()
    assert statements == [] and stats["versions"][-1]["version"] == 50  # a busy table is re-read at most every 1 s
    assert stats["credit_totals"]["tokens_generated"] == 42 and stats["ledger"]["peer-a"]["tokens_generated"] == 42
    now[0] += REFRESH_S
    stats = c.stats()
    assert stats["versions"][-1]["version"] == 51 and stats["page"]["versions_total"] == 51
    assert len(statements) == 1 and "FROM versions" in statements[0] and "LIMIT" in statements[0]
    c.store.close()


def test_long_lists_come_a_bounded_page_at_a_time(tmp_path):
    c = _coordinator(tmp_path)
    _fill(c, 700)
    newest = c.stats_view.public()
    assert [v["version"] for v in newest["versions"]] == list(range(701 - DEFAULT_PAGE, 701))
    assert [s["version"] for s in newest["steps"]] == list(range(701 - DEFAULT_PAGE, 701))
    assert newest["page"] == {"after": None, "limit": DEFAULT_PAGE, "versions_total": 700, "evals_total": 3}
    assert newest["samples_trained"] == 2800
    longest = c.stats_view.public(StatsQuery.parse({"limit": str(MAX_PAGE)}))
    assert len(longest["versions"]) == MAX_PAGE and len(longest["steps"]) == MAX_PAGE
    walk = c.stats_view.public(StatsQuery.parse({"after": "10", "limit": "5"}))
    assert [v["version"] for v in walk["versions"]] == [11, 12, 13, 14, 15]
    assert [e["version"] for e in walk["evals"]] == [350, 700]  # evals after version 10 too
    assert [e["version"] for e in c.stats_view.public(StatsQuery.parse({"after": "0", "limit": "1"}))["evals"]] == [350]
    for query in ({"limit": str(MAX_PAGE + 1)}, {"limit": "0"}, {"after": "-1"}, {"after": "1e3"}, {"peer": "a b c d"},
                  {"page": "2"}):
        with pytest.raises(ValueError):
            StatsQuery.parse(query)
    c.store.close()


def test_a_contributor_sees_its_own_ledger_row_in_the_public_stats_and_nobody_elses(tmp_path):
    c = _coordinator(tmp_path)
    _fill(c, 1)
    c.store.upsert_peer("peer-b", "key-b", role="inference")
    c.book.credit.add(["peer-a"], microbatches_trained=3)
    mine = c.stats_view.public(StatsQuery(peer="peer-a"))
    assert "ledger" not in mine
    assert mine["credit"]["tokens_generated"] == 40 and mine["credit"]["microbatches_trained"] == 3
    assert mine["credit"]["self_reported"]["bytes_sent"] == 1e6 and mine["credit"]["role"] == "trainer"
    assert c.stats_view.public(StatsQuery(peer="nobody00"))["credit"] is None
    assert "credit" not in c.stats_view.public()
    c.store.close()
