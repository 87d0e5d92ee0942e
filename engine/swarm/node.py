"""A swarm node: holds one pipeline stage, serves generation and training over WebRTC.

Lifecycle: connect to the coordinator's ``/node`` websocket, prove the identity
(signed challenge), receive a stage assignment (``welcome``), load only that
stage (from the base checkpoint, a stage checkpoint, or weights fetched from a
replica over WebRTC), then serve jobs until told to stop. If the coordinator
goes away the node keeps its weights and reconnects with backoff; links to
other nodes are peer-to-peer and survive. A node is a trainer or (with
``NodeConfig.inference_only``) an inference replica that only generates and
follows its stage leader's weight stream (``engine.swarm.inference_replica``).

Threads: this object lives on the asyncio loop; the stage lives on a
:class:`~engine.swarm.compute_thread.ComputeThread` and is only touched there.
Messages from peers are validated (``engine.swarm.messages``) and accepted only
from the peer the route says should send them.

What it does not know: rewards, advantages, task prompts (the coordinator's),
or how tensors are computed (``engine.swarm.stage_runtime``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp
import numpy as np

from backends.base import OptimizerConfig, StageSpec
from engine import __version__
from engine.net.errors import LinkClosed, ProtocolViolation
from engine.net.identity import Identity
from engine.net.peer_link import LinkConfig, PeerLink
from engine.net.peer_manager import PeerManager, PeerManagerConfig
from engine.net.signalling import SignallingClient
from engine.net.tensor_codec import decode_tensor, encode_tensor
from engine.swarm import messages, tensor_bundle
from engine.swarm.compute_thread import ComputeThread
from engine.swarm.inference_replica import InferenceReplica
from engine.swarm.node_jobs import NodeJobs
from engine.swarm.rate_limit import TokenBucket
from engine.swarm.replica_sync import ReplicaCompressor
from engine.swarm.run_config import RunConfig, run_config_from_dict
from engine.swarm.stage_runtime import StageRuntime

log = logging.getLogger(__name__)

#: most elements of one activation tensor a node decodes (rows x tokens x hidden)
MAX_ACTIVATION_ELEMENTS = 1 << 26
HELLO_DOMAIN = b"polis-node-hello\x00"


def hello_bytes(nonce: str, public_key: bytes) -> bytes:
    """What a node signs to prove its identity to the coordinator."""
    return HELLO_DOMAIN + nonce.encode() + b"\x00" + public_key


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


@dataclass
class _LastStageJob:
    """What the last stage accumulates while a generation job decodes."""

    rows: int
    tokens: list[list[int]]
    logprobs: list[list[float]]
    finished: np.ndarray
    versions: list[int]
    steps: int = 0


@dataclass
class _TrainSlot:
    """Last stage: a micro-batch waits for its activations and its targets."""

    act: tuple[dict, np.ndarray] | None = None
    out: dict | None = None
    created: float = field(default_factory=time.monotonic)


class Node(NodeJobs, InferenceReplica):
    """One contributor's stage. ``await node.run()`` until :meth:`request_stop`.

    Connection, loading and links are here; what each job message does is in
    :class:`~engine.swarm.node_jobs.NodeJobs`; the weight stream to and from inference
    replicas is in :class:`~engine.swarm.inference_replica.InferenceReplica`.
    """

    def __init__(self, config: NodeConfig, identity: Identity,
                 on_event: Callable[..., None] | None = None) -> None:
        self.config = config
        self.identity = identity
        self.emit = on_event or (lambda event, **fields: None)
        self.compute = ComputeThread(name=f"polis-compute-{identity.peer_id[:8]}")
        self.rt: StageRuntime | None = None
        self.run_cfg: RunConfig | None = None
        self.spec: StageSpec | None = None
        self.num_layers = 0
        self.run_id: str | None = None
        self.members: list[list[str]] = []
        self.coordinator_version = 0
        self.state = "idle"
        self.counters = {"tokens_generated": 0.0, "microbatches_trained": 0.0}
        self._reported = {"tokens_generated": 0.0, "microbatches_trained": 0.0, "bytes_sent": 0.0,
                          "bytes_received": 0.0, "uptime_s": 0.0}
        self._started = time.monotonic()
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._signal: SignallingClient | None = None
        self._pm: PeerManager | None = None
        self._link_locks: dict[str, asyncio.Lock] = {}
        self._dialing: set[str] = set()
        self._gen_last: dict[str, _LastStageJob] = {}
        self._gen_first: dict[str, dict] = {}
        self._gen_mid_touch: dict[str, float] = {}
        self._train_slots: dict[str, _TrainSlot] = {}
        self._train_keys: set[str] = set()
        self._shares: dict[int, dict[str, tuple[list, bytes]]] = {}
        self._share_event = asyncio.Event()
        self._weights_waiter: asyncio.Future | None = None
        self._weights_from: str | None = None
        self._init_weight_stream()
        self._compressor: ReplicaCompressor | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self._running = asyncio.Event()
        self._running.set()
        self._bytes_closed_links = [0.0, 0.0]
        self.upload = TokenBucket(config.upload_mbps)
        self.download = TokenBucket(config.download_mbps)
        self.limits: dict[str, Any] = {"upload_mbps": config.upload_mbps, "download_mbps": config.download_mbps,
                                       "cpu_threads": config.cpu_threads}

    # ------------------------------------------------------------------ lifecycle
    def request_stop(self) -> None:
        self._stop.set()
        self._running.set()

    def pause(self) -> None:
        """Leave the swarm (finishing nothing new) but keep the stage loaded."""
        if self._running.is_set():
            self._running.clear()
            self._set_state("paused", "paused: not taking work")

    def resume(self) -> None:
        self._running.set()

    async def start_compute(self) -> None:
        """Create the compute thread's stage runtime (detects the device)."""
        if self.rt is None:
            self.rt = await self.compute.run(StageRuntime, self.config.backend, self.config.device,
                                             self.config.cpu_threads)

    def set_limits(self, limits: dict[str, Any]) -> None:
        """Apply new limits now (bandwidth caps take effect on the next message)."""
        self.limits.update(limits)
        if "upload_mbps" in limits:
            self.upload.set_rate(limits["upload_mbps"])
        if "download_mbps" in limits:
            self.download.set_rate(limits["download_mbps"])

    def _set_state(self, state: str, detail: str) -> None:
        self.state = state
        self.emit("state", state=state, detail=detail)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("task %s failed: %s", task.get_name(), exc, exc_info=exc)

    async def run(self) -> None:
        """Serve until stopped, reconnecting to the coordinator whenever it goes away."""
        await self.start_compute()
        delay = 0.5
        try:
            while not self._stop.is_set():
                if not self._running.is_set():
                    await self._running.wait()
                    continue
                self._set_state("connecting", f"reaching the coordinator at {self.config.coordinator_url}")
                try:
                    await self._session()
                    delay = 0.5
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ConnectionError) as exc:
                    log.info("coordinator unreachable (%s); retrying in %.1f s", exc, delay)
                    self.emit("log", level="warning",
                              message=f"Cannot reach the coordinator ({exc.__class__.__name__}); retrying.")
                except ProtocolViolation as exc:
                    log.warning("coordinator sent something invalid: %s", exc)
                self._abandon_jobs()
                if self._stop.is_set():
                    break
                if not self._running.is_set():
                    delay = 0.5
                    continue
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                delay = min(delay * 2, self.config.reconnect_max_s)
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        self._set_state("stopping", "leaving the swarm")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._pm is not None:
            await self._pm.close()
        if self._signal is not None:
            await self._signal.close()
        if self.rt is not None:
            await self.compute.run(self.rt.close)
        self.compute.stop()

    # ------------------------------------------------------------------ coordinator session
    async def _session(self) -> None:
        url = self.config.coordinator_url.rstrip("/") + "/node"
        timeout = aiohttp.ClientTimeout(total=None, connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.ws_connect(url, max_msg_size=messages.MAX_WS_MESSAGE_CHARS, heartbeat=10.0) as ws:
                challenge = await self._recv(ws, "challenge")
                await ws.send_json(self._hello(challenge["nonce"]))
                welcome = await self._recv(ws, "welcome")
                self._ws = ws
                # Load while reading the websocket, so heartbeats are answered during a long load.
                loader = self._spawn(self._load_and_report_ready(welcome), "polis-node-load")
                reporter = self._spawn(self._report_loop(), "polis-node-report")
                stopper = self._spawn(self._close_on_stop(ws), "polis-node-stopper")
                try:
                    async for msg in ws:
                        if msg.type != aiohttp.WSMsgType.TEXT:
                            break
                        try:
                            data = messages.COORDINATOR_TO_NODE.validate(json.loads(msg.data))
                        except (ValueError, ProtocolViolation) as exc:
                            log.warning("dropped an invalid coordinator message: %s", exc)
                            continue
                        self._on_coordinator(data)
                finally:
                    loader.cancel()
                    reporter.cancel()
                    stopper.cancel()
                    self._ws = None

    async def _load_and_report_ready(self, welcome: dict) -> None:
        try:
            await self._apply_welcome(welcome)
        except Exception as exc:  # a stage we cannot load: say so and leave this coordinator
            log.error("could not load the assigned stage: %s", exc)
            self.emit("error", message=f"Could not load the assigned stage: {exc}",
                      hint="Check the base checkpoint path and free memory, then restart.", fatal=False)
            if self._ws is not None:
                await self._ws.close()
            return
        await self._send_coordinator({"type": "ready", "stage": self.spec.stage_index, "version": self.rt.version})
        self._set_state("contributing", f"serving {self.spec.describe(self.num_layers)}")
        self._connect_neighbours()
        self._emit_status()

    async def _close_on_stop(self, ws) -> None:
        """Close the session when the node is stopped or paused."""
        while not self._stop.is_set() and self._running.is_set():
            await asyncio.sleep(0.1)
        await ws.close()

    async def _recv(self, ws, kind: str) -> dict:
        while True:
            msg = await asyncio.wait_for(ws.receive(), 30.0)
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise ConnectionError(f"coordinator closed the connection while we waited for '{kind}'")
            data = messages.COORDINATOR_TO_NODE.validate(json.loads(msg.data))
            if data["type"] == "shutdown":
                raise ConnectionError(f"coordinator refused us: {data['reason']}")
            if data["type"] == "members":
                self.members = data["stages"]
                self.inference_peers = set(data.get("inference") or ())
                continue
            if data["type"] != kind:
                raise ProtocolViolation(f"expected '{kind}', got '{data['type']}'")
            return data

    def _hello(self, nonce: str) -> dict:
        base = self._base_dir()
        return {"type": "hello", "peer_id": self.identity.peer_id,
                "public_key": base64.b64encode(self.identity.public_key).decode(),
                "signature": base64.b64encode(self.identity.sign(hello_bytes(nonce, self.identity.public_key))).decode(),
                "backend": self.rt.backend_name, "device": str(self.config.device or ""),
                "max_layers": self.config.max_layers,
                "stage": self.spec.stage_index if self.spec else None,
                "num_stages": self.spec.num_stages if self.spec else None,
                "version": self.rt.version, "run_id": self.run_id,
                "has_base": (base / "config.json").exists(), "role": self.role}

    def _base_dir(self) -> Path:
        if self.config.base_checkpoint:
            return Path(self.config.base_checkpoint)
        from engine.paths import base_checkpoint_dir

        return base_checkpoint_dir()

    async def _send_coordinator(self, message: dict) -> None:
        ws = self._ws
        if ws is None or ws.closed:
            log.debug("coordinator away; dropped %s", message.get("type"))
            return
        await ws.send_json(message)

    # ------------------------------------------------------------------ welcome / loading
    async def _apply_welcome(self, w: dict) -> None:
        self.run_cfg = run_config_from_dict(w["run"])
        self.run_id = w["run_id"]
        spec = StageSpec(w["stage"], w["num_stages"], w["layer_start"], w["layer_end"])
        self.num_layers = w["num_layers"]
        optimizer = OptimizerConfig(lr=self.run_cfg.lr, trainable=self.role == "trainer")
        if self._signal is None or self._signal.url != w["signal_url"]:
            await self._start_links(w["signal_url"])
        keep = self.spec == spec and w["source"] == "keep" and self.rt.backend is not None
        if not keep:
            await self._stream_before_load()
            self._set_state("loading", f"loading {spec.describe(self.num_layers)}")
            if w["source"] == "peer" and w["source_peer"]:
                await self._load_from_peer(spec, w["source_peer"], optimizer)
            else:
                # an inference replica serves as the version its files hold (rollouts carry it)
                await self.compute.run(self.rt.load_checkpoint, self._base_dir(), spec, optimizer,
                                       w["stage_checkpoint"] or None,
                                       None if self.role == "inference" else w["version"])
            self._compressor = ReplicaCompressor(self.run_cfg.update_encoding, self.run_cfg.update_topk_fraction)
        self.spec = spec
        if self._compressor is None:
            self._compressor = ReplicaCompressor(self.run_cfg.update_encoding, self.run_cfg.update_topk_fraction)
        self.coordinator_version = w["version"]
        self._stream_after_load()

    async def _start_links(self, signal_url: str) -> None:
        if self._pm is not None:
            await self._pm.close()
        if self._signal is not None:
            await self._signal.close()
        self._signal = SignallingClient(signal_url, self.identity)
        await self._signal.connect()
        self._pm = PeerManager(self._signal, PeerManagerConfig(link=LinkConfig()),
                               validator=messages.PEER_MESSAGES.validate, accept_peer=self._is_member)
        self._pm.on_link = lambda link: self._spawn(self._read_link(link), f"polis-read-{link.peer_id[:8]}")

    def _is_member(self, peer_id: str) -> bool:
        return any(peer_id in ids for ids in self.members) or not self.members

    async def _load_from_peer(self, spec: StageSpec, peer: str, optimizer: OptimizerConfig) -> None:
        waiter = self._expect_weights(peer)
        request = {"type": "weights_req", "stage": spec.stage_index}
        if self.role == "inference":
            request["stream"] = True  # and follow the weight stream that starts from these weights
        await self._send(peer, request)
        header, payload, config_dict = await asyncio.wait_for(waiter, 60.0)
        from engine.model.config import ModelConfig
        from backends.stage_layout import plan_stage

        config = ModelConfig.from_dict(config_dict, source=f"replica {peer}")
        names = [e["name"] for e in header["tensors"]]
        layout = plan_stage(spec, config, names)
        weights = tensor_bundle.unpack(header["tensors"], payload, layout.shapes, require_all=True)
        await self.compute.run(self.rt.load_weights, spec, config_dict, weights, optimizer, header["version"])
        log.info("loaded stage %d (version %d) from replica %s", spec.stage_index, header["version"], peer)
        await self._stream_joined(peer, header, weights)

    def _expect_weights(self, peer: str) -> asyncio.Future:
        """A future for the ``weights`` message we are about to ask ``peer`` for (only its answer counts)."""
        self._weights_waiter = asyncio.get_running_loop().create_future()
        self._weights_from = peer
        return self._weights_waiter

    # ------------------------------------------------------------------ peers
    async def _link(self, peer: str) -> PeerLink:
        lock = self._link_locks.setdefault(peer, asyncio.Lock())
        async with lock:
            return await self._pm.ensure_link(peer)

    async def _send(self, peer: str, header: dict, payload: bytes = b"", channel: str = "control") -> None:
        if peer == self.identity.peer_id:
            self._on_peer(peer, header, payload)
            return
        await self.upload.consume(len(payload) + 64)
        link = await self._link(peer)
        await link.send(header, payload, channel="bulk" if payload else channel)

    async def _read_link(self, link: PeerLink) -> None:
        try:
            async for header, payload in link:
                await self.download.consume(len(payload) + 64)
                try:
                    self._on_peer(link.peer_id, header, payload)
                except ProtocolViolation as exc:
                    link.report_violation(str(exc))
        except LinkClosed:
            pass
        finally:
            self._bytes_closed_links[0] += link.stats.wire_bytes_sent
            self._bytes_closed_links[1] += link.stats.wire_bytes_received

    def bytes_moved(self) -> tuple[float, float]:
        sent, received = self._bytes_closed_links
        if self._pm is not None:
            for link in self._pm.links.values():
                sent += link.stats.wire_bytes_sent
                received += link.stats.wire_bytes_received
        return sent, received

    def _decode_activation(self, header: dict, payload: bytes) -> np.ndarray:
        x = decode_tensor(header, payload, max_elements=MAX_ACTIVATION_ELEMENTS, expected_dtype="float32")
        if x.ndim != 3 or x.shape[2] != self.rt.hidden_size:
            raise ProtocolViolation(f"activation of shape {list(x.shape)} does not fit hidden size "
                                    f"{self.rt.hidden_size}")
        return x

    def _forward_encoded(self, forward, key: str, x: np.ndarray) -> tuple[dict, bytes]:
        """Compute thread: run a stage forward and encode its output for the wire, in one hop."""
        return self._encode_activation(forward(key, x))

    def _encode_activation(self, x: np.ndarray) -> tuple[dict, bytes]:
        enc = encode_tensor(np.asarray(x, dtype=np.float32), self.run_cfg.activation_encoding)
        return enc.header, bytes(enc.payload)
