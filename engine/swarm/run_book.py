"""The coordinator's shared view of one run: the policy version, whether training is over, the
counters, the verified credit each part observes (``engine.swarm.credit``), and the small
interface through which the coordinator's parts reach the nodes.

The coordinator's scheduling is three collaborating objects — generation
(``engine.swarm.scheduler``), optimiser steps (``engine.swarm.step_runner``) and held-out evals
(``engine.swarm.eval_scheduler``). None of them knows the others' attributes: they share a
:class:`RunBook` (what every part reads and the step runner advances) and reach nodes only
through :class:`NodeLinks` (the coordinator implements it). The version and ``finished`` are
durable: every change is written to the store at once, and the version never goes down.

What it does not know: websockets, messages' contents, rewards, tensors.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

from engine.swarm.credit import Credit
from engine.swarm.messages import CoordinatorToNode
from engine.swarm.store import Store

#: the longest one message to one node may take to leave (a stuck socket must not stall a step)
SEND_TIMEOUT_S = 10.0


class NodeLinks(Protocol):
    """How the scheduling parts reach the swarm (``engine.swarm.coordinator.Coordinator``)."""

    async def send(self, peer_id: str, message: CoordinatorToNode) -> bool:
        """Queue a typed ``message`` to ``peer_id`` within ``SEND_TIMEOUT_S``; False if it could not go."""

    def routes(self) -> list[list[str]]:
        """Training routes: one trainer per stage, stage 0 first."""

    def gen_routes(self) -> list[list[str]]:
        """Generation routes: any ready replica per stage (trainers and inference replicas)."""

    def stage_replicas(self) -> list[list[str]]:
        """The ready trainers of each stage, sorted by peer id."""

    def leader(self, stage: int) -> str | None:
        """The trainer the coordinator names to lead ``stage`` (checkpoints, weight stream)."""

    async def check_weights(self, stage: int, digests: dict[str, str | None], version: int) -> str | None:
        """Put ``stage``'s full-weight digests at ``version`` to the majority vote and act on it; the
        digest it decided (None: none)."""

    def inference_replicas(self) -> list[list[str]]:
        """The ready inference replicas of each stage (they follow the leader's weight stream)."""

    def catching_up(self) -> bool:
        """Whether a trainer that said ready behind its stage is still taking a replica's weights (the
        next ``apply`` waits for it, a bounded while, so it joins at the stage's version)."""

    def evict(self, peer_id: str, why: str) -> None:
        """Take ``peer_id`` out of every route now, close its session and refuse it for a while
        (``why``: what it failed to do, for the log and the node)."""


class RunBook:
    """Version, end of training and counters of one run, shared by the coordinator's parts."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.version = int(store.get_meta("version", 0))
        self._finished = bool(store.get_meta("finished", False))
        applying = int(store.get_meta("applying", 0))
        #: the version trainers were told to step to when this coordinator last stopped without
        #: learning that they did (None: no step was in doubt); see :meth:`roll_forward`
        self.unconfirmed: int | None = applying if applying == self.version + 1 else None
        #: the highest version trainers were told to step to by this coordinator (results of it are
        #: honest while 'stepped' is on its way: nodes step before the coordinator records the version)
        self.applying: int = self.version
        #: event counts shown in the stats API (failed_jobs, dropped_stale, resyncs, ...)
        self.counters: Counter[str] = Counter()
        #: work the coordinator observed or verified, per peer, until the coordinator writes it
        self.credit = Credit()

    @property
    def finished(self) -> bool:
        """Training must stop (max_versions reached or an operator's 'finish'); durable."""
        return self._finished

    @finished.setter
    def finished(self, value: bool) -> None:
        if bool(value) != self._finished:
            self._finished = bool(value)
            self.store.set_meta("finished", self._finished)

    def advance(self, version: int) -> None:
        """Record that the swarm's policy is now ``version`` (ignored unless it goes up)."""
        if version > self.version:
            self.version = int(version)
            self.store.set_meta("version", self.version)
        self.unconfirmed = None

    def begin_apply(self, version: int) -> None:
        """Write ahead that trainers are about to be told to step to ``version``.

        Nodes step before the coordinator hears 'stepped' and records the version; a coordinator
        killed in between would otherwise restart one version behind every trainer, take their
        weights for lost and pause the run for good (durable like the version itself).
        """
        self.store.set_meta("applying", int(version))
        self.applying = max(self.applying, int(version))

    def roll_forward(self) -> int:
        """Adopt the version that was in doubt at restart (a rejoining trainer holds it); the new version.

        Bounded to the one step this coordinator itself had begun, so no hello can move the run
        further; its rollouts were never marked consumed and are trained again.
        """
        if self.unconfirmed is not None:
            self.advance(self.unconfirmed)
        return self.version

    def settle(self) -> None:
        """A trainer rejoined at the recorded version: the step in doubt did not happen."""
        self.unconfirmed = None

    def stats(self) -> dict[str, Any]:
        return {"version": self.version, "finished": self.finished, "counters": dict(self.counters)}
