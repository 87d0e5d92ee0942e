"""Finding 8 of issue 14: a coordinator database that runs out of space fails closed and recovers.

A real SQLite file whose size is capped with ``PRAGMA max_page_count`` gives the real
``SQLITE_FULL`` ("database or disk is full") a full disk gives, without a tmpfs.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.swarm.store import Store, StoreUnavailable


def _rollouts(n: int, group: str = "g", tokens: int = 200) -> list[dict]:
    return [dict(group_id=group, prompt="p" * 50, tokens=list(range(tokens)),
                 behaviour_logprobs=np.full(tokens, -0.5, np.float32), versions=[3, 3], min_version=3,
                 reward=1.0, advantage=0.5) for _ in range(n)]


def _fill(store: Store) -> None:
    """Cap the file at its current size and write until SQLite says it is full."""
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages + 2}")
    with pytest.raises(StoreUnavailable, match="full"):
        for i in range(1000):
            store.add_rollouts(_rollouts(20, group=f"fill{i}"))


def test_a_full_database_refuses_writes_keeps_meta_in_memory_and_resumes_when_space_returns(tmp_path):
    store = Store(tmp_path / "c.db")
    store.add_rollouts(_rollouts(4))
    _fill(store)
    assert store.write_error and not store.writable(force=True)
    ready = store.complete_group_count(4)
    with pytest.raises(StoreUnavailable):
        store.add_rollouts(_rollouts(20, group="late"))
    assert store.complete_group_count(4) == ready  # the in-memory counts did not move either
    store.set_meta("version", 7)  # never raises for a full disk: kept, and read back
    assert store.get_meta("version") == 7
    store._db.execute("PRAGMA max_page_count = 1000000")  # space is back
    assert store.writable(force=True) and store.write_error is None
    store.add_rollouts(_rollouts(4, group="after"))
    store.close()
    reopened = Store(tmp_path / "c.db")
    assert reopened.get_meta("version") == 7  # what was kept in memory reached the file
    assert reopened.complete_group_count(4) == ready + 1
    reopened.close()


def test_errors_that_are_not_about_storage_still_raise_as_themselves(tmp_path):
    store = Store(tmp_path / "c.db")
    store.record_version(1, reward_mean=0.0, samples=1)
    with pytest.raises(ValueError):
        store.record_version(1, reward_mean=0.0, samples=1)
    assert store.write_error is None and store.writable()
    store.close()
