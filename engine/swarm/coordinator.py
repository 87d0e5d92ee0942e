"""The coordinator service: signalling, membership, stage assignment, the stats API.

One aiohttp application serves:

* ``/signal`` — the WebRTC signalling relay (``engine.net.signalling``);
* ``/node`` — each node's control websocket: a signed challenge proves the
  node's identity, then the coordinator assigns a stage (least-covered first),
  says where to load it from (keep / stage checkpoint / a live replica), and
  exchanges job messages (``engine.swarm.messages``) with it. A node is a
  trainer or, as its signed hello says, an inference replica: inference
  replicas serve generation routes only (training routes, ``apply`` and replica
  checksums use trainers), load from their stage's leader trainer and follow its
  weight stream (``engine.swarm.stream_book`` keeps the figures);
* ``/api/stats`` (GET) — JSON for the GUI and ``polis demo``; ``/api/eval`` and
  ``/api/finish`` (POST, admin token) — ask for an eval / end training.

Durable state (version, rollouts, evals, ledger, run config) lives in SQLite
(``engine.swarm.store``), so a restarted coordinator resumes where it stopped
and nodes simply reconnect. Scheduling is three parts the coordinator composes:
generation (``engine.swarm.scheduler``), optimiser steps (``engine.swarm.step_runner``)
and evals (``engine.swarm.eval_scheduler``); they share a ``RunBook`` and reach nodes
through ``engine.swarm.membership`` as ``NodeLinks`` (``engine.swarm.run_book``). Node
messages go to ``engine.swarm.node_reports``, which dispatches them by type. The
coordinator never receives activations or weights.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

from backends.base import StageSpec
from engine import __version__
from engine.model.shard_plan import plan_stages
from engine.net.errors import AuthenticationError, ProtocolViolation
from engine.net.identity import peer_id_for, verify_signature
from engine.net.signalling import SignallingServer
from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm.assignment import Assignment, NodeSlot, assign_new_node, rebalance, remove_node, resume_stage
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.membership import Membership, NodeSession
from engine.swarm.node import hello_bytes
from engine.swarm.node_reports import NodeReports
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig, run_config_from_dict
from engine.swarm.run_task import make_run_task
from engine.swarm.scheduler import GenerationScheduler
from engine.swarm.stage_loading import base_dir
from engine.swarm.step_runner import StepRunner
from engine.swarm.store import Store
from engine.swarm.stream_book import StreamBook

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorConfig:
    """How the coordinator runs.

    db_path: SQLite file holding the run (created if missing; resumed if present).
    base_checkpoint: the model every stage is cut from (config.json + safetensors + tokenizer), unless
      the run names its own (``RunConfig.model``).
    host / port: where to listen (port 0 = any free port).
    num_stages: pipeline stages the model is cut into (fixed for the life of a run).
    run: the RL run settings (used only when the database holds no run yet).
    admin_token: required by POST endpoints (None = a random one, see ``admin_token``).
    job_timeout_s: a generation job unanswered this long is re-queued.
    step_timeout_s: a training step unfinished this long is aborted (its rollouts stay).
    tick_s: scheduling period.
    """

    db_path: str
    base_checkpoint: str
    host: str = "127.0.0.1"
    port: int = 8700
    num_stages: int = 2
    run: RunConfig = field(default_factory=RunConfig)
    admin_token: str | None = None
    job_timeout_s: float = 60.0
    step_timeout_s: float = 120.0
    tick_s: float = 0.05


class Coordinator:
    """``await c.start()`` serves until ``await c.stop()``."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.store = Store(config.db_path)
        from engine.model.config import ModelConfig

        stored = self.store.get_meta("run")
        self.run = run_config_from_dict(stored) if stored else config.run
        #: the base the run trains (its tokenizer files give the prompts and the stop ids)
        self.checkpoint_dir: Path = base_dir(config.base_checkpoint, self.run.model)
        self.model_config = ModelConfig.from_file(self.checkpoint_dir / "config.json")
        self.task = make_run_task(self.run.task, self.checkpoint_dir)
        self.model_parameters = self.model_config.num_parameters
        self.num_stages = int(self.store.get_meta("num_stages", config.num_stages))
        self.run_id = self.store.get_meta("run_id") or secrets.token_hex(6)
        self.store.set_meta("run", self.run.to_dict())
        self.store.set_meta("base_checkpoint", str(self.checkpoint_dir))  # for `polis export` and the card
        self.store.set_meta("num_stages", self.num_stages)
        self.store.set_meta("run_id", self.run_id)
        self.specs: list[StageSpec] = plan_stages(self.model_config.num_hidden_layers, self.num_stages)
        self.assignment = Assignment(stage_layers=[s.num_layers for s in self.specs])
        self.admin_token = config.admin_token or secrets.token_urlsafe(16)
        self.members = Membership(self.num_stages)
        self.sessions = self.members.sessions  #: peer id -> session of every admitted node
        self.signalling = SignallingServer()
        self.streams = StreamBook()
        rules = UpdateRules(objective=self.run.objective, max_staleness=self.run.max_staleness,
                            updates_per_batch=self.run.updates_per_batch, max_grad_norm=self.run.max_grad_norm)
        self.book = RunBook(self.store)
        self.evals = EvalScheduler(self.task, self.store)
        self.generation = GenerationScheduler(self.run, rules, self.task, self.store, self.book, self.evals,
                                              self.members, job_timeout_s=config.job_timeout_s,
                                              vocab_size=self.model_config.vocab_size)
        self.steps = StepRunner(self.run, rules, self.task, self.store, self.book, self.evals, self.members,
                                step_timeout_s=config.step_timeout_s)
        self.reports = NodeReports(self.members, self.generation, self.steps, self.streams, self.store,
                                   on_ready=self._members_changed)
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task] = []
        self._train_task: asyncio.Task | None = None
        self.url = ""
        self.started = time.time()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        app = web.Application(client_max_size=1024 * 1024)
        self.signalling.add_routes(app, "/signal")
        app.router.add_get("/node", self._node_ws)
        app.router.add_get("/api/stats", self._stats)
        app.router.add_post("/api/eval", self._admin(self._post_eval))
        app.router.add_post("/api/finish", self._admin(self._post_finish))
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.config.host}:{port}"
        self._tasks.append(asyncio.get_running_loop().create_task(self._tick_loop(), name="polis-coord-tick"))
        log.info("coordinator %s serving run %s (version %d) at %s", __version__, self.run_id,
                 self.book.version, self.url)
        return self.url

    async def stop(self) -> None:
        for task in [*self._tasks, self._train_task]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [*self._tasks, self._train_task] if t], return_exceptions=True)
        for session in list(self.sessions.values()):
            await session.ws.close()
        await self.signalling.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self.store.close()

    async def _tick_loop(self) -> None:
        """The scheduling heartbeat. A bug in one tick is logged and the next tick runs anyway."""
        while True:
            await asyncio.sleep(self.config.tick_s)
            try:
                self.generation.expire_jobs()
                await self.generation.fill()
                if self._train_task is None or self._train_task.done():
                    if self._train_task is not None and not self._train_task.cancelled() \
                            and self._train_task.exception():
                        log.error("training step crashed", exc_info=self._train_task.exception())
                    self._train_task = asyncio.get_running_loop().create_task(self.steps.maybe_train(),
                                                                              name="polis-coord-step")
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("scheduling tick failed")
                await asyncio.sleep(1.0)

    def _members_changed(self) -> None:
        asyncio.get_running_loop().create_task(self._broadcast_members(), name="polis-coord-members")

    async def _broadcast_members(self) -> None:
        message = self.members.members_message(self.book.version)
        for peer in list(self.sessions):
            await self.members.send(peer, message)

    def _welcome(self, session: NodeSession, stage: int, hello: messages.Hello | None) -> messages.Welcome:
        """The ``welcome`` to a node now serving ``stage`` (``hello``: what it held, None when moved)."""
        spec = self.specs[stage]
        trainers = [p for p in self.members.stage_replicas()[stage] if p != session.peer_id]
        ready = trainers or [p for p in self.members.inference_replicas()[stage] if p != session.peer_id]
        keep = (hello is not None and hello.stage == stage and hello.num_stages == self.num_stages
                and hello.run_id == self.run_id and hello.version == self.book.version)
        source, source_peer, checkpoint = "checkpoint", None, None
        if keep:
            source = "keep"
        elif session.role == "inference" and trainers:
            source, source_peer = "peer", trainers[0]  # the stage leader, who then streams deltas to it
        elif ready and self.book.version > 0:
            source, source_peer = "peer", ready[0]
        else:
            checkpoint = self.steps.checkpoints.get(stage)
        return messages.Welcome(stage=stage, num_stages=self.num_stages, layer_start=spec.layer_start,
                                layer_end=spec.layer_end, num_layers=self.model_config.num_hidden_layers, source=source,
                                source_peer=source_peer, stage_checkpoint=checkpoint, version=self.book.version,
                                run=self.run.to_dict(), run_id=self.run_id,
                                signal_url=self.url.replace("http://", "ws://", 1) + "/signal")

    # ------------------------------------------------------------------ node sessions
    async def _node_ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=10.0, max_msg_size=messages.MAX_WS_MESSAGE_CHARS)
        await ws.prepare(request)
        session: NodeSession | None = None
        try:
            hello = await self._authenticate(ws)
            if hello is None:
                return ws
            session = await self._admit(ws, hello)
            if session is None:
                return ws
            strikes = 0
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    break
                try:
                    self.reports.handle(session, messages.decode_from_node(msg.data))
                except (ValueError, ProtocolViolation) as exc:
                    strikes += 1
                    log.warning("invalid message from %s (%d strikes): %s", session.peer_id, strikes, exc)
                    if strikes >= 8:
                        break
        finally:
            if session is not None and self.sessions.get(session.peer_id) is session:
                await self._node_left(session)
            if not ws.closed:
                await ws.close()
        return ws

    async def _authenticate(self, ws: web.WebSocketResponse) -> messages.Hello | None:
        nonce = secrets.token_hex(16)
        await ws.send_str(messages.encode(messages.Challenge(nonce=nonce)))
        try:
            msg = await ws.receive(timeout=15.0)
            hello = messages.decode_from_node(msg.data) if msg.type == WSMsgType.TEXT else None
            if not isinstance(hello, messages.Hello):
                raise ProtocolViolation("expected hello")
            public_key = base64.b64decode(hello.public_key, validate=True)
            signature = base64.b64decode(hello.signature, validate=True)
            if peer_id_for(public_key) != hello.peer_id:
                raise AuthenticationError("peer id does not match the public key")
            verify_signature(public_key, hello_bytes(nonce, public_key), signature)
        except (asyncio.TimeoutError, ValueError, binascii.Error, ProtocolViolation, AuthenticationError) as exc:
            log.warning("refused a node: %s", exc)
            await ws.send_str(messages.encode(messages.Shutdown(reason=f"not admitted: {exc}"[:500])))
            return None
        return hello

    async def _admit(self, ws: web.WebSocketResponse, hello: messages.Hello) -> NodeSession | None:
        peer_id = hello.peer_id
        old = self.sessions.pop(peer_id, None)
        if old is not None:
            remove_node(self.assignment, peer_id)
            await old.ws.close()
        role = hello.role
        session = NodeSession(peer_id, ws, hello.backend, hello.device, role=role)
        slot = NodeSlot(peer_id, max_layers=hello.max_layers, role=role)
        # the coordinator owns placement and the version: a hello's stage is advice (see
        # ``resume_stage``) and its version is never adopted (one hello must not stall the run)
        preferred = resume_stage(self.assignment, slot, hello.stage) \
            if hello.run_id == self.run_id and hello.num_stages == self.num_stages else None
        if preferred is not None:
            self.assignment.nodes[peer_id] = slot
            slot.stage = preferred
            stage = preferred
        else:
            stage = assign_new_node(self.assignment, slot)
        if stage is None:
            await ws.send_str(messages.encode(messages.Shutdown(
                reason="this node cannot hold any stage of the model (raise its memory limit)")))
            return None
        welcome = self._welcome(session, stage, hello)
        if welcome.source == "checkpoint" and not hello.has_base:
            await ws.send_str(messages.encode(messages.Shutdown(
                reason="no copy of the model here and no replica to fetch it from; try again when a replica is up")))
            remove_node(self.assignment, peer_id)
            return None
        session.stage = stage
        self.sessions[peer_id] = session
        self.store.upsert_peer(peer_id, hello.public_key, backend=hello.backend, device=hello.device,
                               stage=stage, role=role)
        await ws.send_str(messages.encode(welcome))
        await self._broadcast_members()
        log.info("node %s joins stage %d as %s (%s, from %s)", peer_id, stage, role, hello.backend,
                 welcome.source)
        return session

    async def _node_left(self, session: NodeSession) -> None:
        del self.sessions[session.peer_id]
        remove_node(self.assignment, session.peer_id)
        self.streams.forget(session.peer_id)
        log.info("node %s left stage %s", session.peer_id, session.stage)
        self.generation.on_node_lost(session.peer_id)
        self.steps.on_node_lost(session.peer_id)
        for peer_id, old_stage, new_stage in rebalance(self.assignment):
            moved = self.sessions.get(peer_id)
            if moved is None:
                continue
            log.info("moving node %s from stage %d to %d", peer_id, old_stage, new_stage)
            moved.stage, moved.ready = new_stage, False
            await self.members.send(peer_id, self._welcome(moved, new_stage, None))
        await self._broadcast_members()

    # ------------------------------------------------------------------ HTTP API
    def _admin(self, handler):
        async def guarded(request: web.Request) -> web.Response:
            token = request.headers.get("Authorization", "").removeprefix("Bearer ")
            # bytes, not str: compare_digest raises on non-ASCII str (an HTTP 500 for one odd header)
            if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self.admin_token.encode()):
                return web.json_response({"error": "admin token required: send 'Authorization: Bearer <token>' "
                                                   "(the coordinator's --admin-token-file)"}, status=401)
            return await handler(request)
        return guarded

    async def _post_eval(self, request: web.Request) -> web.Response:
        self.evals.request(self.book.version)
        return web.json_response({"eval_of_version": self.book.version})

    async def _post_finish(self, request: web.Request) -> web.Response:
        self.book.finished = True
        self.evals.request(self.book.version)
        return web.json_response({"finished_at_version": self.book.version})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    def stats(self) -> dict[str, Any]:
        book, generation, steps = self.book, self.generation, self.steps
        replicas = self.members.stage_replicas()
        inference = self.members.inference_replicas()
        ledger = self.store.ledger()
        return {
            "run_id": self.run_id, "version": book.version, "finished": book.finished,
            "task": self.run.task.name, "model": self.run.model or self.checkpoint_dir.name,
            "model_parameters": self.model_parameters,
            "lora_rank": self.run.lora.rank if self.run.lora.enabled else None,  # None: full fine-tuning
            "num_stages": self.num_stages, "uptime_s": round(time.time() - self.started, 1),
            "stages": [{"stage": i, "layers": spec.describe(self.model_config.num_hidden_layers),
                        "replicas": replicas[i], "inference": inference[i]} for i, spec in enumerate(self.specs)],
            "nodes": [{"peer_id": s.peer_id, "stage": s.stage, "ready": s.ready, "backend": s.backend,
                       "version": s.version, "role": s.role,
                       "rollouts_scored": generation.scored_by_peer.get(s.peer_id, 0),
                       "refused_results": generation.flagged.get(s.peer_id, 0)} for s in self.sessions.values()],
            "weight_stream": self.streams.stats(),
            "evals": self.store.evals(), "eval_running": self.evals.running,
            "versions": [{"version": v["version"], "reward": v["reward"], "samples": v["samples"]}
                         for v in self.store.versions()],
            "steps": steps.step_log[-50:], "rollouts": self.store.rollout_counts(),
            "received_rollouts": generation.received_rollouts, "jobs_in_flight": len(generation.jobs),
            # per route: the jobs in flight it gets and why (engine.swarm.inflight)
            "in_flight": generation.pacer.snapshot(self.members.gen_routes(), self.run.generations_in_flight),
            "samples": list(generation.samples),
            "staleness_histogram": {str(k): v for k, v in sorted(steps.staleness_histogram.items())},
            "counters": dict(book.counters), "update_bytes": steps.update_bytes,
            "dense_update_bytes": steps.dense_update_bytes, "ledger": ledger,
            "bytes_on_wire": sum(p["bytes_sent"] for p in ledger.values()),
            "tokens_generated": sum(p["tokens_generated"] for p in ledger.values()),
        }
