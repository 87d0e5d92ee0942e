"""A swarm node: holds one pipeline stage, serves generation and training over WebRTC.

Lifecycle: connect to the coordinator's ``/node`` websocket, prove the identity
(signed challenge), receive a stage assignment (``welcome``), load only that
stage (from the base checkpoint, a stage checkpoint, or weights fetched from a
replica over WebRTC), then serve jobs until told to stop. If the coordinator
goes away the node keeps its weights and reconnects with backoff; links to
other nodes are peer-to-peer and survive. A node is a trainer or (with
``NodeConfig.inference_only``) an inference replica that only generates and
follows its stage leader's weight stream.

:class:`Node` is the composition root: it builds the collaborators, applies
welcomes (loading), and dispatches each validated message through a table
keyed by its type. The collaborators share a
:class:`~engine.swarm.node_context.NodeContext` and never touch each other:

* ``engine.swarm.coordinator_session`` - websocket, hello, welcome, reconnect/backoff;
* ``engine.swarm.peer_links`` - signalling, WebRTC links, bandwidth caps, send deadlines;
* ``engine.swarm.generation`` - KV-cached generation jobs, hops, sampling on the last stage;
* ``engine.swarm.training`` - micro-batch forward/backward, proximal passes;
* ``engine.swarm.replica_step`` - gradient shares, the optimiser step, weights between replicas;
* ``engine.swarm.weight_stream_leader`` / ``engine.swarm.inference_replica`` - the weight stream;
* ``engine.swarm.node_status`` - reports to the coordinator, events to the supervisor.
* ``engine.swarm.export_permits`` - exporters the coordinator lets fetch our stage's full weights
  (``polis export --coordinator``: a link from them is accepted, ``weights_req`` answered, no stream).

Threads: everything here lives on the asyncio loop; the stage lives on a
:class:`~engine.swarm.compute_thread.ComputeThread` and is only touched there.
Messages from peers are validated (``engine.swarm.messages``) and accepted only
from the peer the route says should send them.

What it does not know: rewards, advantages, task prompts (the coordinator's),
or how tensors are computed (``engine.swarm.stage_runtime``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.base import OptimizerConfig, StageSpec
from engine.net.errors import ProtocolViolation
from engine.net.identity import Identity, split_pinned_url
from engine.paths import user_data_dir
from engine.swarm import messages
from engine.swarm.compute_thread import ComputeThread
from engine.swarm.coordinator_session import CoordinatorSession, hello_bytes
from engine.swarm.export_permits import ExportPermits
from engine.swarm.generation import Generation
from engine.swarm.inference_replica import TRAINING_MESSAGES, InferenceReplica
from engine.swarm.node_context import CoordinatorSender, NodeContext, PeerSender
from engine.swarm.node_status import NodeStatus, remembered_uplink
from engine.swarm.peer_links import PeerLinks
from engine.swarm.pipeline_hops import check_hop, scheme_of
from engine.swarm.replica_step import ReplicaStep
from engine.swarm.run_config import run_config_from_dict
from engine.swarm.stage_loading import base_dir, load_from_files, load_from_peer, load_token_table
from engine.swarm.stage_runtime import StageRuntime
from engine.swarm.tickets import TicketChecker
from engine.swarm.training import Training
from engine.swarm.weight_stream_leader import WeightStreamLeader

__all__ = ["Node", "NodeConfig", "hello_bytes"]  # hello_bytes: the coordinator verifies hellos with it

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    """How this node joins and what it may use.

    coordinator_url: ``http://host:port`` of the coordinator.
    backend / device: stage backend (``auto``, ``torch``, ``mlx``) and device override.
    base_checkpoint: directory of the base checkpoint (None: the shipped one).
    data_dir: where stage checkpoints of this node go (None: the user data dir).
    cpu_threads: compute threads for the backend (None: the backend's default).
    max_layers: most decoder layers this node will hold (memory limit; None: any).
    upload_mbps / download_mbps: bandwidth caps in megabits per second (None: none).
    report_every_s: how often counters go to the coordinator and stats to the supervisor.
    reconnect_max_s: longest wait between attempts to reach the coordinator.
    share_timeout_s: how long a replica waits for the others' gradients before stepping.
    inference_only: join as an inference replica: hold one stage without optimiser state,
      take no training work, serve generation only, and follow the stage leader's weights
      through quantised deltas (announced to the coordinator in the signed hello).
    signal_url: signalling websocket to use instead of the one the welcome names (a node that
      reaches the coordinator through a proxy reaches its signalling through it too).
    wan_relay: ``host:port`` control address of an emulated-WAN relay (``engine.net.wan_hub``):
      every outgoing SDP is pointed at its stand-ins, so every link to a peer crosses it.
    wan_profile: this node's access-link profile at that relay (``engine.net.wan_profiles``).
    """

    coordinator_url: str
    backend: str = "auto"
    device: str | None = None
    base_checkpoint: str | None = None
    data_dir: str | None = None
    cpu_threads: int | None = None
    max_layers: int | None = None
    upload_mbps: float | None = None
    download_mbps: float | None = None
    report_every_s: float = 2.0
    reconnect_max_s: float = 10.0
    share_timeout_s: float = 20.0
    inference_only: bool = False
    signal_url: str | None = None
    wan_relay: str | None = None
    wan_profile: str = "metro"


def _wan_filter(config: NodeConfig):
    """The outgoing-SDP hook that sends every link through ``config.wan_relay`` (None without one)."""
    if not config.wan_relay:
        return None
    from engine.net.wan_hub import hub_sdp_filter, parse_address

    return hub_sdp_filter(parse_address(config.wan_relay), config.wan_profile)


class Node:
    """One contributor's stage. ``await node.run()`` until :meth:`request_stop`.

    ``peers`` / ``coordinator``: other senders than the real links and session (tests
    wire nodes together in memory with them); ``run`` needs the real ones.
    """

    def __init__(self, config: NodeConfig, identity: Identity, on_event: Callable[..., None] | None = None, *,
                 peers: PeerSender | None = None, coordinator: CoordinatorSender | None = None) -> None:
        self.config = config
        self.identity = identity
        self.emit = on_event or (lambda event, **fields: None)
        #: the role we offer in our hello; ``role``: the one the coordinator gave us (a trainer on links too
        #: slow to train serves generation only, ``engine.swarm.link_roles``), and ``role_reason`` why
        self.offered_role = self.role = "inference" if config.inference_only else "trainer"
        self.role_reason: str | None = None
        self.compute = ComputeThread(name=f"polis-compute-{identity.peer_id[:8]}")
        self._stop = asyncio.Event()
        self._running = asyncio.Event()
        self._running.set()
        self.limits: dict[str, Any] = {"upload_mbps": config.upload_mbps, "download_mbps": config.download_mbps,
                                       "cpu_threads": config.cpu_threads}
        self.links: PeerLinks | None = None
        self.session: CoordinatorSession | None = None
        ctx = self.ctx = NodeContext(peer_id=identity.peer_id, role=self.role, compute=self.compute,
                                     peers=peers, coordinator=coordinator)
        #: exporters (``polis export --coordinator``) the coordinator let fetch our stage's weights
        self.export_permits = ExportPermits()
        if peers is None:
            self.links = ctx.peers = PeerLinks(identity, ctx.tasks, self.on_peer,
                                               accept_peer=lambda p: (ctx.membership.is_member(p)
                                                                      or self.export_permits.allows(p)),
                                               upload_mbps=config.upload_mbps, download_mbps=config.download_mbps,
                                               sdp_filter=_wan_filter(config))
            self.links.on_new_link = ctx.boundary.forget_peer  # a new link may lead to a peer without our bases
        self.generation = Generation(ctx)
        self.training = Training(ctx)
        self.leader = WeightStreamLeader(ctx)
        self.replica = InferenceReplica(ctx)
        self.replicas = ReplicaStep(ctx, share_timeout_s=config.share_timeout_s, data_dir=config.data_dir,
                                    release_through=self.training.release_through,
                                    after_step=self.leader.after_step)
        self.status = NodeStatus(ctx, coordinator_url=split_pinned_url(config.coordinator_url)[0],
                                 report_every_s=config.report_every_s,
                                 emit=self.emit, bytes_moved=self.bytes_moved, expire=self._expire_jobs,
                                 link_count=self.links.link_count if self.links else lambda: 0,
                                 limits=self.limits, link_rtt_ms=self.links.rtt_ms if self.links else dict,
                                 send_rates=self.links.send_rates if self.links else dict,
                                 data_dir=self._data_dir())
        ctx.on_status = self.status.emit_status
        if coordinator is None:
            self.session = ctx.coordinator = CoordinatorSession(
                config.coordinator_url, identity, ctx.tasks, hello_fields=self._hello_fields,
                on_welcome=self._welcomed, on_message=self.on_coordinator,
                on_members=lambda msg: ctx.membership.update(msg.stages, msg.inference, msg.leaders),
                while_connected=self.status.report_loop, emit=self.emit, set_state=self.status.set_state,
                reconnect_max_s=config.reconnect_max_s)
        self._coordinator_handlers: dict[type, Callable[[Any], None]] = {
            messages.Gen: self.generation.on_gen,
            messages.GenRelease: self.generation.on_release,
            messages.TrainIn: self.training.on_train_in,
            messages.TrainOut: self.training.on_train_out,
            messages.Apply: self.replicas.on_apply,
            messages.Abort: self._on_abort,
            messages.Members: self._on_members,
            messages.Sync: self.replicas.on_sync,
            messages.Welcome: self._on_reassign,
            messages.Shutdown: self._on_shutdown,
            messages.ExportPermit: self.export_permits.grant,
        }
        self._peer_handlers: dict[type, Callable[[str, Any, bytes], None]] = {
            messages.Act: self._on_act,
            messages.Grad: self._on_grad,
            messages.Tok: self.generation.on_tok,
            messages.Drop: self.generation.on_drop,
            messages.Share: self.replicas.on_share,
            messages.TiedGrad: self.replicas.tied.on_tied_grad,
            messages.WeightsReq: self._on_weights_req,
        }

    # ------------------------------------------------------------------ views
    @property
    def rt(self) -> StageRuntime | None:
        return self.ctx.stage.rt

    @property
    def spec(self) -> StageSpec | None:
        return self.ctx.stage.spec

    @property
    def state(self) -> str:
        return self.status.state

    @property
    def stream_stats(self) -> dict[str, int]:
        """Weight-stream counters: deltas sent (as a leader), applied, full loads, resyncs (as a replica)."""
        return {**self.leader.stats, **self.replica.stats}

    def bytes_moved(self) -> tuple[float, float]:
        return self.links.bytes_moved() if self.links is not None else (0.0, 0.0)

    def emit_status(self, force: bool = False) -> None:
        self.status.emit_status(force)

    # ------------------------------------------------------------------ lifecycle
    def request_stop(self) -> None:
        self._stop.set()
        self._running.set()

    def pause(self) -> None:
        """Leave the swarm (finishing nothing new) but keep the stage loaded."""
        if self._running.is_set():
            self._running.clear()
            self.status.set_state("paused", "paused: not taking work")

    def resume(self) -> None:
        self._running.set()

    async def start_compute(self) -> None:
        """Create the compute thread's stage runtime (detects the device)."""
        if self.ctx.stage.rt is None:
            self.ctx.stage.rt = await self.compute.run(StageRuntime, self.config.backend, self.config.device,
                                                       self.config.cpu_threads)

    def set_limits(self, limits: dict[str, Any]) -> None:
        """Apply new limits now (bandwidth caps take effect on the next message)."""
        self.limits.update(limits)
        if self.links is not None:
            if "upload_mbps" in limits:
                self.links.upload.set_rate(limits["upload_mbps"])
            if "download_mbps" in limits:
                self.links.download.set_rate(limits["download_mbps"])

    async def run(self) -> None:
        """Serve until stopped, reconnecting to the coordinator whenever it goes away."""
        await self.start_compute()
        try:
            await self.session.serve(self._stop, self._running, on_lost=self._abandon_jobs)
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        self.status.set_state("stopping", "leaving the swarm")
        await self.ctx.tasks.cancel_all()
        if self.links is not None:
            await self.links.close()
        await self.status.close()
        if self.ctx.stage.rt is not None:
            await self.compute.run(self.ctx.stage.rt.close)
        self.compute.stop()

    # ------------------------------------------------------------------ welcome / loading
    def _hello_fields(self) -> dict[str, Any]:
        stage, spec, rt = self.ctx.stage, self.ctx.stage.spec, self.ctx.stage.rt
        return {"backend": rt.backend_name, "device": str(self.config.device or ""),
                "max_layers": self.config.max_layers,
                "stage": spec.stage_index if spec else None, "num_stages": spec.num_stages if spec else None,
                "version": rt.version, "run_id": stage.run_id,
                "has_base": (base_dir(self.config.base_checkpoint) / "config.json").exists(),
                "role": self.offered_role,
                "uplink_mbps": self._uplink_claim()}

    async def _welcomed(self, welcome: messages.Welcome) -> None:
        """Load what the welcome assigns, then tell the coordinator we are ready."""
        key = self.session.coordinator_key if self.session is not None else None
        if key is not None and (self.ctx.tickets is None or self.ctx.tickets.public_key != key):
            self.ctx.tickets = TicketChecker(key)  # from now on peers' jobs need this coordinator's tickets
        try:
            await self._apply_welcome(welcome)
        except Exception as exc:  # a stage we cannot load: say so and leave this coordinator
            log.error("could not load the assigned stage: %s", exc)
            self.emit("error", message=f"Could not load the assigned stage: {exc}",
                      hint="Check the base checkpoint path and free memory, then restart.", fatal=False)
            await self.session.close()
            return
        await self._ready()
        self._connect_neighbours()

    async def _ready(self) -> None:
        stage = self.ctx.stage
        await self.ctx.coordinator.send(messages.Ready(stage=stage.spec.stage_index, version=int(stage.rt.version)))
        note = f" (generating only: {self.role_reason})" if self.role == "inference" and self.role_reason else ""
        self.status.set_state("contributing", f"serving {stage.spec.describe(stage.num_layers)}{note}")
        self.status.emit_status()

    async def _apply_welcome(self, welcome: messages.Welcome) -> None:
        ctx, stage = self.ctx, self.ctx.stage
        stage.run_cfg = run_config_from_dict(welcome.run)
        stage.run_id = welcome.run_id
        spec = StageSpec(welcome.stage, welcome.num_stages, welcome.layer_start, welcome.layer_end)
        stage.num_layers = welcome.num_layers
        role = welcome.role or self.offered_role
        changed, self.role_reason = role != self.role, welcome.role_reason
        if changed:
            log.warning("the coordinator moved this node to the %s role: %s", role, welcome.role_reason or "no reason")
            self.role = ctx.role = role
        optimizer = OptimizerConfig(lr=stage.run_cfg.lr, trainable=self.role == "trainer",
                                    lora=stage.run_cfg.lora.backend_config())
        if self.links is not None:
            await self.links.start(self.config.signal_url or welcome.signal_url)
        keep = stage.spec == spec and welcome.source == "keep" and stage.rt.backend is not None
        if changed or not keep:
            await self.replica.before_load()
            await self.leader.clear()
        if keep and changed:  # an inference replica told to train: its own weights, now with an optimiser
            await ctx.compute.run(stage.rt.reload, optimizer)
        elif not keep:
            self.status.set_state("loading", f"loading {spec.describe(stage.num_layers)}")
            if welcome.source == "peer" and welcome.source_peer:
                base = self._base_dir() if optimizer.lora.enabled else None  # LoRA: the frozen base from files
                header, weights = await load_from_peer(ctx, spec, welcome.source_peer, optimizer, base,
                                                       moments=self.replicas.wants_moments())
                await self.replica.joined(welcome.source_peer, header, weights)
            else:
                await load_from_files(ctx, self._base_dir(), spec, optimizer, welcome.stage_checkpoint,
                                      welcome.version)
        stage.spec = spec
        self.replicas.new_weights(fresh=not keep)
        ctx.membership.coordinator_version = welcome.version
        self.replica.after_load()
        await self._load_token_table()

    async def _load_token_table(self) -> None:
        """A token-predicted activation scheme's table (the base's embeddings), read once; without
        the base on this machine the node sends plain bases and cannot decode predicted ones."""
        ctx = self.ctx
        if ctx.boundary.token_table is not None or not scheme_of(ctx.stage.run_cfg.activation_encoding).params.get(
                "predict"):
            return
        try:
            ctx.boundary.token_table = await ctx.compute.run(load_token_table, self._base_dir())
        except (OSError, ValueError) as exc:  # a missing or broken base costs compression, not the node
            log.warning("no token table for %s (%s): this node sends plain bases; install the run's model "
                        "to decode predicted activations", ctx.stage.run_cfg.activation_encoding, exc)

    def _data_dir(self) -> Path:
        return Path(self.config.data_dir) if self.config.data_dir else user_data_dir()

    def _uplink_claim(self) -> float | None:
        """The uplink this node tells the coordinator (Mbit/s): the smaller of its upload cap and the
        uplink it measured last time (``engine.swarm.node_status.remembered_uplink``), if any."""
        known = [m for m in (self.limits.get("upload_mbps"), remembered_uplink(self._data_dir())) if m]
        return min(known) if known else None

    def _base_dir(self):
        """This machine's copy of the run's model (raises, saying how to import it, when absent)."""
        return base_dir(self.config.base_checkpoint, self.ctx.stage.run_cfg.model)

    def _connect_neighbours(self) -> None:
        """Open links ahead of need to every peer we will exchange with (neighbour stages, replicas)."""
        spec, stages = self.ctx.stage.spec, self.ctx.membership.stages
        if spec is None or self.links is None:
            return
        wanted = set()
        for s in (spec.stage_index - 1, spec.stage_index, spec.stage_index + 1):
            if 0 <= s < len(stages):
                wanted.update(stages[s])
        if spec.is_last and stages:
            wanted.update(stages[0])  # sampled tokens go back to stage 0
        self.links.connect_ahead(wanted)

    # ------------------------------------------------------------------ coordinator messages
    def on_coordinator(self, msg: messages.CoordinatorToNode) -> None:
        """A decoded coordinator message: dispatch on its type."""
        if isinstance(msg, TRAINING_MESSAGES) and self.role != "trainer":
            log.warning("ignored '%s': this node is an inference replica and does no training",
                        msg.__struct_config__.tag)
            return
        handler = self._coordinator_handlers.get(type(msg))
        if handler is not None:
            handler(msg)

    def _on_abort(self, msg: messages.Abort) -> None:
        self.ctx.tasks.spawn(self._abort(msg.step), f"polis-abort-{msg.step}")

    async def _abort(self, step: int) -> None:
        await self.training.abort(step)
        self.replicas.forget(step)

    def _on_members(self, msg: messages.Members) -> None:
        self.ctx.membership.update(msg.stages, msg.inference, msg.leaders)
        self.ctx.membership.coordinator_version = msg.version
        self._connect_neighbours()
        self.status.emit_status()

    def _on_reassign(self, msg: messages.Welcome) -> None:
        self.ctx.tasks.spawn(self._reassign(msg), "polis-reassign")

    async def _reassign(self, msg: messages.Welcome) -> None:
        self._abandon_jobs()
        await self._apply_welcome(msg)
        await self._ready()

    def _on_shutdown(self, msg: messages.Shutdown) -> None:
        log.info("coordinator asked us to stop: %s", msg.reason)
        self.request_stop()

    # ------------------------------------------------------------------ peer messages
    def on_peer(self, sender: str, header: messages.PeerMessage, payload: bytes) -> None:
        """A decoded peer message: check it may reach us now, dispatch on its type."""
        if isinstance(header, (messages.WDelta, messages.WLead)):  # queued even while loading
            self.replica.on_stream_message(sender, header, payload)
            return
        if isinstance(header, messages.Weights):  # a node that holds no stage yet loads from these
            self.ctx.weights.deliver(sender, header, payload)  # (only from the peer it asked)
            return
        kind = header.__struct_config__.tag
        if not self.ctx.stage.loaded():
            raise ProtocolViolation(f"'{kind}' arrived before this node holds a stage")
        spec = self.ctx.stage.spec
        if isinstance(header, (messages.Act, messages.Drop, messages.Grad)):
            if self.ctx.tickets is not None:  # the route is the coordinator's, not the sender's
                self.ctx.tickets.check(kind, header.ticket, header.job, header.route)
            check_hop(kind, header, sender, self.ctx.peer_id, spec.stage_index, spec.num_stages)
        handler = self._peer_handlers.get(type(header))
        if handler is not None:
            handler(sender, header, payload)

    def _on_act(self, sender: str, header: messages.Act, payload: bytes) -> None:
        x = self.ctx.boundary.decode(header.tensor, payload, self.ctx.stage.rt.hidden_size, sender)
        (self.generation if header.kind == "gen" else self.training).on_act(sender, header, x)

    def _on_grad(self, sender: str, header: messages.Grad, payload: bytes) -> None:
        grad = self.ctx.boundary.decode(header.tensor, payload, self.ctx.stage.rt.hidden_size, sender)
        self.training.on_grad(sender, header, grad)

    def _on_weights_req(self, sender: str, header: messages.WeightsReq, payload: bytes) -> None:
        exporter = sender not in self.ctx.stage_members() and self.export_permits.allows(sender, header.stage)
        if header.stage != self.ctx.stage.spec.stage_index or not (exporter or sender in self.ctx.stage_members()):
            raise ProtocolViolation(f"weights of stage {header.stage} asked by {sender}, not a replica of ours")
        if exporter and (header.stream or header.outer_state or header.optimizer_state):
            raise ProtocolViolation(f"exporter {sender} asked for a weight stream or optimiser state")
        if header.stream:
            self.leader.on_stream_request(sender, header, payload)
        else:
            self.replicas.on_weights_req(sender, header, payload)

    # ------------------------------------------------------------------ housekeeping
    def _abandon_jobs(self) -> None:
        """Forget every job in flight (coordinator lost, or reassigned); free their memory."""
        if self.ctx.stage.rt is None or self.ctx.stage.rt.backend is None:
            return
        self.generation.abandon()
        self.training.abandon()
        self.replicas.forget()

    def _expire_jobs(self, cutoff: float) -> None:
        self.generation.expire(cutoff)
        self.training.expire(cutoff)
