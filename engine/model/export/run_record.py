"""A finished (or running) swarm run on this machine, as its coordinator's database records it.

A local run directory is what ``polis demo --run-dir DIR`` (or a coordinator started with
``--db DIR/coordinator.db`` and nodes with ``--data-dir DIR/nodeN``) leaves behind:
``coordinator.db`` (``engine.swarm.store``) and, under each node's data directory,
``stages/<run_id>/stage<k>.safetensors`` — the stage checkpoints the stage leaders wrote
(``engine.swarm.stage_runtime.StageRuntime.save_stage``; the newest one only, every
``checkpoint_every_versions``). :class:`RunRecord` reads the database (never writes to
it): the run config, the stage count, the run id, the checkpoint paths the leaders
reported, and the figures a model card states (peers and their backends, versions,
samples, evals, bytes on the wire, wall clock, staleness).

What it does not know: tensors (``stage_files`` reads the checkpoints), output formats.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.model.errors import CheckpointError
from engine.rl.tasks import TaskConfig
from engine.swarm.ledger import read_ledger

DB_FILE = "coordinator.db"


@dataclass(frozen=True)
class PeerRecord:
    """One node that joined the run: its id, role, stage and compute."""

    peer_id: str
    role: str | None
    stage: int | None
    backend: str | None
    device: str | None
    first_seen: float
    last_seen: float


@dataclass(frozen=True)
class RunRecord:
    """What the coordinator's database says about a run (see the module docstring)."""

    run_dir: Path
    db_path: Path
    run: dict[str, Any]  #: the RunConfig as the database holds it (``RunConfig.to_dict``)
    num_stages: int
    run_id: str
    stage_checkpoints: dict[int, str]  #: stage -> the file its leader last reported writing
    latest_version: int
    versions: list[dict[str, Any]]  #: per version: version, created_at, reward, samples, info
    evals: list[dict[str, Any]]  #: the swarm's own held-out evals: version, accuracy, n
    ledger: dict[str, dict[str, Any]]
    peers: list[PeerRecord]
    rollout_counts: dict[str, int]
    staleness: dict[str, Any]  #: histogram and what it counts (see :meth:`_staleness`)
    base_checkpoint: str | None  #: the base the run was cut from, if the database names it
    #: where the record was read: None for a local database, the coordinator's URL for ``from_dict``
    origin: str | None = None

    @property
    def source(self) -> str:
        """Where the run was read from, in words: the coordinator's URL or the run directory."""
        return self.origin or str(self.run_dir)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: what a coordinator's export API sends (``from_dict`` reads it back)."""
        return {"run": self.run, "num_stages": self.num_stages, "run_id": self.run_id,
                "stage_checkpoints": {str(k): v for k, v in self.stage_checkpoints.items()},
                "latest_version": self.latest_version, "versions": self.versions, "evals": self.evals,
                "ledger": self.ledger, "peers": [vars(p) for p in self.peers], "rollout_counts": self.rollout_counts,
                "staleness": self.staleness, "base_checkpoint": self.base_checkpoint}

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str) -> "RunRecord":
        """A record a coordinator sent (``to_dict``); raises CheckpointError when it is not one."""
        try:
            return cls(run_dir=Path("."), db_path=Path(DB_FILE), run=dict(data["run"]),
                       num_stages=int(data["num_stages"]), run_id=str(data["run_id"]),
                       stage_checkpoints={int(k): str(v) for k, v in dict(data["stage_checkpoints"]).items()},
                       latest_version=int(data["latest_version"]),
                       versions=[dict(version=int(v["version"]), created_at=float(v["created_at"]),
                                      reward=v["reward"], samples=v["samples"], info=dict(v["info"] or {}))
                                 for v in data["versions"]],
                       evals=[dict(e) for e in data["evals"]],
                       ledger={str(k): dict(v) for k, v in dict(data["ledger"]).items()},
                       peers=[PeerRecord(**p) for p in data["peers"]],
                       rollout_counts={str(k): int(v) for k, v in dict(data["rollout_counts"]).items()},
                       staleness=dict(data["staleness"]), base_checkpoint=data.get("base_checkpoint"), origin=origin)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(Path(DB_FILE), f"the run record from {origin} is not one ({exc!r}); "
                                                 "is the coordinator running this Polis version?") from None

    @property
    def task(self) -> TaskConfig:
        task = dict(self.run.get("task") or {})
        return TaskConfig(**task)

    @property
    def samples(self) -> int:
        return int(sum(v["samples"] or 0 for v in self.versions))

    @property
    def bytes_on_wire(self) -> int:
        """Bytes the nodes say they sent on peer links (self-reported: nobody else counts them)."""
        return int(sum((p.get("self_reported") or {}).get("bytes_sent") or 0 for p in self.ledger.values()))

    @property
    def wall_clock_s(self) -> float | None:
        stamps = [p.first_seen for p in self.peers] + [v["created_at"] for v in self.versions]
        stamps += [p.last_seen for p in self.peers]
        return (max(stamps) - min(stamps)) if stamps else None

    @classmethod
    def open(cls, run_dir: str | Path) -> "RunRecord":
        """Read the run at ``run_dir`` (a directory holding ``coordinator.db``, or the .db file itself)."""
        run_dir = Path(run_dir)
        db_path = run_dir if run_dir.is_file() else run_dir / DB_FILE
        if not db_path.is_file():
            raise CheckpointError(db_path, "no coordinator database here; pass the directory given to "
                                           "`polis demo --run-dir` (or the coordinator's --db file)")
        try:
            db = sqlite3.connect(f"file:{db_path.resolve()}?mode=ro", uri=True)
        except sqlite3.Error as exc:
            raise CheckpointError(db_path, f"cannot be opened read-only ({exc})") from None
        try:
            return cls._read(run_dir if run_dir.is_dir() else run_dir.parent, db_path, db)
        except (sqlite3.Error, ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(db_path, f"not a readable Polis coordinator database ({exc})") from None
        finally:
            db.close()

    @classmethod
    def _read(cls, run_dir: Path, db_path: Path, db: sqlite3.Connection) -> "RunRecord":
        meta = {key: json.loads(value) for key, value in db.execute("SELECT key, value FROM meta")}
        if "run" not in meta or "num_stages" not in meta:
            raise CheckpointError(db_path, "holds no run yet (the coordinator never started one)")
        versions = [dict(version=r[0], created_at=r[1], reward=r[2], samples=r[3], info=json.loads(r[4] or "{}"))
                    for r in db.execute("SELECT version, created_at, reward_mean, samples, info FROM versions "
                                        "ORDER BY version")]
        evals = [dict(version=r[0], accuracy=r[1], n=r[2])
                 for r in db.execute("SELECT version, accuracy, n FROM evals ORDER BY version")]
        ledger = read_ledger(db)  # verified credit, and what each node said of itself (engine.swarm.ledger)
        peers = [PeerRecord(*r) for r in db.execute(
            "SELECT peer_id, role, stage, backend, device, first_seen, last_seen FROM peers ORDER BY first_seen")]
        counts = {state: n for state, n in db.execute("SELECT state, COUNT(*) FROM rollouts GROUP BY state")}
        return cls(run_dir=run_dir, db_path=db_path, run=dict(meta["run"]), num_stages=int(meta["num_stages"]),
                   run_id=str(meta.get("run_id") or "run"),
                   stage_checkpoints={int(k): str(v) for k, v in (meta.get("stage_checkpoints") or {}).items()},
                   latest_version=int(meta.get("version", versions[-1]["version"] if versions else 0)),
                   versions=versions, evals=evals, ledger=ledger, peers=peers, rollout_counts=counts,
                   staleness=cls._staleness(meta, versions), base_checkpoint=meta.get("base_checkpoint"))

    @staticmethod
    def _staleness(meta: dict[str, Any], versions: list[dict[str, Any]]) -> dict[str, Any]:
        """The coordinator's staleness histogram (groups by versions behind) when the database keeps
        one; otherwise the histogram of each update's mean staleness, rounded, which it always keeps."""
        kept = meta.get("staleness_histogram")
        if isinstance(kept, dict) and kept:
            return {"counts": "prompt groups", "histogram": {str(k): int(v) for k, v in sorted(kept.items())}}
        rounded = Counter(int(round(float(v["info"].get("staleness_mean", 0.0)))) for v in versions if v["info"])
        return {"counts": "updates, by their rows' mean staleness (rounded)",
                "histogram": {str(k): n for k, n in sorted(rounded.items())}}
