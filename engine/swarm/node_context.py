"""What a node's collaborators share, and the small interfaces they talk through.

A node (``engine.swarm.node``) is composed of collaborators - generation,
training, replica steps, the weight-stream leader, the inference replica,
status - that never reach into each other's attributes. They share one
:class:`NodeContext`:

* who we are (``peer_id``, ``role``) and the stage we hold (:class:`HeldStage`),
* who else is in the swarm (:class:`Membership`),
* the :class:`~engine.swarm.compute_thread.ComputeThread` (every tensor call),
* a :class:`TaskSpawner` (every task named, failures logged, all cancelled at stop),
* a :class:`PeerSender` (messages to peers, each with a deadline; ``send_to_each`` for one message
  to several without waiting on the slowest) and a
  :class:`CoordinatorSender` (messages to the coordinator; dropped while it is away),
* a :class:`WeightsInbox` (the one ``weights`` answer a node waits for at a time),
* the ticket checker (``engine.swarm.tickets``) once a welcome gave the coordinator's key.

What it does not know: what any message means, how links or sessions are made.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.net.errors import ProtocolViolation
from engine.swarm.boundary_basis import BoundaryCodec

if TYPE_CHECKING:
    from backends.base import StageSpec
    from engine.swarm.compute_thread import ComputeThread
    from engine.swarm.messages import NodeToCoordinator, PeerMessage, Weights
    from engine.swarm.run_config import RunConfig
    from engine.swarm.stage_runtime import StageRuntime
    from engine.swarm.tickets import TicketChecker

log = logging.getLogger(__name__)


class PeerSender(Protocol):
    """Sends to other nodes; ``send`` raises (NetError, LinkClosed, TimeoutError) past its deadline."""

    async def send(self, peer: str, header: PeerMessage, payload: bytes = b"", channel: str = "control") -> None:
        ...

    def strike(self, peer: str, reason: str) -> None:
        """Count a protocol violation against ``peer`` (its link closes after a few)."""


class CoordinatorSender(Protocol):
    """Sends to the coordinator; a message while it is away is dropped (it resends work on reconnect)."""

    async def send(self, message: NodeToCoordinator) -> None: ...


#: most background tasks a node runs at once (each peer message may start one; a flood must not grow memory)
MAX_TASKS = 8192


class TaskSpawner:
    """Every background task of a node: named, kept until done, failures logged, cancelled at stop."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Run ``coro`` as a named task; a ``ProtocolViolation`` (and ``coro`` closed) past ``MAX_TASKS``."""
        if len(self._tasks) >= MAX_TASKS:
            coro.close()
            raise ProtocolViolation(f"{MAX_TASKS} tasks already running; refused {name}")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("task %s failed: %s", task.get_name(), exc, exc_info=exc)

    def pending(self) -> set[asyncio.Task]:
        return set(self._tasks)

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class HeldStage:
    """The stage this node holds: the runtime (compute thread only), its cut, and the run it belongs to.

    rt: the stage runtime (created on the compute thread; call it only through ``compute.run``).
    spec: which layers (None until a welcome was applied).
    run_cfg / run_id: the run's settings and id, from the welcome.
    num_layers: decoder layers of the whole model (for descriptions).
    """

    rt: StageRuntime | None = None
    spec: StageSpec | None = None
    run_cfg: RunConfig | None = None
    run_id: str | None = None
    num_layers: int = 0

    def loaded(self) -> bool:
        return self.spec is not None and self.rt is not None and self.rt.backend is not None


@dataclass
class Membership:
    """Who holds which stage, as the coordinator last said.

    stages: peer ids per stage (trainers and inference replicas together).
    inference: the members that are inference replicas.
    leaders: per stage, the trainer the coordinator named leader (None: none named).
    coordinator_version: the policy version the coordinator last announced.
    """

    stages: list[list[str]] = field(default_factory=list)
    inference: set[str] = field(default_factory=set)
    leaders: list[str | None] = field(default_factory=list)
    coordinator_version: int = 0

    def update(self, stages: list[list[str]], inference: Any, leaders: Any = ()) -> None:
        self.stages = stages
        self.inference = set(inference or ())
        self.leaders = list(leaders or ())

    def leader_of(self, stage: int) -> str | None:
        return self.leaders[stage] if stage < len(self.leaders) else None

    def of_stage(self, stage: int) -> list[str]:
        return self.stages[stage] if stage < len(self.stages) else []

    def is_member(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may open a link to us (anyone, before the first member list)."""
        return any(peer_id in ids for ids in self.stages) or not self.stages


class WeightsInbox:
    """The one ``weights`` message this node waits for; only the peer it asked may answer."""

    def __init__(self) -> None:
        self._waiter: asyncio.Future | None = None
        self._from: str | None = None

    def expect(self, peer: str) -> asyncio.Future:
        """A future for the ``weights`` we are about to ask ``peer`` for: ``(header, payload)``."""
        self._waiter = asyncio.get_running_loop().create_future()
        self._from = peer
        return self._waiter

    def busy(self) -> bool:
        return self._waiter is not None and not self._waiter.done()

    def deliver(self, sender: str, header: Weights, payload: bytes) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done() or sender != self._from:
            raise ProtocolViolation("unrequested weights")
        waiter.set_result((header, payload))


@dataclass
class NodeContext:
    """What every collaborator of a node may use (see the module docstring)."""

    peer_id: str
    role: str
    compute: ComputeThread
    peers: PeerSender
    coordinator: CoordinatorSender
    stage: HeldStage = field(default_factory=HeldStage)
    membership: Membership = field(default_factory=Membership)
    tasks: TaskSpawner = field(default_factory=TaskSpawner)
    weights: WeightsInbox = field(default_factory=WeightsInbox)
    #: verifies job tickets with the coordinator's key from its signed welcome (None: no key yet)
    tickets: TicketChecker | None = None
    #: work done since the start: ``tokens_generated``, ``microbatches_trained``
    counters: dict[str, float] = field(default_factory=lambda: {"tokens_generated": 0.0,
                                                                "microbatches_trained": 0.0})
    #: encodes and decodes stage-boundary tensors; holds the bases of ``basis`` schemes (ours, and senders')
    boundary: BoundaryCodec = field(default_factory=BoundaryCodec)
    #: something a user sees changed (stage, version, peers): emit a status event
    on_status: Callable[[], None] = lambda: None

    def send_to_each(self, peers: list[str], header: PeerMessage, payload: bytes, *, what: str, name: str) -> None:
        """Send ``header`` to each of ``peers`` in a task of its own (named ``name``-peer): one whose
        link stopped draining holds its own send (to the link's deadline, then a warning), never
        the caller, who goes on to wait for the others' answers to its own deadline."""
        async def one(peer: str) -> None:
            try:
                await self.peers.send(peer, header, payload)
            except Exception as exc:  # noqa: BLE001 - NetError, LinkClosed, TimeoutError: the peer's loss
                log.warning("could not send our %s to %s: %s", what, peer, exc)
        for peer in peers:
            self.tasks.spawn(one(peer), f"{name}-{peer[:8]}")

    def stage_members(self) -> list[str]:
        """Every member (trainer or inference replica) of the stage we hold."""
        spec = self.stage.spec
        return [] if spec is None else self.membership.of_stage(spec.stage_index)
