import numpy as np
import pytest

from engine.swarm.store import Store


def _rollout(i, version=3):
    return dict(group_id=f"g{i // 2}", prompt="rev:123=", tokens=[5, 6, 7], behaviour_logprobs=[-0.1, -0.2, -0.3],
                versions=[version, version], min_version=version, reward=1.0, advantage=0.5)


def test_rollouts_survive_a_restart_of_the_store(tmp_path):
    store = Store(tmp_path / "c.db")
    ids = store.add_rollouts([_rollout(i) for i in range(4)])
    store.mark_rollouts(ids[:1], "consumed")
    store.record_version(1, reward_mean=0.2, samples=8)
    store.record_eval(1, 0.25, 100, content=0.5)
    store.add_credit({"peer": {"tokens_generated": 10}})
    store.add_self_reported("peer", bytes_sent=100)
    store.close()

    again = Store(tmp_path / "c.db")
    ready = again.ready_rollouts(10)
    assert [r.id for r in ready] == ids[1:]
    np.testing.assert_allclose(ready[0].behaviour_logprobs, [-0.1, -0.2, -0.3], rtol=1e-6)
    assert again.latest_version() == 1
    assert again.evals() == [{"version": 1, "accuracy": 0.25, "n": 100, "content": 0.5}]
    assert again.ledger()["peer"]["tokens_generated"] == 10
    assert again.ledger()["peer"]["self_reported"]["bytes_sent"] == 100
    assert again.ledger_totals() == {"verified": {"tokens_generated": 10, "microbatches_trained": 0,
                                                  "microbatches_forward": 0, "steps_applied": 0},
                                     "self_reported": {"bytes_sent": 100.0, "bytes_received": 0.0, "uptime_s": 0.0,
                                                       "gen_compute_s": 0.0}}


def test_a_database_from_before_content_scores_gains_the_column_and_reads_strict_as_content(tmp_path):
    import sqlite3

    store = Store(tmp_path / "c.db")
    store.close()
    db = sqlite3.connect(str(tmp_path / "c.db"))
    db.executescript("DROP TABLE evals; CREATE TABLE evals (version INTEGER PRIMARY KEY, accuracy REAL NOT NULL, "
                     "n INTEGER NOT NULL, created_at REAL NOT NULL); "
                     "INSERT INTO evals VALUES (0, 0.125, 64, 0.0);")
    db.close()
    again = Store(tmp_path / "c.db")
    again.record_eval(1, 0.25, 64, content=0.75)
    assert again.evals() == [{"version": 0, "accuracy": 0.125, "n": 64, "content": 0.125},
                             {"version": 1, "accuracy": 0.25, "n": 64, "content": 0.75}]
    again.close()


def test_versions_never_go_backwards(tmp_path):
    store = Store(tmp_path / "c.db")
    store.record_version(5, reward_mean=None, samples=0)
    with pytest.raises(ValueError):
        store.record_version(5, reward_mean=None, samples=0)
    with pytest.raises(ValueError):
        store.record_version(4, reward_mean=None, samples=0)


def test_stale_rollouts_are_dropped_and_counted(tmp_path):
    store = Store(tmp_path / "c.db")
    store.add_rollouts([_rollout(0, version=1), _rollout(1, version=6)])
    assert store.drop_stale(oldest_fresh_version=2) == {"g0": 1}
    assert store.rollout_counts() == {"dropped": 1, "ready": 1}


def test_ledger_rejects_unknown_or_negative_counters_and_self_reported_work_as_credit(tmp_path):
    store = Store(tmp_path / "c.db")
    with pytest.raises(ValueError):
        store.add_self_reported("p", points=1)
    with pytest.raises(ValueError):
        store.add_self_reported("p", bytes_sent=-1)
    with pytest.raises(ValueError):
        store.add_self_reported("p", tokens_generated=10)  # a node's own count of its work is never credit
    with pytest.raises(ValueError):
        store.add_credit({"p": {"bytes_sent": 1}})
    with pytest.raises(ValueError):
        store.add_credit({"p": {"tokens_generated": -1}})


def _sql_group_counts(store):
    rows = store._db.execute("SELECT group_id, COUNT(*) FROM rollouts WHERE state = 'ready' GROUP BY group_id")
    return dict(rows.fetchall())


def test_ready_group_counts_follow_every_state_change_and_a_reopen(tmp_path):
    store = Store(tmp_path / "c.db")
    ids = store.add_rollouts([_rollout(i, version=1 + i % 5) for i in range(12)])  # groups g0..g5, 2 each
    assert store.ready_group_count() == 6 and store.complete_group_count(2) == 6
    store.mark_rollouts(ids[:3], "consumed")         # g0 empty, g1 half
    store.mark_rollouts(ids[:1], "dropped")          # consumed -> dropped: no ready count changes
    store.mark_rollouts(ids[1:2], "ready")           # back to ready: g0 has one again
    dropped = store.drop_stale(oldest_fresh_version=3)  # min_version < 3 dropped
    expected_dropped: dict[str, int] = {}
    for i in range(12):
        if 1 + i % 5 < 3 and i not in (0, 2):
            expected_dropped[f"g{i // 2}"] = min(1 + i % 5, expected_dropped.get(f"g{i // 2}", 9))
    assert dropped == expected_dropped
    expected = _sql_group_counts(store)
    assert store.ready_group_count() == len(expected)
    assert store.complete_group_count(2) == sum(1 for n in expected.values() if n >= 2)
    assert store.complete_group_count(1) == len(expected)
    store.close()
    again = Store(tmp_path / "c.db")
    assert again.ready_group_count() == len(expected)
    assert again.complete_group_count(2) == sum(1 for n in expected.values() if n >= 2)
