"""The coordinator's admitted nodes: their sessions, who is ready on which stage in which role,
the pipeline routes over them, and sending to them (this is the ``NodeLinks`` the scheduling
parts use, see ``engine.swarm.run_book``).

A route takes one ready node per stage, stage 0 first. Training routes use trainers only;
generation routes any ready replica (trainers first, then inference replicas). Route r takes
replica r (mod count) of every stage, so every replica serves; with a ``route_key`` (the
coordinator's bandwidth placement, when replicas sync every step) nodes whose uplinks bind pair
with each other rather than slowing every route. Sending never waits on a stuck
socket for longer than ``SEND_TIMEOUT_S``, and a node whose socket is stuck that long is evicted
(out of every route at once, socket closed); so is one the step runner finds silent
(``evict``). An evicted peer id is refused for ``EVICTION_BAN_S`` (``banned_for``), so a node
that keeps failing the same way costs the run one eviction per ban, not one per reconnect.

Weight authority: each stage's leader is the one :class:`~engine.swarm.weight_votes.WeightAuthority`
names (the replicas' full-weight votes; then fewest identities at its address, earliest admitted;
never by peer id); it is announced in
``apply`` and ``members``. :meth:`Membership.check_weights` tallies a step's digests and carries out
the verdict: ``sync`` (source, version, majority digest) to each outvoted replica, eviction of one that
stays outvoted or that two followers refused, and a new ``members`` when a stage's leader changed.

Every ``gen``, ``train_in`` and ``train_out`` leaves with a ticket the coordinator signs
(``engine.swarm.tickets``), so peers act only on routes the coordinator chose.

What it does not know: authentication, stage assignment, scheduling.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.swarm import messages
from engine.swarm.run_book import SEND_TIMEOUT_S
from engine.swarm.tickets import TicketIssuer
from engine.swarm.weight_votes import WeightAuthority

#: how long the steps wait, at most, for a trainer told to catch up (from when it was told): it loads a
#: replica's weights and moments over the data channel (seconds for a stage of SmolLM2-135M on a LAN)
CATCH_UP_HOLD_S = 10.0

log = logging.getLogger(__name__)

#: how long an evicted peer id is refused admission (seconds)
EVICTION_BAN_S = 300.0
#: most banned peer ids remembered (the oldest ban is forgotten first)
MAX_BANS = 4096


def _route_key(key: Callable[[str, int, int], Any], stage: int, replicas: int, peer: str) -> Any:
    return key(peer, stage, replicas)


@dataclass
class NodeSession:
    peer_id: str
    ws: Any  #: the node's control websocket (``aiohttp.web.WebSocketResponse``: ``send_str``, ``closed``)
    backend: str
    device: str
    stage: int | None = None
    ready: bool = False
    version: int = 0
    joined: float = field(default_factory=time.time)
    role: str = "trainer"  #: "trainer" or "inference" (generation only)
    #: the role its hello offered (a trainer may serve as inference while its links are too slow to train)
    offered_role: str = "trainer"
    address: str = ""  #: the network address it connected from (identities per address are capped)
    catch_ups: int = 0  #: times it said ready behind its stage's version and was told to catch up first
    catching_up: bool = False  #: told to catch up and has not said ready since
    #: when (``time.monotonic()``) the steps began to wait for its catch-up (None: they do not; cleared
    #: with ``catching_up`` when it says ready): only for a catch-up after one it finished (it loads,
    #: but its stage outran it), and at most ``CATCH_UP_HOLD_S`` from then however many steps come,
    #: so one that goes dark mid-load holds none
    holds_steps_since: float | None = None


class Membership:
    """Sessions of the nodes admitted to a run of ``num_stages`` stages."""

    def __init__(self, num_stages: int, issuer: TicketIssuer | None = None) -> None:
        self.num_stages = num_stages
        self.sessions: dict[str, NodeSession] = {}
        self._banned_until: dict[str, float] = {}  #: peer id -> monotonic time its ban ends
        self.authority = WeightAuthority()
        #: signs a ticket into every ``gen`` / ``train_in`` / ``train_out`` sent (None: no tickets)
        self.issuer = issuer
        #: sort key of a stage's replicas when routes pair them: (peer, stage, replicas) -> key (None: by id)
        self.route_key: Callable[[str, int, int], Any] | None = None

    def at_address(self, address: str) -> int:
        """Admitted nodes that connected from ``address``."""
        return sum(1 for s in self.sessions.values() if s.address == address)

    def stage_replicas(self, role: str | None = "trainer") -> list[list[str]]:
        """Ready peers of each stage with ``role`` (None: any), sorted by peer id (``leader`` names the leader)."""
        out: list[list[str]] = [[] for _ in range(self.num_stages)]
        for s in self.sessions.values():
            if s.ready and s.stage is not None and (role is None or s.role == role):
                out[s.stage].append(s.peer_id)
        return [sorted(ids) for ids in out]

    def inference_replicas(self) -> list[list[str]]:
        return self.stage_replicas("inference")

    def _pipelines(self, replicas: list[list[str]]) -> list[list[str]]:
        """Complete pipelines: route r takes replica r (mod count) of every stage, each stage's replicas
        in ``route_key`` order when one is set (nodes on slow uplinks pair with each other)."""
        if not all(replicas):
            return []
        key = self.route_key
        if key is not None:
            replicas = [sorted(ids, key=functools.partial(_route_key, key, s, len(ids)))
                        for s, ids in enumerate(replicas)]
        width = max(len(ids) for ids in replicas)
        return [[ids[r % len(ids)] for ids in replicas] for r in range(width)]

    def routes(self) -> list[list[str]]:
        """Training routes: trainers only."""
        return self._pipelines(self.stage_replicas())

    def gen_routes(self) -> list[list[str]]:
        """Generation routes: any ready replica of each stage (trainers, then inference replicas)."""
        trainers, inference = self.stage_replicas(), self.inference_replicas()
        return self._pipelines([t + i for t, i in zip(trainers, inference)])

    def catching_up(self) -> bool:
        """Whether the steps wait for a trainer's catch-up (``NodeSession.holds_steps_since``): one that
        finished a catch-up and was outrun again, told less than ``CATCH_UP_HOLD_S`` ago, not ready since."""
        now = time.monotonic()
        return any(s.holds_steps_since is not None and now - s.holds_steps_since < CATCH_UP_HOLD_S
                   for s in self.sessions.values())

    def leader(self, stage: int) -> str | None:
        """The trainer that leads ``stage`` (checkpoints it, streams to its inference replicas)."""
        # ranked by how many identities share its address (a machine running twenty identities
        # leads after one running one), then by admission
        trainers = [((self.at_address(s.address), s.joined), s.peer_id) for s in self.sessions.values()
                    if s.ready and s.stage == stage and s.role == "trainer"]
        return self.authority.leader(stage, trainers)

    async def check_weights(self, stage: int, digests: dict[str, str | None], version: int) -> str | None:
        """One step's full-weight digests of ``stage``'s trainers: the majority decides (see the module);
        returns the digest it decided (None: no majority)."""
        before = self.authority.leaders().get(stage)
        vote = self.authority.vote(stage, digests, version)
        for peer, source in vote.resync:
            log.info("replica %s of stage %d is outside the weight majority; resynchronising from %s",
                     peer, stage, source)
            await self.send(peer, messages.Sync(source_peer=source, weights_hash=vote.majority, version=version))
        for peer in vote.evict:
            session = self.sessions.get(peer)
            if session is not None:
                self._evict(session, f"held weights outside stage {stage}'s majority for "
                                     f"{self.authority.evict_after} votes in a row")
        if self.leader(stage) != before:
            await self.broadcast(version)
        return vote.majority

    async def weights_refused(self, follower: str, source: str, version: int) -> None:
        """``follower`` refused the weights ``source`` sent for its sync (they missed the majority digest)."""
        before = self.authority.leaders()
        evict = self.authority.refused(source, follower)
        session = self.sessions.get(source)
        if evict and session is not None:
            self._evict(session, "sent weights that two followers found did not match the majority's digest")
        if [self.leader(stage) for stage in range(self.num_stages)] != [before.get(s) for s in range(self.num_stages)]:
            await self.broadcast(version)

    async def served(self, replica: str, stage: int, message: messages.Served, version: int) -> None:
        """An inference replica's full load: weights from a leader that miss the majority's digest
        cost the leader the lead (the new leader then streams the replica afresh)."""
        if message.weights_hash is None or self.authority.served(stage, message.version, message.weights_hash,
                                                                 message.source):
            return
        log.warning("inference replica %s got weights of version %d from %s that miss the majority's digest; "
                    "%s leads stage %d no more", replica, message.version, message.source, message.source, stage)
        self.leader(stage)
        await self.broadcast(version)

    async def broadcast(self, version: int) -> None:
        """The ``members`` message to every admitted node."""
        message = self.members_message(version)
        for peer in list(self.sessions):
            await self.send(peer, message)

    def members_message(self, version: int) -> messages.Members:
        """The ``members`` message: every admitted node by stage (ready or not) and the inference replicas."""
        members: list[list[str]] = [[] for _ in range(self.num_stages)]
        for s in self.sessions.values():
            if s.stage is not None:
                members[s.stage].append(s.peer_id)
        inference = sorted(s.peer_id for s in self.sessions.values() if s.role == "inference")
        return messages.Members(stages=[sorted(m) for m in members], version=version, inference=inference,
                                leaders=[self.leader(stage) for stage in range(self.num_stages)])

    async def send(self, peer_id: str, message: messages.CoordinatorToNode) -> bool:
        """Send a typed message; False if the peer is gone or it did not leave within ``SEND_TIMEOUT_S``."""
        session = self.sessions.get(peer_id)
        if session is None or session.ws.closed:
            return False
        if self.issuer is not None:
            message = self.issuer.stamp(message)
        try:
            await asyncio.wait_for(session.ws.send_str(messages.encode(message)), SEND_TIMEOUT_S)
            return True
        except asyncio.TimeoutError:
            self._evict(session, f"did not read a {type(message).__name__} within {SEND_TIMEOUT_S} s")
            return False
        except (ConnectionError, RuntimeError) as exc:
            log.info("could not send %s to %s: %s", type(message).__name__, peer_id, exc)
            return False

    def evict(self, peer_id: str, why: str) -> None:
        """``NodeLinks.evict``: out of every route now, socket closed, refused for ``EVICTION_BAN_S``."""
        session = self.sessions.get(peer_id)
        if session is not None:
            self._evict(session, why)

    def banned_for(self, peer_id: str) -> float:
        """Seconds until ``peer_id`` may join again (0: it may)."""
        left = self._banned_until.get(peer_id, 0.0) - time.monotonic()
        if left <= 0:
            self._banned_until.pop(peer_id, None)
        return max(0.0, left)

    def _evict(self, session: NodeSession, why: str) -> None:
        """A node that stops reading leaves every route now and its socket is closed: one stuck
        peer must cost the run one send deadline, not one per message."""
        log.warning("evicting %s: it %s", session.peer_id, why)
        session.ready = False
        self._banned_until.pop(session.peer_id, None)
        self._banned_until[session.peer_id] = time.monotonic() + EVICTION_BAN_S
        while len(self._banned_until) > MAX_BANS:
            del self._banned_until[next(iter(self._banned_until))]
        self.authority.forget(session.peer_id)
        asyncio.get_running_loop().create_task(self._close(session), name=f"polis-coord-evict-{session.peer_id[:8]}")

    @staticmethod
    async def _close(session: NodeSession) -> None:
        try:
            await asyncio.wait_for(session.ws.close(), SEND_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, RuntimeError) as exc:
            log.info("closing %s's socket failed (%s); its heartbeat ends it", session.peer_id, exc)
