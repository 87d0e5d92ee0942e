"""The contribution ledger's two halves and how they are stored: verified credit, self-reported figures.

Two tables of the coordinator's database (``engine.swarm.store`` owns the connection and the writes):

* ``credit`` — work the coordinator observed or verified itself, per peer (:data:`VERIFIED`):
  ``tokens_generated`` (tokens of generation results it accepted, credited to every node of the
  job's route: each stage computed every token), ``microbatches_trained`` and
  ``microbatches_forward`` (training / forward-only micro-batches it saw complete on the node's
  route), ``steps_applied`` (``stepped`` reports whose full-weight digest is the one its stage's
  vote decided);
* ``ledger`` — figures only the node itself can know, as it reported them (:data:`SELF_REPORTED`:
  bytes on its peer links, its uptime, its generation compute seconds). They are shown apart
  (``self_reported``) and never added to the credit. Databases from before the split also hold
  the nodes' own token and micro-batch claims in that table; nothing reads them.

A ledger row (:func:`read_ledger`) is ``{"role", <each VERIFIED counter>, "self_reported": {...}}``.
What it does not know: messages, sockets, how work is verified (its callers do that).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any

#: credit the coordinator gives for work it observed or verified (``credit`` table)
VERIFIED = ("tokens_generated", "microbatches_trained", "microbatches_forward", "steps_applied")
#: what a node's ``report`` says of itself (``ledger`` table): kept, labelled, never credited
SELF_REPORTED = ("bytes_sent", "bytes_received", "uptime_s", "gen_compute_s")

SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    peer_id TEXT PRIMARY KEY, bytes_sent REAL NOT NULL DEFAULT 0, bytes_received REAL NOT NULL DEFAULT 0,
    uptime_s REAL NOT NULL DEFAULT 0, gen_compute_s REAL NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS credit (
    peer_id TEXT PRIMARY KEY, tokens_generated INTEGER NOT NULL DEFAULT 0,
    microbatches_trained INTEGER NOT NULL DEFAULT 0, microbatches_forward INTEGER NOT NULL DEFAULT 0,
    steps_applied INTEGER NOT NULL DEFAULT 0);
"""


def migrate(db: sqlite3.Connection) -> None:
    """Bring a ledger table from before the split up to date (additive: its old columns stay, unread)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(ledger)")}
    for name in SELF_REPORTED:
        if name not in columns:
            db.execute(f"ALTER TABLE ledger ADD COLUMN {name} REAL NOT NULL DEFAULT 0")


def empty_row(role: str | None = None) -> dict[str, Any]:
    """A peer's ledger row before any work."""
    return {"role": role, **dict.fromkeys(VERIFIED, 0), "self_reported": dict.fromkeys(SELF_REPORTED, 0.0)}


def read_ledger(db: sqlite3.Connection, peer_id: str | None = None) -> dict[str, dict[str, Any]]:
    """Every peer's ledger row (or only ``peer_id``'s), by peer id. Reads databases of any Polis
    version (``polis export`` opens old runs read-only): a missing table or column reads as 0."""
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "ledger" not in tables:
        return {}
    have = {row[1] for row in db.execute("PRAGMA table_info(ledger)")}
    reported = ", ".join(f"ledger.{c}" if c in have else "0" for c in SELF_REPORTED)
    has_credit = "credit" in tables
    verified = ", ".join(f"COALESCE(credit.{c}, 0)" if has_credit else "0" for c in VERIFIED)
    role = "peers.role" if "peers" in tables else "NULL"
    sql = (f"SELECT ledger.peer_id, {verified}, {reported}, {role} FROM ledger"
           + (" LEFT JOIN credit ON credit.peer_id = ledger.peer_id" if has_credit else "")
           + (" LEFT JOIN peers ON peers.peer_id = ledger.peer_id" if "peers" in tables else ""))
    rows = db.execute(sql + " WHERE ledger.peer_id = ?", (peer_id,)) if peer_id is not None \
        else db.execute(sql + " ORDER BY ledger.peer_id")
    out: dict[str, dict[str, Any]] = {}
    n = len(VERIFIED)
    for row in rows:
        out[row[0]] = {"role": row[-1], **{c: int(v) for c, v in zip(VERIFIED, row[1:1 + n])},
                       "self_reported": {c: float(v) for c, v in zip(SELF_REPORTED, row[1 + n:-1])}}
    return out


def with_pending(row: Mapping[str, Any], pending: Mapping[str, int]) -> dict[str, Any]:
    """``row`` (a ledger row or :func:`empty_row`) plus verified credit not written yet."""
    return {**row, **{c: int(row.get(c, 0)) + int(pending.get(c, 0)) for c in VERIFIED}}
