"""Job and micro-batch tickets: the coordinator's signed word that a route carries a job.

Routes used to be whatever a peer header said, so any member could send ``grad`` for an
honest micro-batch, or append to or drop another job's KV cache, by naming itself the
neighbour. Now the coordinator signs a :class:`~engine.swarm.messages.Ticket` (job id or
micro-batch key, the route, an expiry) with its Ed25519 identity for every ``gen``,
``train_in`` and ``train_out`` it sends (:class:`TicketIssuer`); nodes copy it into every
``act``, ``grad`` and ``drop`` of that job; and a node that holds the coordinator's key (from
its signed welcome) acts on those only when :class:`TicketChecker` verifies the ticket, for that
job and exactly that route (``engine.swarm.pipeline_hops.check_hop`` then checks the sender is the
route's neighbour). Verified signatures are cached (bounded), so a generation job costs one
verification per node, not one per token.

What it does not know: what a job computes, links, the coordinator's scheduling.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from msgspec.structs import replace

from engine.net.errors import AuthenticationError, ProtocolViolation
from engine.net.identity import Identity, verify_signature
from engine.swarm.messages import Gen, Ticket, TrainIn, TrainOut

TICKET_DOMAIN = b"polis-ticket-v1\x00"
#: how long a ticket is good for (a job or micro-batch is re-dispatched long before)
TICKET_TTL_S = 900
#: how far a node's clock may be behind the coordinator's before a fresh ticket reads as expired
CLOCK_SKEW_S = 300
#: verified tickets a node remembers
MAX_VERIFIED = 4096


def ticket_bytes(job: str, route: Sequence[str], expires_s: int) -> bytes:
    """What the coordinator signs (canonical JSON behind a domain tag)."""
    return TICKET_DOMAIN + json.dumps([job, list(route), int(expires_s)], separators=(",", ":")).encode()


def ticket_job(message: Gen | TrainIn | TrainOut) -> str:
    """The job a coordinator message's ticket names (the training key nodes use for micro-batches)."""
    if isinstance(message, Gen):
        return message.job
    return f"{'p' if message.prox else ''}{message.step}:{message.mb}"


class TicketIssuer:
    """The coordinator side: signs tickets with its identity."""

    def __init__(self, identity: Identity, ttl_s: int = TICKET_TTL_S, clock: Callable[[], float] = time.time) -> None:
        self.identity, self.ttl_s, self.clock = identity, ttl_s, clock

    def issue(self, job: str, route: Sequence[str]) -> Ticket:
        expires = int(self.clock()) + self.ttl_s
        signature = self.identity.sign(ticket_bytes(job, route, expires))
        return Ticket(job=job, route=list(route), expires_s=expires, signature=base64.b64encode(signature).decode())

    def stamp(self, message):
        """``message`` with a fresh ticket if it is a ``gen`` / ``train_in`` / ``train_out`` without one."""
        if isinstance(message, (Gen, TrainIn, TrainOut)) and message.ticket is None:
            return replace(message, ticket=self.issue(ticket_job(message), message.route))
        return message


class TicketChecker:
    """The node side: verifies tickets against the coordinator's public key."""

    def __init__(self, public_key: bytes, clock: Callable[[], float] = time.time) -> None:
        self.public_key, self.clock = public_key, clock
        self._verified: OrderedDict[str, None] = OrderedDict()
        self.refused = 0

    def check(self, kind: str, ticket: Ticket | None, job: str, route: Sequence[str]) -> None:
        """Raise ``ProtocolViolation`` unless ``ticket`` is the coordinator's, for ``job`` on ``route``."""
        try:
            if ticket is None:
                raise ProtocolViolation(f"'{kind}' for {job} without a ticket")
            if ticket.job != job or list(ticket.route) != list(route):
                raise ProtocolViolation(f"'{kind}' for {job} carries a ticket for another job or route")
            if ticket.expires_s + CLOCK_SKEW_S < self.clock():
                raise ProtocolViolation(f"'{kind}' for {job} carries an expired ticket")
            signed = ticket_bytes(ticket.job, ticket.route, ticket.expires_s)
            seen = ticket.signature + signed.hex()  # the whole ticket: a cached signature extends nothing
            if seen in self._verified:
                self._verified.move_to_end(seen)
                return
            try:
                verify_signature(self.public_key, signed, base64.b64decode(ticket.signature, validate=True))
            except (binascii.Error, ValueError, AuthenticationError) as exc:
                raise ProtocolViolation(f"'{kind}' for {job} carries a ticket the coordinator did not sign") from exc
        except ProtocolViolation:
            self.refused += 1
            raise
        self._verified[seen] = None
        if len(self._verified) > MAX_VERIFIED:
            self._verified.popitem(last=False)
