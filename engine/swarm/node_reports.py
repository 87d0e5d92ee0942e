"""What the coordinator does with each message a node sends after its hello.

:class:`NodeReports` dispatches a decoded node message (a typed struct of
``engine.swarm.messages``) by its struct type through one table to the
part that owns it — generation results to the generation scheduler, micro-batch and step
reports to the step runner, weight-stream reports to the stream book, a node's ``report`` to the
ledger's self-reported half (never to its credit: ``engine.swarm.ledger``), to the pacer and its
measured uplink to the bandwidth placement —
after checking that the sender's role may send it (only trainers step and stream, only
inference replicas report ``served``). A message a node may not send raises
``ProtocolViolation``; the coordinator counts it as a strike against the node.

What it does not know: websockets, authentication, scheduling decisions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from engine.net.errors import ProtocolViolation
from engine.swarm import messages
from engine.swarm.ledger import SELF_REPORTED
from engine.swarm.membership import Membership, NodeSession
from engine.swarm.scheduler import GenerationScheduler
from engine.swarm.step_runner import StepRunner
from engine.swarm.store import Store
from engine.swarm.stream_book import StreamBook

log = logging.getLogger(__name__)

#: most times a trainer that said ready behind its stage is sent to catch up before it is taken in as it is
MAX_CATCH_UPS = 3


class NodeReports:
    """The handlers of node -> coordinator messages (``messages.NodeToCoordinator``)."""

    def __init__(self, members: Membership, generation: GenerationScheduler, steps: StepRunner,
                 streams: StreamBook, store: Store, *, on_ready: Callable[[], None],
                 on_uplink: Callable[[str, float, float], None] = lambda peer, mbps, floor_mbps: None) -> None:
        self.members, self.generation, self.steps = members, generation, steps
        self.streams, self.store, self.on_ready = streams, store, on_ready
        #: a node's measured uplink (Mbit/s) and its lower bound, for the bandwidth placement
        self.on_uplink = on_uplink
        self._handlers: dict[type, Callable[[NodeSession, Any], None]] = {
            messages.Hello: self._second_hello, messages.Ready: self._ready, messages.GenDone: self._gen_done,
            messages.JobFailed: self._job_failed, messages.MbLoss: self._mb_loss, messages.MbDone: self._mb_done,
            messages.ProxDone: self._prox_done, messages.MbFailed: self._mb_failed, messages.Stepped: self._stepped,
            messages.Streamed: self._streamed, messages.Served: self._served, messages.Report: self._report,
            messages.WeightsRefused: self._weights_refused,
        }

    def handle(self, session: NodeSession, message: messages.NodeToCoordinator) -> None:
        """Act on one decoded message from ``session``'s node."""
        handler = self._handlers.get(type(message))
        if handler is None:
            raise ProtocolViolation(f"a node may not send {type(message).__name__} to the coordinator")
        handler(session, message)

    def _second_hello(self, session: NodeSession, message: messages.Hello) -> None:
        raise ProtocolViolation("hello twice")

    def _ready(self, session: NodeSession, message: messages.Ready) -> None:
        finished_one = session.catching_up  # it took a replica's weights since it was told to
        session.version, session.catching_up, session.holds_steps_since = message.version, False, None
        if message.stage == session.stage and self._catch_up(session, hold=finished_one):
            return
        session.ready = message.stage == session.stage
        self.on_ready()

    def _catch_up(self, session: NodeSession, hold: bool) -> bool:
        """Whether a trainer that says ready is behind the stage's other trainers (they stepped while it
        loaded) and was told to take a current replica's weights first (``sync`` with ``catch_up``; it says
        ready again after). Stepping on stale weights would hand its siblings a gradient of old weights and
        cost a resync at the next weight vote. With ``hold`` (it finished a catch-up and the stage outran it
        again) the step runner holds the next ``apply`` a bounded while (``NodeLinks.catching_up``), so it
        comes back at the stage's version; a first catch-up holds nothing, so a node that goes dark while
        loading costs no step. At most ``MAX_CATCH_UPS`` times in a session (a node cannot stall the run by
        saying ready again and again); after that it is taken in as it is and the weight vote resyncs it."""
        if session.role != "trainer" or session.stage is None or session.catch_ups >= MAX_CATCH_UPS:
            return False
        others = [s for s in self.members.sessions.values() if s is not session and s.ready
                  and s.role == "trainer" and s.stage == session.stage]
        newest = max(others, key=lambda s: s.version, default=None)
        if newest is None:
            return False
        # a step in flight from the newest version: its siblings are about to be one version further,
        # and a trainer taken in now would join the next step one version behind
        applying = self.steps.book.applying
        stage_version = applying if applying == newest.version + 1 else newest.version
        if session.version >= stage_version:
            return False
        source = self.members.leader(session.stage) or newest.peer_id
        session.catch_ups += 1
        session.catching_up, session.holds_steps_since = True, time.monotonic() if hold else None
        log.info("trainer %s is ready at version %d, stage %d at %d: it catches up from %s first",
                 session.peer_id, session.version, session.stage, stage_version, source)
        asyncio.get_running_loop().create_task(
            self.members.send(session.peer_id, messages.Sync(source_peer=source, catch_up=True)),
            name=f"polis-coord-catch-up-{session.peer_id[:8]}")
        return True

    def _gen_done(self, session: NodeSession, message: messages.GenDone) -> None:
        self.generation.on_gen_done(session.peer_id, message)

    def _job_failed(self, session: NodeSession, message: messages.JobFailed) -> None:
        self.generation.on_job_failed(session.peer_id, message.job, message.reason)

    def _mb_loss(self, session: NodeSession, message: messages.MbLoss) -> None:
        self.steps.on_mb_loss(session.peer_id, message)

    def _mb_done(self, session: NodeSession, message: messages.MbDone) -> None:
        self.steps.microbatches.on_mb_done(session.peer_id, message)

    def _prox_done(self, session: NodeSession, message: messages.ProxDone) -> None:
        self.steps.microbatches.on_prox_done(session.peer_id, message)

    def _mb_failed(self, session: NodeSession, message: messages.MbFailed) -> None:
        self.steps.microbatches.on_mb_failed(session.peer_id, message)

    def _stepped(self, session: NodeSession, message: messages.Stepped) -> None:
        if session.role != "trainer":
            raise ProtocolViolation("'stepped' from an inference replica")
        session.version = message.version
        self.steps.on_stepped(session.peer_id, message)

    def _weights_refused(self, session: NodeSession, message: messages.WeightsRefused) -> None:
        if session.role != "trainer":
            raise ProtocolViolation("'weights_refused' from an inference replica (it is never sent a sync)")
        asyncio.get_running_loop().create_task(
            self.members.weights_refused(session.peer_id, message.source, message.version),
            name=f"polis-coord-refused-{session.peer_id[:8]}")

    def _streamed(self, session: NodeSession, message: messages.Streamed) -> None:
        """A leader's stream report: every replica it names must be an inference replica of its stage."""
        if session.role != "trainer":
            raise ProtocolViolation("'streamed' from an inference replica")
        for entry in message.streams:
            target = self.members.sessions.get(entry.peer)
            if target is None or target.role != "inference" or target.stage != session.stage:
                raise ProtocolViolation(f"'streamed' names {entry.peer}, not an inference replica of "
                                        f"stage {session.stage}")
        self.streams.on_streamed(session.peer_id, session.stage, message.version, message.streams)

    def _served(self, session: NodeSession, message: messages.Served) -> None:
        if session.role != "inference":
            raise ProtocolViolation("'served' from a trainer")
        session.version = message.version
        self.streams.on_served(session.peer_id, session.stage, message)
        if message.full and message.weights_hash is not None and session.stage is not None:
            asyncio.get_running_loop().create_task(
                self.members.served(session.peer_id, session.stage, message, message.version),
                name=f"polis-coord-served-{session.peer_id[:8]}")

    def _report(self, session: NodeSession, message: messages.Report) -> None:
        """What a node says of itself: kept as self-reported figures and used for pacing and placement. Its
        own token and micro-batch counts are claims the coordinator does not credit (it counts what it observed)."""
        self.generation.pacer.observe(session.peer_id, message.gen_compute_s, message.gen_steps, message.link_rtt_ms)
        self.store.add_self_reported(session.peer_id, **{name: getattr(message, name) for name in SELF_REPORTED})
        self.on_uplink(session.peer_id, message.uplink_mbps, message.uplink_floor_mbps)
