"""What the coordinator's stats API shows: a public view and an admin view, paged and cached.

``GET /api/stats`` needs no token: it is what a contributor's app and ``polis demo`` read — the
run (version, model, task, stages and who serves them), each node's stage, role, readiness and
version, the eval, reward and step curves, the latest samples, the reward-hacking monitor,
rollout counts, the verified credit's totals and, asked with ``peer=<peer id>``, that peer's own
ledger row (``credit``). ``GET /api/admin/stats`` (the admin bearer token, which the coordinator
checks) adds what only an operator needs: per-node evidence (refused results, log-prob
mismatch), weight votes and streams, the routes' in-flight limits and weights, counters,
staleness, update bytes, storage errors, and every peer's ledger row with the self-reported
totals (``engine.swarm.ledger``).

Lists that grow with the run come a page at a time (:class:`Page`): ``versions``, ``steps`` and
``evals`` of the versions after ``after`` (without it: the newest), at most ``limit`` each
(``MAX_PAGE`` at most); ``samples`` are the scheduler's few latest; ``page`` gives the totals to
walk on from. No call scans a table: rollout counts, list lengths and ledger totals are kept by
the store as it writes, pages are index range reads, and pages and ledger rows are cached until
their table changes, then re-read at most every ``REFRESH_S``.

What it does not know: HTTP and tokens (the coordinator parses requests and checks the token),
how any figure is produced.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from backends.base import StageSpec
from engine.model.config import ModelConfig
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.ledger import VERIFIED, empty_row, with_pending
from engine.swarm.membership import Membership, NodeSession
from engine.swarm.rollout_monitor import RolloutMonitor
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.scheduler import GenerationScheduler
from engine.swarm.step_runner import StepRunner
from engine.swarm.store import Store
from engine.swarm.stream_book import StreamBook

#: most rows of one list (versions, steps, evals) in one answer
MAX_PAGE = 500
#: rows of each list when the request does not say
DEFAULT_PAGE = 100
#: a cached read whose table changed is read again after at most this many seconds
REFRESH_S = 1.0
#: most cached reads kept (then the cache starts over: keys come from requests)
MAX_CACHED = 256
#: what a ``peer`` parameter may look like (a peer id: hex here, short names in tests)
_PEER = re.compile(r"[A-Za-z0-9_.:-]{4,64}")

T = TypeVar("T")


@dataclass(frozen=True)
class Page:
    """Which rows of the long lists to show: versions after ``after`` (None: the newest), at most ``limit``."""

    after: int | None = None
    limit: int = DEFAULT_PAGE


@dataclass(frozen=True)
class StatsQuery:
    """A stats request's parameters: the page, and whose own ledger row to add (None: nobody's)."""

    page: Page = Page()
    peer: str | None = None

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> "StatsQuery":
        """From ``?after=V&limit=N&peer=ID`` (each optional); ValueError on anything else."""
        unknown = sorted(set(query) - {"after", "limit", "peer"})
        if unknown:
            raise ValueError(f"unknown parameters {unknown}: the stats API takes after, limit and peer")
        after = _integer(query, "after", 0, 1 << 62)
        limit = _integer(query, "limit", 1, MAX_PAGE)
        peer = query.get("peer")
        if peer is not None and not _PEER.fullmatch(peer):
            raise ValueError("peer: a peer id (4-64 letters, digits, '_', '.', ':' or '-')")
        return cls(Page(after, DEFAULT_PAGE if limit is None else limit), peer)


def _integer(query: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    text = query.get(name)
    if text is None:
        return None
    if not text.isascii() or not text.isdigit() or not low <= int(text) <= high:
        raise ValueError(f"{name}: an integer from {low} to {high}")
    return int(text)


class ReadCache:
    """Reads of ``store`` kept until the store's write count of their table moves, and then for at
    most ``refresh_s`` more (so a busy table is read at most that often, however often it is asked)."""

    def __init__(self, store: Store, refresh_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.refresh_s, self.clock = store, refresh_s, clock
        self._entries: dict[Hashable, tuple[int, float, Any]] = {}

    def get(self, table: str, key: Hashable, read: Callable[[], T]) -> T:
        changes, now = self.store.changes[table], self.clock()
        hit = self._entries.get((table, key))
        if hit is not None and (hit[0] == changes or now - hit[1] < self.refresh_s):
            return hit[2]
        value = read()
        if len(self._entries) >= MAX_CACHED:
            self._entries.clear()
        self._entries[(table, key)] = (changes, now, value)
        return value


class StatsSource(Protocol):
    """What the stats read of the coordinator (``engine.swarm.coordinator.Coordinator`` is one)."""

    store: Store
    book: RunBook
    run: RunConfig
    run_id: str
    checkpoint_dir: Path
    model_config: ModelConfig
    model_parameters: int
    num_stages: int
    specs: list[StageSpec]
    started: float  #: wall-clock time it started
    members: Membership
    sessions: dict[str, NodeSession]
    generation: GenerationScheduler
    steps: StepRunner
    evals: EvalScheduler
    streams: StreamBook
    monitor: RolloutMonitor

    def stage_lost(self, stage: int) -> str | None:
        """Why ``stage`` cannot be served at the run's version, or None."""

    def bandwidth(self) -> dict[str, Any]:
        """Bytes per version of each stage, each node's uplink and upload time, joins placed by uplink."""


class StatsView:
    """The public and admin stats of ``coordinator``."""

    def __init__(self, coordinator: StatsSource) -> None:
        self.c = coordinator
        self.cache = ReadCache(coordinator.store)

    # ------------------------------------------------------------------ public
    def public(self, query: StatsQuery | None = None) -> dict[str, Any]:
        query = query or StatsQuery()
        c, page = self.c, query.page
        store, book, generation = c.store, c.book, c.generation
        replicas, inference = c.members.stage_replicas(), c.members.inference_replicas()
        versions = self.cache.get("versions", page, lambda: store.version_page(page.after, page.limit))
        out = {
            "run_id": c.run_id, "version": book.version, "finished": book.finished,
            "task": c.run.task.name, "model": c.run.model or c.checkpoint_dir.name, "env": c.run.env.name,
            "model_parameters": c.model_parameters,
            "lora_rank": c.run.lora.rank if c.run.lora.enabled else None,  # None: full fine-tuning
            "num_stages": c.num_stages, "uptime_s": round(time.time() - c.started, 1),
            "stages": [{"stage": i, "layers": spec.describe(c.model_config.num_hidden_layers),
                        "replicas": replicas[i], "inference": inference[i], "leader": c.members.leader(i)}
                       for i, spec in enumerate(c.specs)],
            "nodes": [{"peer_id": s.peer_id, "stage": s.stage, "ready": s.ready, "role": s.role,
                       "version": s.version} for s in c.sessions.values()],
            "paused": [why for why in map(c.stage_lost, range(c.num_stages)) if why is not None],
            "evals": self.cache.get("evals", page, lambda: store.eval_page(page.after, page.limit)),
            "eval_running": c.evals.running,
            "versions": [{"version": v["version"], "reward": v["reward"], "samples": v["samples"],
                          "created_at": v["created_at"]} for v in versions],
            "steps": [v["info"] for v in versions if v["info"]],  # each update's figures (StepRunner._record_step)
            "page": {"after": page.after, "limit": page.limit, "versions_total": store.version_count(),
                     "evals_total": store.eval_count()},
            "samples": list(generation.samples)[-page.limit:], "monitor": c.monitor.figures,
            "rollouts": store.rollout_counts(), "received_rollouts": generation.received_rollouts,
            "samples_trained": store.samples_trained(),
            # work the coordinator observed or verified, summed over peers (engine.swarm.ledger)
            "credit_totals": self._verified_totals(),
        }
        if query.peer is not None:
            out["credit"] = self.ledger_row(query.peer)
        return out

    def ledger_row(self, peer: str) -> dict[str, Any] | None:
        """``peer``'s ledger row with its credit not written yet, or None for a peer never seen."""
        stored = self.cache.get("ledger", ("row", peer), lambda: self.c.store.ledger_row(peer))
        pending = self.c.book.credit.pending_for(peer)
        if stored is None and not pending:
            return None
        return with_pending(stored or empty_row(), pending)

    def _verified_totals(self) -> dict[str, int]:
        stored, pending = self.c.store.ledger_totals()["verified"], self.c.book.credit.pending_totals()
        return {k: int(stored[k]) + int(pending[k]) for k in VERIFIED}

    # ------------------------------------------------------------------ admin
    def admin(self, query: StatsQuery | None = None) -> dict[str, Any]:
        """The public view and what only an operator sees (the caller checked the admin token)."""
        c = self.c
        book, generation, steps = c.book, c.generation, c.steps
        audit = steps.audit.scores
        out = self.public(query)
        out.update({
            "nodes": [{"peer_id": s.peer_id, "stage": s.stage, "ready": s.ready, "backend": s.backend,
                       "version": s.version, "role": s.role,
                       "rollouts_scored": generation.scored_by_peer.get(s.peer_id, 0),
                       "refused_results": generation.flagged.get(s.peer_id, 0),
                       "logprob_mismatch": audit[s.peer_id].score if s.peer_id in audit else None}
                      for s in c.sessions.values()],
            "weight_votes": dict(c.members.authority.counters),  # votes, splits, resyncs, evictions, refusals
            # per generator: behaviour log-probs vs the proximal pass (engine.swarm.logprob_audit)
            "logprob_audit": steps.audit.snapshot(),
            "weight_stream": c.streams.stats(),
            "jobs_in_flight": len(generation.jobs),
            # /v1/chat/completions requests (engine.swarm.serve_queue): waiting, running, served, refused
            "serve": generation.serve.stats(),
            # per route: the jobs in flight it gets and why (engine.swarm.inflight)
            "in_flight": generation.pacer.snapshot(c.members.gen_routes(), c.run.generations_in_flight),
            # per route: its measured throughput, which sets its share of jobs and rows (engine.swarm.route_weights)
            "route_weights": {"generation": generation.weights.snapshot()["generation"],
                              "training": steps.microbatches.weights.snapshot()["training"]},
            "bandwidth": c.bandwidth(),
            "staleness_histogram": {str(k): v for k, v in sorted(steps.staleness_histogram.items())},
            "counters": dict(book.counters), "update_bytes": steps.update_bytes,
            "dense_update_bytes": steps.dense_update_bytes,
            "storage_error": c.store.write_error,  # None, or why ingestion and training are paused
            # every peer: verified credit, and under self_reported what it said of itself
            "ledger": self._ledger(),
            "self_reported": c.store.ledger_totals()["self_reported"],  # summed; never credit
        })
        return out

    def _ledger(self) -> dict[str, dict[str, Any]]:
        stored = self.cache.get("ledger", "all", self.c.store.ledger)
        pending = self.c.book.credit.pending()
        rows = {peer: with_pending(row, pending.get(peer, {})) for peer, row in stored.items()}
        for peer in pending.keys() - rows.keys():
            rows[peer] = with_pending(empty_row(), pending[peer])
        return rows
