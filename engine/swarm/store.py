"""The coordinator's durable state in SQLite: peers, ledger, rollouts, versions, evals.

Everything the coordinator must not forget across a restart lives here: the
policy version, completed rollouts (the replay buffer's contents, so a finished
rollout is never lost), the contribution ledger (verified credit and self-reported figures,
``engine.swarm.ledger``), eval history and run metadata.
Peers carry their role (trainer or inference replica) so the ledger shows it.
It is used from the coordinator's event-loop thread only; each call is one short
transaction on a local file (WAL mode). The store is the only writer of its file, so it
mirrors in memory what is asked often and would otherwise be counted over a whole table
(loaded when it opens, kept by every write): ready rollouts per group (the scheduler asks on
every tick), rollouts per state, the number of versions and evals and the samples trained,
and the ledger's totals. ``changes`` counts the writes to each table, so a reader can cache
what it read until the table changes (``engine.swarm.stats_view``). Long lists are read a page
at a time along their primary key (``version_page``, ``eval_page``).

Storage fails closed. A write that SQLite refuses for lack of space or an I/O error (a
full disk, ``SQLITE_FULL``) raises :class:`StoreUnavailable` and marks the store
unwritable; :meth:`Store.writable` says whether writes work again (it retries one) so the
coordinator can pause what needs storage (ingesting rollouts, training) and resume by
itself. ``set_meta`` never raises for that reason: the value is kept in memory, served by
``get_meta``, and written as soon as the disk takes writes again, so the policy version and
the like are never lost to a full disk while the process lives. Commits are durable
(``synchronous=FULL``: the WAL is fsynced at every commit), not only atomic.

It knows nothing about HTTP, WebRTC, tensors or how rewards are computed.
"""

from __future__ import annotations

import functools
import json
import logging
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

import numpy as np

from engine.swarm import ledger as ledger_tables

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
#: what a stored rollout can be: waiting in the replay buffer, trained on, or dropped (stale / no signal)
#: "quarantined": a step failed on it (``engine.swarm.step_runner``); kept for inspection, never trained
ROLLOUT_STATES = ("ready", "consumed", "dropped", "quarantined")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS peers (
    peer_id TEXT PRIMARY KEY, public_key TEXT NOT NULL, first_seen REAL NOT NULL,
    last_seen REAL NOT NULL, backend TEXT, device TEXT, stage INTEGER, role TEXT);
CREATE TABLE IF NOT EXISTS rollouts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, group_id TEXT NOT NULL, prompt TEXT NOT NULL,
    tokens TEXT NOT NULL, behaviour_logprobs BLOB NOT NULL, versions TEXT NOT NULL,
    min_version INTEGER NOT NULL, reward REAL NOT NULL, advantage REAL NOT NULL,
    state TEXT NOT NULL DEFAULT 'ready', created_at REAL NOT NULL, loss_mask BLOB, generator TEXT);
CREATE INDEX IF NOT EXISTS rollouts_state ON rollouts(state, min_version);
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY, created_at REAL NOT NULL, reward_mean REAL,
    samples INTEGER NOT NULL DEFAULT 0, info TEXT);
CREATE TABLE IF NOT EXISTS evals (
    version INTEGER PRIMARY KEY, accuracy REAL NOT NULL, n INTEGER NOT NULL, created_at REAL NOT NULL,
    content REAL);
""" + ledger_tables.SCHEMA

#: SQLite result codes (``sqlite3.Error.sqlite_errorcode``, low byte) that mean "storage is failing"
_STORAGE_CODES = {10, 13, 14}  # SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN
#: seconds between retries of a failing store (``Store.writable``)
RETRY_S = 1.0
#: bytes the retry writes (and rolls back): writes work again when this much fits
PROBE_BYTES = 256 * 1024

F = TypeVar("F", bound=Callable[..., Any])


class StoreUnavailable(RuntimeError):
    """The database refused a write for lack of space or an I/O error; nothing was written."""


def _storage_failure(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _STORAGE_CODES
    text = str(exc).lower()
    return "disk is full" in text or "disk i/o error" in text


def _writes(method: F) -> F:
    """A write: a storage failure becomes :class:`StoreUnavailable` and starts an outage."""
    @functools.wraps(method)
    def wrapper(self: "Store", *args: Any, **kwargs: Any) -> Any:
        try:
            result = method(self, *args, **kwargs)
        except sqlite3.Error as exc:
            if not _storage_failure(exc):
                raise
            self._failed(exc)
            raise StoreUnavailable(f"{self.path}: {exc}") from exc
        return result  # a small write may fit where a batch does not: only the probe ends an outage
    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class StoredRollout:
    """One completed, scored sample as kept in the replay buffer."""

    id: int
    group_id: str
    prompt: str
    tokens: list[int]
    behaviour_logprobs: np.ndarray
    versions: list[int]
    min_version: int
    reward: float
    advantage: float
    #: 1 on the model's own tokens (trained), 0 on context (tool, observation, template) ids; None: all 1
    loss_mask: np.ndarray | None = None
    #: peer id of the node that sampled it (its route's last stage); None: unknown or several
    generator: str | None = None


def _mask_blob(mask: Any, tokens: int) -> bytes | None:
    """A loss mask as stored (one byte per token), or None when every token is the model's."""
    if mask is None:
        return None
    arr = np.asarray(mask, dtype=np.uint8)
    if arr.shape != (tokens,) or arr.max(initial=0) > 1:
        raise ValueError(f"a loss mask is one 0/1 per token ({tokens}), got shape {arr.shape}")
    return None if arr.all() else arr.tobytes()


def _check_counts(counts: Mapping[str, float], allowed: tuple[str, ...]) -> None:
    unknown = set(counts) - set(allowed)
    if unknown:
        raise ValueError(f"unknown ledger counters: {sorted(unknown)} (known: {', '.join(allowed)})")
    if any(not v >= 0 for v in counts.values()):  # NaN too
        raise ValueError("ledger increments must be non-negative")


class Store:
    """A coordinator database at ``path`` (created if missing)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # fsync at every commit: a power cut loses nothing committed
        #: why writes fail now (None: they work); see ``writable``
        self.write_error: str | None = None
        self._pending_meta: dict[str, Any] = {}  #: set_meta values the disk did not take yet
        self._next_retry = 0.0
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(peers)")}
        if "role" not in columns:  # databases from before inference replicas: an additive column
            self._db.execute("ALTER TABLE peers ADD COLUMN role TEXT")
        if "content" not in {row[1] for row in self._db.execute("PRAGMA table_info(evals)")}:
            self._db.execute("ALTER TABLE evals ADD COLUMN content REAL")  # before chat tasks: additive too
        if "loss_mask" not in {row[1] for row in self._db.execute("PRAGMA table_info(rollouts)")}:
            self._db.execute("ALTER TABLE rollouts ADD COLUMN loss_mask BLOB")  # before multi-turn episodes
        if "generator" not in {row[1] for row in self._db.execute("PRAGMA table_info(rollouts)")}:
            self._db.execute("ALTER TABLE rollouts ADD COLUMN generator TEXT")  # before log-prob audits
        ledger_tables.migrate(self._db)  # before verified credit: self-reported columns only
        found = self.get_meta("schema_version")
        if found is None:
            self.set_meta("schema_version", SCHEMA_VERSION)
        elif found != SCHEMA_VERSION:
            raise RuntimeError(f"{self.path}: database schema {found} is not {SCHEMA_VERSION}; "
                               "start with a new --db path")
        #: writes to each table since the store opened (a reader caches until its table's count moves)
        self.changes: Counter[str] = Counter()
        #: group id -> its rollouts in state 'ready' (only groups with at least one)
        self._ready: Counter[str] = Counter()
        #: rollouts per state
        self._states: Counter[str] = Counter()
        self._load_ready_counts()
        count, samples = self._db.execute("SELECT COUNT(*), COALESCE(SUM(samples), 0) FROM versions").fetchone()
        self._versions, self._samples_trained = int(count), int(samples)
        self._evals = int(self._db.execute("SELECT COUNT(*) FROM evals").fetchone()[0])
        #: sums over every peer of its verified credit and of its self-reported figures
        self._verified_totals: Counter[str] = Counter()
        self._reported_totals: Counter[str] = Counter()
        for row in ledger_tables.read_ledger(self._db).values():
            self._verified_totals.update({c: row[c] for c in ledger_tables.VERIFIED})
            self._reported_totals.update(row["self_reported"])

    def _unready(self, rows: Iterable[tuple[str]]) -> int:
        """Count rollouts (``(group_id,)`` rows) that just left the 'ready' state; returns how many."""
        n = 0
        for (group_id,) in rows:
            n += 1
            self._ready[group_id] -= 1
            if self._ready[group_id] <= 0:
                del self._ready[group_id]
        return n

    def close(self) -> None:
        if self._pending_meta:
            self.writable(force=True)
        if self._pending_meta:
            log.error("closing %s with %d settings the disk did not take (%s): they are lost", self.path,
                      len(self._pending_meta), ", ".join(sorted(self._pending_meta)))
        self._db.close()

    def _rollback(self) -> None:
        """Undo the open transaction (SQLite may have undone it already, e.g. on SQLITE_FULL)."""
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    # -- failing storage -------------------------------------------------------
    def _failed(self, exc: Exception) -> None:
        if self.write_error is None:
            log.error("the coordinator database %s refuses writes (%s): ingestion and training pause "
                      "until it takes them again; free disk space", self.path, exc)
        self.write_error = str(exc)
        self._next_retry = time.monotonic() + RETRY_S

    def _recovered(self) -> None:
        log.warning("the coordinator database %s takes writes again; resuming", self.path)
        self.write_error = None

    def writable(self, *, force: bool = False) -> bool:
        """Whether writes work; while they fail, retry the writes kept in memory (at most every
        ``RETRY_S`` unless ``force``) and say whether they went through."""
        if self.write_error is None and not self._pending_meta:
            return True
        if not force and time.monotonic() < self._next_retry:
            return False
        try:
            if self.write_error is not None:
                self._probe()  # about a batch of rollouts: a tiny write fits in a page's slack
                self._recovered()
            if self._pending_meta:
                self._flush_meta()
        except StoreUnavailable:
            return False
        return True

    @_writes
    def _probe(self) -> None:
        self._db.execute("BEGIN")
        try:
            self._write_meta("store_probe", "x" * PROBE_BYTES)
        finally:
            self._rollback()  # the space it took stays in the file for the next real write

    @_writes
    def _flush_meta(self) -> None:
        for key in list(self._pending_meta):
            self._write_meta(key, self._pending_meta[key])
            del self._pending_meta[key]

    # -- metadata ------------------------------------------------------------
    def get_meta(self, key: str, default: Any = None) -> Any:
        if key in self._pending_meta:
            return self._pending_meta[key]
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def set_meta(self, key: str, value: Any) -> None:
        """Store ``value`` (JSON); with the disk failing, keep it in memory until it takes writes."""
        try:
            self._set_meta_now(key, value)
            self._pending_meta.pop(key, None)
        except StoreUnavailable:
            self._pending_meta[key] = json.loads(json.dumps(value))

    @_writes
    def _set_meta_now(self, key: str, value: Any) -> None:
        self._write_meta(key, value)

    def _write_meta(self, key: str, value: Any) -> None:
        self._db.execute("INSERT INTO meta(key, value) VALUES(?, ?) "
                         "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                         (key, json.dumps(value)))

    # -- peers and ledger (engine.swarm.ledger) -------------------------------------
    @_writes
    def upsert_peer(self, peer_id: str, public_key: str, *, backend: str | None = None,
                    device: str | None = None, stage: int | None = None, role: str | None = None) -> None:
        now = time.time()
        self._db.execute(
            "INSERT INTO peers(peer_id, public_key, first_seen, last_seen, backend, device, stage, role) "
            "VALUES(?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(peer_id) DO UPDATE SET last_seen = excluded.last_seen, "
            "backend = excluded.backend, device = excluded.device, stage = excluded.stage, role = excluded.role",
            (peer_id, public_key, now, now, backend, device, stage, role))
        self._db.execute("INSERT OR IGNORE INTO ledger(peer_id) VALUES(?)", (peer_id,))
        self.changes["ledger"] += 1

    @_writes
    def add_credit(self, credit: Mapping[str, Mapping[str, int]]) -> None:
        """Add verified credit (``{peer: {counter: n}}``, counters of ``ledger.VERIFIED``) in one transaction."""
        for counts in credit.values():
            _check_counts(counts, ledger_tables.VERIFIED)
        self._db.execute("BEGIN")
        try:
            for peer_id, counts in credit.items():
                counts = {k: int(v) for k, v in counts.items() if v}
                if counts:
                    self._increment("credit", peer_id, counts)
            self._db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        for counts in credit.values():
            self._verified_totals.update({k: int(v) for k, v in counts.items()})
        self.changes["ledger"] += 1

    @_writes
    def add_self_reported(self, peer_id: str, **counts: float) -> None:
        """Add what a node reported of itself (counters of ``ledger.SELF_REPORTED``); never credit."""
        _check_counts(counts, ledger_tables.SELF_REPORTED)
        counts = {k: float(v) for k, v in counts.items() if v}
        if not counts:
            return
        self._increment("ledger", peer_id, counts)
        self._reported_totals.update(counts)
        self.changes["ledger"] += 1

    def _increment(self, table: str, peer_id: str, counts: Mapping[str, float]) -> None:
        self._db.execute("INSERT OR IGNORE INTO ledger(peer_id) VALUES(?)", (peer_id,))  # every peer has a row
        self._db.execute(f"INSERT OR IGNORE INTO {table}(peer_id) VALUES(?)", (peer_id,))
        assignments = ", ".join(f"{name} = {name} + ?" for name in counts)
        self._db.execute(f"UPDATE {table} SET {assignments} WHERE peer_id = ?", (*counts.values(), peer_id))

    def ledger(self) -> dict[str, dict[str, Any]]:
        """Every peer's ledger row (``engine.swarm.ledger``): its last known ``role``, its verified
        credit and, under ``self_reported``, what it said of itself. Reads the whole table."""
        return ledger_tables.read_ledger(self._db)

    def ledger_row(self, peer_id: str) -> dict[str, Any] | None:
        """``peer_id``'s ledger row (one indexed read), or None for a peer never seen."""
        return ledger_tables.read_ledger(self._db, peer_id).get(peer_id)

    def ledger_totals(self) -> dict[str, dict[str, float]]:
        """Sums over every peer: ``verified`` credit and ``self_reported`` figures (kept in memory)."""
        return {"verified": {c: int(self._verified_totals[c]) for c in ledger_tables.VERIFIED},
                "self_reported": {c: float(self._reported_totals[c]) for c in ledger_tables.SELF_REPORTED}}

    # -- rollouts (replay buffer contents) -----------------------------------------
    @_writes
    def add_rollouts(self, rollouts: Iterable[dict[str, Any]]) -> list[int]:
        """Insert scored samples (state 'ready'); each dict has the fields of
        :class:`StoredRollout` but ``id`` (``loss_mask`` optional: without it every token is the model's;
        ``generator`` optional)."""
        ids, groups = [], []
        now = time.time()
        self._db.execute("BEGIN")
        try:
            for r in rollouts:
                cur = self._db.execute(
                    "INSERT INTO rollouts(group_id, prompt, tokens, behaviour_logprobs, versions, min_version, "
                    "reward, advantage, created_at, loss_mask, generator) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (r["group_id"], r["prompt"], json.dumps([int(t) for t in r["tokens"]]),
                     np.asarray(r["behaviour_logprobs"], dtype=np.float32).tobytes(),
                     json.dumps([int(v) for v in r["versions"]]), int(r["min_version"]),
                     float(r["reward"]), float(r["advantage"]), now, _mask_blob(r.get("loss_mask"), len(r["tokens"])),
                     r.get("generator")))
                ids.append(int(cur.lastrowid))
                groups.append(r["group_id"])
            self._db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        self._ready.update(groups)
        self._states["ready"] += len(groups)
        return ids

    def ready_rollouts(self, limit: int) -> list[StoredRollout]:
        rows = self._db.execute(
            "SELECT id, group_id, prompt, tokens, behaviour_logprobs, versions, min_version, reward, advantage, "
            "loss_mask, generator FROM rollouts WHERE state = 'ready' ORDER BY id LIMIT ?", (int(limit),)).fetchall()
        return [StoredRollout(id=r[0], group_id=r[1], prompt=r[2], tokens=json.loads(r[3]),
                              behaviour_logprobs=np.frombuffer(r[4], dtype=np.float32).copy(),
                              versions=json.loads(r[5]), min_version=r[6], reward=r[7], advantage=r[8],
                              loss_mask=None if r[9] is None else np.frombuffer(r[9], dtype=np.uint8).astype(bool),
                              generator=r[10])
                for r in rows]

    def ready_group_count(self) -> int:
        """Groups with at least one ready rollout."""
        return len(self._ready)

    def complete_group_count(self, group_size: int) -> int:
        """Groups with at least ``group_size`` ready rollouts."""
        return sum(1 for n in self._ready.values() if n >= group_size)

    @_writes
    def mark_rollouts(self, ids: Iterable[int], state: str) -> None:
        if state not in ROLLOUT_STATES:
            raise ValueError(f"unknown rollout state {state!r}")
        ids = list(dict.fromkeys(int(i) for i in ids))  # each once: the counts follow the rows that moved
        moved: list[tuple[str, str]] = []  #: (group, state it left) of every rollout that changes state
        self._db.execute("BEGIN")
        try:
            for at in range(0, len(ids), 500):  # well under SQLite's bound-parameter limit
                chunk = ids[at:at + 500]
                marks = ",".join("?" * len(chunk))
                moved += self._db.execute(f"SELECT group_id, state FROM rollouts WHERE state != ? AND id IN ({marks})",
                                          (state, *chunk)).fetchall()
                self._db.execute(f"UPDATE rollouts SET state = ? WHERE state != ? AND id IN ({marks})",
                                 (state, state, *chunk))
            self._db.execute("COMMIT")
        except BaseException:
            self._rollback()
            self._load_ready_counts()
            raise
        self._unready((group,) for group, before in moved if before == "ready")
        if state == "ready":
            self._ready.update(group for group, _ in moved)
        self._states.subtract(before for _, before in moved)
        self._states[state] += len(moved)

    def _load_ready_counts(self) -> None:
        self._ready = Counter(dict(self._db.execute(
            "SELECT group_id, COUNT(*) FROM rollouts WHERE state = 'ready' GROUP BY group_id").fetchall()))
        self._states = Counter(dict(self._db.execute("SELECT state, COUNT(*) FROM rollouts GROUP BY state").fetchall()))

    @_writes
    def drop_stale(self, oldest_fresh_version: int) -> dict[str, int]:
        """Mark ready rollouts from a policy older than ``oldest_fresh_version`` as dropped.

        Returns ``{group_id: its oldest min_version}`` of the groups that lost rollouts."""
        rows = self._db.execute(
            "UPDATE rollouts SET state = 'dropped' WHERE state = 'ready' AND min_version < ? "
            "RETURNING group_id, min_version", (int(oldest_fresh_version),)).fetchall()
        self._unready((group_id,) for group_id, _ in rows)
        self._states["ready"] -= len(rows)
        self._states["dropped"] += len(rows)
        groups: dict[str, int] = {}
        for group_id, min_version in rows:
            groups[group_id] = min(int(min_version), groups.get(group_id, int(min_version)))
        return groups

    def rollout_counts(self) -> dict[str, int]:
        """Rollouts per state (states with none left out); kept in memory, no query."""
        return {state: n for state, n in sorted(self._states.items()) if n > 0}

    # -- versions and evals ----------------------------------------------------------
    @_writes
    def record_version(self, version: int, *, reward_mean: float | None, samples: int,
                       info: dict[str, Any] | None = None) -> None:
        latest = self.latest_version()
        if latest is not None and version <= latest:
            raise ValueError(f"policy version {version} does not advance past {latest}")
        self._db.execute("INSERT INTO versions(version, created_at, reward_mean, samples, info) VALUES(?, ?, ?, ?, ?)",
                         (int(version), time.time(), reward_mean, int(samples), json.dumps(info or {})))
        self._versions += 1
        self._samples_trained += int(samples)
        self.changes["versions"] += 1

    def latest_version(self) -> int | None:
        row = self._db.execute("SELECT MAX(version) FROM versions").fetchone()
        return row[0]

    def version_count(self) -> int:
        """Versions recorded (kept in memory)."""
        return self._versions

    def samples_trained(self) -> int:
        """Rows trained over every recorded version (kept in memory)."""
        return self._samples_trained

    _VERSION_COLUMNS = "version, created_at, reward_mean, samples, info"

    @staticmethod
    def _version_row(r: tuple) -> dict[str, Any]:
        return dict(version=r[0], created_at=r[1], reward=r[2], samples=r[3], info=json.loads(r[4] or "{}"))

    def version_page(self, after: int | None, limit: int) -> list[dict[str, Any]]:
        """At most ``limit`` recorded versions, oldest first: those after version ``after``, or (None)
        the newest. Each: version, created_at, reward, samples, info (the step's figures)."""
        return [self._version_row(r) for r in _page(self._db, "versions", self._VERSION_COLUMNS, after, limit)]

    def versions_of(self, versions: Iterable[int]) -> list[dict[str, Any]]:
        """The recorded ones among ``versions`` (read by key), oldest first."""
        wanted = sorted({int(v) for v in versions})
        rows: list[dict[str, Any]] = []
        for at in range(0, len(wanted), 500):
            chunk = wanted[at:at + 500]
            rows += [self._version_row(r) for r in self._db.execute(
                f"SELECT {self._VERSION_COLUMNS} FROM versions WHERE version IN ({','.join('?' * len(chunk))}) "
                "ORDER BY version", chunk)]
        return rows

    @_writes
    def record_eval(self, version: int, accuracy: float, n: int, *, content: float | None = None) -> None:
        """``accuracy``: the strict score; ``content``: the content-only score (None: same as strict)."""
        content = accuracy if content is None else content
        known = self._db.execute("SELECT 1 FROM evals WHERE version = ?", (int(version),)).fetchone() is not None
        self._db.execute("INSERT OR REPLACE INTO evals(version, accuracy, n, created_at, content) "
                         "VALUES(?, ?, ?, ?, ?)", (int(version), float(accuracy), int(n), time.time(), float(content)))
        self._evals += 0 if known else 1
        self.changes["evals"] += 1

    @staticmethod
    def _eval_row(r: tuple) -> dict[str, Any]:
        return dict(version=r[0], accuracy=r[1], n=r[2], content=r[1] if r[3] is None else r[3])

    def evals(self) -> list[dict[str, Any]]:
        """Every eval, oldest version first: version, accuracy (strict), content, n."""
        rows = self._db.execute("SELECT version, accuracy, n, content FROM evals ORDER BY version").fetchall()
        return [self._eval_row(r) for r in rows]

    def eval_page(self, after: int | None, limit: int) -> list[dict[str, Any]]:
        """At most ``limit`` evals, oldest first: of versions after ``after``, or (None) the newest."""
        return [self._eval_row(r) for r in _page(self._db, "evals", "version, accuracy, n, content", after, limit)]

    def eval_count(self) -> int:
        """Evals recorded (kept in memory)."""
        return self._evals


def _page(db: sqlite3.Connection, table: str, columns: str, after: int | None, limit: int) -> list[tuple]:
    """Rows of ``table`` (keyed by ``version``) in a range of its primary key, oldest first: at most
    ``limit`` after version ``after``, or (None) the newest ``limit``. An index range read, never a scan."""
    if limit <= 0:
        return []
    if after is None:
        rows = db.execute(f"SELECT {columns} FROM {table} ORDER BY version DESC LIMIT ?", (int(limit),)).fetchall()
        return rows[::-1]
    return db.execute(f"SELECT {columns} FROM {table} WHERE version > ? ORDER BY version LIMIT ?",
                      (int(after), int(limit))).fetchall()
