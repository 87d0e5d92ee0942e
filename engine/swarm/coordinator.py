"""The coordinator service: signalling, membership, stage assignment, the stats API.

One aiohttp application serves:

* ``/signal`` — the WebRTC signalling relay (``engine.net.signalling``);
* ``/node`` — each node's control websocket: a signed challenge proves the
  node's identity and the signed welcome the coordinator's (its own Ed25519 key, kept
  next to the database; ``swarm_url`` pins it, ``#key=...``); at most
  ``max_nodes_per_address`` identities per network address are admitted (identities are
  free, addresses are not); then the coordinator assigns a stage (least-covered first),
  says where to load it from (keep / stage checkpoint / a live replica), and
  exchanges job messages (``engine.swarm.messages``) with it, every job and micro-batch with
  a ticket it signs (``engine.swarm.tickets``) that peers check. A node is a
  trainer or, as its signed hello says, an inference replica: inference
  replicas serve generation routes only (training routes, ``apply`` and replica
  checksums use trainers), load from their stage's leader trainer and follow its
  weight stream (``engine.swarm.stream_book`` keeps the figures);
* ``/api/stats`` (GET) — the public figures a contributor's app and ``polis demo`` read, and
  ``/api/admin/stats`` (GET, admin token) — those and the operator's (``engine.swarm.stats_view``:
  paged, cached); ``/api/eval`` and ``/api/finish`` (POST, admin token) — ask for an eval / end
  training; ``/api/export`` (POST, admin token) — plan ``polis export --coordinator``
  (``engine.swarm.export_api``); ``/v1/chat/completions`` (POST) and ``/v1/models`` (GET), admin
  token — an OpenAI-compatible endpoint that generates with the run's policy through the
  swarm's own jobs (``engine.swarm.openai_api``). Every admin route goes through one token check
  (``_admin``).

Durable state (version, rollouts, evals, ledger, run config) lives in SQLite
(``engine.swarm.store``), so a restarted coordinator resumes where it stopped
and nodes simply reconnect. The ledger credits only work the coordinator observed or
verified (``engine.swarm.credit``, written every ``FLUSH_S``); what nodes report of
themselves is kept apart, as self-reported (``engine.swarm.ledger``). Scheduling is three
parts the coordinator composes: generation (``engine.swarm.scheduler``), optimiser steps
(``engine.swarm.step_runner``) and evals (``engine.swarm.eval_scheduler``); they share a ``RunBook`` and reach nodes
through ``engine.swarm.membership`` as ``NodeLinks`` (``engine.swarm.run_book``). Node
messages go to ``engine.swarm.node_reports``, which dispatches them by type. The
coordinator never receives activations or weights.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgspec
from aiohttp import WSMsgType, web

from backends.base import StageSpec
from engine import __version__
from engine.model.shard_plan import plan_stages
from engine.net.errors import AuthenticationError, ProtocolViolation
from engine.net.identity import load_or_create_key_file, peer_id_for, pin_url, verify_signature
from engine.net.signalling import SignallingServer
from engine.rl.codec import ChatCodec
from engine.rl.run_task import make_run_task
from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm.assignment import Assignment, NodeSlot, assign_new_node, rebalance, remove_node, resume_stage
from engine.swarm.bandwidth_placement import BandwidthPlacement, seconds_per_version
from engine.swarm.coordinator_session import welcome_bytes
from engine.swarm.credit import FLUSH_S
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.link_roles import REVIEW_EVERY_S, slow_link_trainers
from engine.swarm.membership import Membership, NodeSession
from engine.swarm.node import hello_bytes
from engine.swarm.node_reports import NodeReports
from engine.swarm.openai_api import OpenAIEndpoint, served_model_id
from engine.swarm.rollout_monitor import RolloutMonitor
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig, refuse_diloco_split_tied, run_config_from_dict
from engine.swarm.scheduler import GenerationScheduler
from engine.swarm.stage_loading import base_dir
from engine.swarm.stage_traffic import mean_prompt_tokens, stage_traffic
from engine.swarm.stats_view import StatsQuery, StatsView
from engine.swarm.step_runner import StepRunner
from engine.swarm.store import Store, StoreUnavailable
from engine.swarm.stream_book import StreamBook
from engine.swarm.tickets import TicketIssuer

log = logging.getLogger(__name__)

#: how often the tick refreshes the run's recent seconds per version (the bandwidth placement's budget)
VERSION_S_EVERY_S = 5.0


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
    identity_file: the coordinator's Ed25519 key (0600; created if missing). None: ``<db_path>.ed25519.key``.
    max_nodes_per_address: most identities admitted at once from one network address.
    serve_deadline_s: how long a ``/v1/chat/completions`` request may wait for its answer (queue and generation).
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
    identity_file: str | None = None
    max_nodes_per_address: int = 16
    serve_deadline_s: float = 180.0


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
        self.task = make_run_task(self.run.task, self.checkpoint_dir, self.run.env)
        self.model_parameters = self.model_config.num_parameters
        self.num_stages = int(self.store.get_meta("num_stages", config.num_stages))
        try:  # before anything is stored: a refused run leaves nothing behind to restart into
            refuse_diloco_split_tied(self.run, self.model_config.tie_word_embeddings, self.num_stages)
        except ValueError:
            self.store.close()
            raise
        self.run_id = self.store.get_meta("run_id") or secrets.token_hex(6)
        self.store.set_meta("run", self.run.to_dict())
        self.store.set_meta("base_checkpoint", str(self.checkpoint_dir))  # for `polis export` and the card
        self.store.set_meta("num_stages", self.num_stages)
        self.store.set_meta("run_id", self.run_id)
        self.specs: list[StageSpec] = plan_stages(self.model_config.num_hidden_layers, self.num_stages)
        self.assignment = Assignment(stage_layers=[s.num_layers for s in self.specs])
        self.admin_token = config.admin_token or secrets.token_urlsafe(16)
        self.identity = load_or_create_key_file(Path(config.identity_file or f"{config.db_path}.ed25519.key"))
        self.public_key_b64 = base64.b64encode(self.identity.public_key).decode()
        self.members = Membership(self.num_stages, issuer=TicketIssuer(self.identity))
        self.sessions = self.members.sessions  #: peer id -> session of every admitted node
        self.signalling = SignallingServer()
        self.streams = StreamBook()
        rules = UpdateRules(objective=self.run.objective, max_staleness=self.run.max_staleness,
                            updates_per_batch=self.run.updates_per_batch, max_grad_norm=self.run.max_grad_norm,
                            pack_groups=self.run.pack_groups)
        self.book = RunBook(self.store)
        self.evals = EvalScheduler(self.task, self.store)
        self.generation = GenerationScheduler(self.run, rules, self.task, self.store, self.book, self.evals,
                                              self.members, job_timeout_s=config.job_timeout_s,
                                              vocab_size=self.model_config.vocab_size)
        self.monitor = RolloutMonitor()
        self.steps = StepRunner(self.run, rules, self.task, self.store, self.book, self.evals, self.members,
                                step_timeout_s=config.step_timeout_s)
        # bytes per version of each stage (engine.swarm.stage_traffic) against the nodes' measured uplinks
        prompts = itertools.islice(self.task.train_prompts(self.run.seed), 32)
        self.placement = BandwidthPlacement(stage_traffic(self.run, self.model_config, self.assignment.stage_layers,
                                                          mean_prompt_tokens(len(self.task.prompt_ids(p))
                                                                             for p in prompts)))
        self._version_s: float | None = None  #: recent seconds per version (refreshed by the tick)
        self._version_s_at = -float("inf")
        self._roles_at = time.monotonic()  #: when trainers' links were last reviewed (``_review_roles``)
        if self.run.replica_sync.mode == "every_step":  # DiLoCo keeps replica r of every stage on route r
            self.members.route_key = lambda p, s, n: self.placement.route_key(p, s, n, self._version_s)
        self.reports = NodeReports(self.members, self.generation, self.steps, self.streams, self.store,
                                   on_ready=self._members_changed, on_uplink=self.placement.uplinks.observe)
        self.stats_view = StatsView(self)
        codec = self.task.codec
        self.openai = OpenAIEndpoint(self.generation.serve, codec if isinstance(codec, ChatCodec) else None,
                                     model_id=served_model_id(self.run.model, self.checkpoint_dir.name),
                                     max_tokens_cap=self.run.sampling.max_new_tokens,
                                     context_tokens=self.model_config.max_position_embeddings,
                                     has_route=lambda: bool(self.members.gen_routes()), run_id=self.run_id,
                                     deadline_s=config.serve_deadline_s)
        self._credit_flushed = 0.0  #: monotonic time the verified credit was last written
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task] = []
        self._train_task: asyncio.Task | None = None
        self.url = ""
        #: the URL to give nodes: ``url`` pinning this coordinator's key
        self.swarm_url = ""
        self.started = time.time()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        app = web.Application(client_max_size=1024 * 1024)
        self.signalling.add_routes(app, "/signal")
        app.router.add_get("/node", self._node_ws)
        app.router.add_get("/api/stats", self._stats)
        app.router.add_get("/api/admin/stats", self._admin(self._admin_stats))
        app.router.add_post("/api/eval", self._admin(self._post_eval))
        app.router.add_post("/api/finish", self._admin(self._post_finish))
        app.router.add_post("/api/export", self._admin(self._post_export))
        app.router.add_post("/v1/chat/completions", self._admin(self.openai.chat_completions))
        app.router.add_get("/v1/models", self._admin(self.openai.models))
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.config.host}:{port}"
        self.swarm_url = pin_url(self.url, self.identity.public_key)
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
        self.generation.turns.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if not self.book.credit.flush(self.store):
            log.error("verified credit of %d peers could not be written before stopping: it is lost",
                      len(self.book.credit.pending()))
        self.store.close()

    async def _tick_loop(self) -> None:
        """The scheduling heartbeat. A bug in one tick is logged and the next tick runs anyway."""
        while True:
            await asyncio.sleep(self.config.tick_s)
            try:
                self.generation.expire_jobs()
                if not self.store.writable():
                    continue  # fail closed: nothing is generated or trained that could not be stored
                if time.monotonic() - self._credit_flushed >= FLUSH_S:
                    self._credit_flushed = time.monotonic()
                    self.book.credit.flush(self.store)
                await self.generation.fill()
                self.monitor.refresh(time.monotonic(), self.generation.outcomes, self.store.versions_of,
                                     self.store.evals)
                if time.monotonic() - self._version_s_at >= VERSION_S_EVERY_S:
                    self._version_s = seconds_per_version(self.store.version_page(None, 10))
                    self._version_s_at = time.monotonic()
                if time.monotonic() - self._roles_at >= REVIEW_EVERY_S:
                    self._roles_at = time.monotonic()
                    await self._review_roles()
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
        await self.members.broadcast(self.book.version)

    def _welcome(self, session: NodeSession, stage: int, hello: messages.Hello | None) -> messages.Welcome:
        """The ``welcome`` to a node now serving ``stage`` (``hello``: what it held, None when moved)."""
        spec = self.specs[stage]
        leader = self.members.leader(stage)
        trainers = sorted((p for p in self.members.stage_replicas()[stage] if p != session.peer_id),
                          key=lambda p: p != leader)  # the named leader first: it streams to inference
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
        elif self.book.version > 0 and session.role == "trainer":
            checkpoint = self.steps.checkpoint_of(stage, self.book.version)  # None: see ``stage_lost``
        else:
            checkpoint = self.steps.checkpoints.get(stage)
        return messages.Welcome(stage=stage, num_stages=self.num_stages, layer_start=spec.layer_start,
                                layer_end=spec.layer_end, num_layers=self.model_config.num_hidden_layers, source=source,
                                source_peer=source_peer, stage_checkpoint=checkpoint, version=self.book.version,
                                run=self.run.to_dict(), run_id=self.run_id,
                                signal_url=self.url.replace("http://", "ws://", 1) + "/signal",
                                coordinator_key=self.public_key_b64, role=session.role)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ node sessions
    async def _node_ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=10.0, max_msg_size=messages.MAX_WS_MESSAGE_CHARS)
        await ws.prepare(request)
        session: NodeSession | None = None
        try:
            authenticated = await self._authenticate(ws)
            if authenticated is None:
                return ws
            session = await self._admit(ws, *authenticated, address=request.remote or "")
            if session is None:
                return ws
            strikes = 0
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    break
                try:
                    self.reports.handle(session, messages.decode_from_node(msg.data))
                except StoreUnavailable as exc:  # our disk, not the node's fault: the session stays
                    self.book.counters["reports_lost_to_storage"] += 1
                    log.debug("could not store a report of %s: %s", session.peer_id, exc)
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

    async def _authenticate(self, ws: web.WebSocketResponse) -> tuple[messages.Hello, str] | None:
        """The node's signed hello and the challenge nonce it signed, or None (refused)."""
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
        return hello, nonce

    async def _admit(self, ws: web.WebSocketResponse, hello: messages.Hello, nonce: str, *,
                     address: str) -> NodeSession | None:
        peer_id = hello.peer_id
        banned_s = self.members.banned_for(peer_id)
        if banned_s > 0:
            await ws.send_str(messages.encode(messages.Shutdown(
                reason=f"evicted for not answering in time; this node may rejoin in {banned_s:.0f} s "
                       "(check its network and load)")))
            return None
        old = self.sessions.pop(peer_id, None)
        if old is not None:
            remove_node(self.assignment, peer_id)
            await old.ws.close()
        if self.members.at_address(address) >= self.config.max_nodes_per_address:
            self.book.counters["refused_address_cap"] += 1
            log.warning("refused %s: %d nodes from %s already", peer_id, self.config.max_nodes_per_address, address)
            await ws.send_str(messages.encode(messages.Shutdown(
                reason=f"not admitted: {self.config.max_nodes_per_address} nodes from your address already; "
                       f"join from another machine")))
            return None
        role = hello.role
        session = NodeSession(peer_id, ws, hello.backend, hello.device, role=role, offered_role=role,
                              address=address)
        slot = NodeSlot(peer_id, max_layers=hello.max_layers, role=role)
        # the coordinator owns placement and the version: a hello's stage is advice (see
        # ``resume_stage``) and its version is never adopted (one hello must not stall the run)
        preferred = resume_stage(self.assignment, slot, hello.stage) \
            if hello.run_id == self.run_id and hello.num_stages == self.num_stages else None
        # its uplink, measured before (kept here, or remembered by the node) or capped (the hello's claim),
        # may send it where it uploads least (engine.swarm.bandwidth_placement)
        self.placement.uplinks.claim(peer_id, hello.uplink_mbps)

        by_uplink: list[int] = []

        def prefer(choice: int, candidates: list[int], trainers: list[int]) -> int:
            stage = self.placement.join_stage(peer_id, choice, candidates, trainers, self._version_s)
            if stage != choice:
                by_uplink.append(stage)
            return stage
        if preferred is not None and slot.is_trainer and prefer(
                preferred, [s for s in range(self.num_stages) if self.assignment._fits(slot, s)],
                self.assignment.coverage()) != preferred:
            preferred = None  # its old stage is where its uplink binds: assigned afresh
        if preferred is not None:
            self.assignment.nodes[peer_id] = slot
            slot.stage = preferred
            stage = preferred
        else:
            # where it adds most throughput once every stage is served and measured, unless its uplink
            # would set the pace there
            stage = assign_new_node(self.assignment, slot, self.generation.pacer.steps_per_s(), prefer=prefer)
        self.placement.placed += bool(by_uplink)
        if stage is None:
            await ws.send_str(messages.encode(messages.Shutdown(
                reason="this node cannot hold any stage of the model (raise its memory limit)")))
            return None
        self._settle_step_in_doubt(hello, stage, role)
        welcome = self._welcome(session, stage, hello)
        lost = self.stage_lost(stage) if welcome.source == "checkpoint" and role == "trainer" else None
        if lost is not None:
            await ws.send_str(messages.encode(messages.Shutdown(reason=lost[:500])))
            remove_node(self.assignment, peer_id)
            return None
        if hello.nonce is not None:  # the node's challenge: prove we hold the key it may have pinned
            signed = welcome_bytes(hello.nonce, nonce, peer_id, self.identity.public_key)
            welcome = msgspec.structs.replace(
                welcome, coordinator_signature=base64.b64encode(self.identity.sign(signed)).decode())
        if welcome.source == "checkpoint" and not hello.has_base:
            await ws.send_str(messages.encode(messages.Shutdown(
                reason="no copy of the model here and no replica to fetch it from; try again when a replica is up")))
            remove_node(self.assignment, peer_id)
            return None
        session.stage = stage
        self.sessions[peer_id] = session
        try:
            self.store.upsert_peer(peer_id, hello.public_key, backend=hello.backend, device=hello.device,
                                   stage=stage, role=role)
        except StoreUnavailable as exc:  # admitted all the same: the peer row is for the ledger only
            log.warning("node %s admitted without its peer record (%s)", peer_id, exc)
        await ws.send_str(messages.encode(welcome))
        await self._broadcast_members()
        log.info("node %s joins stage %d as %s (%s, from %s)", peer_id, stage, role, hello.backend,
                 welcome.source)
        return session

    def _settle_step_in_doubt(self, hello: messages.Hello, stage: int, role: str) -> None:
        """After a restart, the first trainer back says whether the step in doubt happened.

        The coordinator records a version only once trainers report 'stepped'; killed in between,
        it restarts one version behind nodes that did step (``RunBook.begin_apply``). A trainer
        of this run rejoining its stage at that next version rolls the run forward; one at the
        recorded version settles that it did not happen. Nothing else moves the version.
        """
        book = self.book
        if book.unconfirmed is None or role != "trainer" or hello.run_id != self.run_id \
                or hello.num_stages != self.num_stages or hello.stage != stage:
            return
        if hello.version == book.unconfirmed:
            log.warning("node %s holds version %d, which this coordinator began but never recorded; "
                        "the run goes on from it", hello.peer_id, book.roll_forward())
            book.counters["versions_recovered"] += 1
        elif hello.version == book.version:
            book.settle()

    async def _node_left(self, session: NodeSession) -> None:
        del self.sessions[session.peer_id]
        remove_node(self.assignment, session.peer_id)
        self.streams.forget(session.peer_id)
        self.members.authority.forget(session.peer_id)
        log.info("node %s left stage %s", session.peer_id, session.stage)
        self.generation.on_node_lost(session.peer_id)
        self.steps.on_node_lost(session.peer_id)
        await self._promote_where_no_trainer()  # before a trainer of another stage is moved to fill it
        for peer_id, old_stage, new_stage in rebalance(self.assignment):
            moved = self.sessions.get(peer_id)
            if moved is None:
                continue
            log.info("moving node %s from stage %d to %d", peer_id, old_stage, new_stage)
            moved.stage, moved.ready = new_stage, False
            await self.members.send(peer_id, self._welcome(moved, new_stage, None))
        await self._broadcast_members()

    # ------------------------------------------------------------------ roles (engine.swarm.link_roles)
    async def _review_roles(self) -> None:
        """Trainers whose links would set every step's pace serve generation only from now on."""
        moves = slow_link_trainers(self.members.stage_replicas(), self.generation.pacer.link_rtts_s())
        for peer, why in moves.items():
            await self._set_role(peer, "inference", why)
        if moves:
            await self._broadcast_members()

    async def _promote_where_no_trainer(self) -> None:
        """A stage left with no trainer takes one of its inference replicas that offered to train."""
        covered = self.assignment.replicas()
        for stage in range(self.num_stages):
            spare = sorted(s.peer_id for s in self.sessions.values() if s.stage == stage and s.ready
                           and s.role == "inference" and s.offered_role == "trainer")
            if not covered[stage] and spare:
                await self._set_role(spare[0], "trainer", f"stage {stage} has no other trainer")

    async def _set_role(self, peer: str, role: str, why: str) -> None:
        """Move ``peer`` to ``role`` on its stage: its work in flight is failed over, then it reloads
        (a new inference replica from the stage's leader; a new trainer from its own weights)."""
        session, slot = self.sessions.get(peer), self.assignment.nodes.get(peer)
        if session is None or session.stage is None or slot is None:
            return
        log.warning("node %s now serves stage %d as %s: %s", peer, session.stage, role, why)
        self.book.counters[f"moved_to_{role}"] += 1
        session.role = slot.role = role
        session.ready = False
        self.generation.on_node_lost(peer)
        self.steps.on_node_lost(peer)
        self.members.authority.forget(peer)
        welcome = self._welcome(session, session.stage, None)
        if role == "trainer":  # it holds the stage's weights at the stream's version: it keeps them
            welcome = msgspec.structs.replace(welcome, source="keep", source_peer=None, stage_checkpoint=None)
        await self.members.send(peer, msgspec.structs.replace(welcome, role_reason=why[:300]))

    def stage_lost(self, stage: int) -> str | None:
        """Why ``stage`` cannot be served at the run's version, or None. Its weights of that
        version exist only on its replicas and in a checkpoint of exactly that version: with
        every replica gone and no such checkpoint, training pauses (a new node would otherwise
        serve base weights labelled with the current version)."""
        version = self.book.version
        if version == 0 or self.members.stage_replicas()[stage] or self.steps.checkpoint_of(stage, version):
            return None
        last = self.steps.checkpoint_versions.get(stage)
        return (f"training is paused: every replica of stage {stage} left and no checkpoint of version {version} "
                f"exists (its last is {'unknown' if last is None else f'of version {last}'}); bring back a node "
                "that held it, or start a new run")

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
        self.evals.request(self.book.version, final=True)
        return web.json_response({"finished_at_version": self.book.version})

    async def _post_export(self, request: web.Request) -> web.Response:
        from engine.swarm.export_api import ExportRefused, plan_export

        try:  # the body is capped by client_max_size, then by plan_export
            plan = await plan_export(self, await request.read())
        except ExportRefused as exc:
            return web.json_response({"error": str(exc)[:500]}, status=400)
        return web.Response(body=msgspec.json.encode(plan), content_type="application/json")

    async def _stats(self, request: web.Request) -> web.Response:
        return self._stats_answer(request, self.stats_view.public)

    async def _admin_stats(self, request: web.Request) -> web.Response:
        return self._stats_answer(request, self.stats_view.admin)

    @staticmethod
    def _stats_answer(request: web.Request, view: Callable[[StatsQuery], dict[str, Any]]) -> web.Response:
        try:
            query = StatsQuery.parse(request.query)
        except ValueError as exc:
            return web.json_response({"error": str(exc)[:500]}, status=400)
        return web.json_response(view(query))

    def bandwidth(self) -> dict[str, Any]:
        """Bytes per version of each stage, each node's uplink and upload time, joins placed by uplink
        (``engine.swarm.bandwidth_placement``)."""
        return self.placement.snapshot(self.members.stage_replicas(), self._version_s,
                                       self.members.inference_replicas())

    def stats(self, query: StatsQuery | None = None) -> dict[str, Any]:
        """Everything ``/api/admin/stats`` shows (``engine.swarm.stats_view``), for callers in this process."""
        return self.stats_view.admin(query or StatsQuery())
