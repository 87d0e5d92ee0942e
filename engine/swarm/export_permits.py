"""Which exporters, outside the swarm, this node lets fetch its stage's full weights, and until when.

``polis export --coordinator URL`` runs a peer that is no member of the swarm: it asks the
coordinator's admin API for an export plan (``engine.swarm.export_api``), and the coordinator
sends each stage leader an ``export_permit`` naming the exporter's peer id, the stage and an
expiry. A node then accepts a WebRTC link from that peer (``PeerLinks.accept_peer``) and answers
its ``weights_req`` for exactly that stage (``Node._on_weights_req``) until the permit expires.
The permit travels over the node's authenticated control websocket, so only the coordinator can
grant one; permits are few and bounded (the oldest goes first).

What it does not know: weights, links, the admin token.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from engine.swarm.messages import ExportPermit
from engine.swarm.tickets import CLOCK_SKEW_S

#: most exporters remembered at once
MAX_PERMITS = 16


class ExportPermits:
    """The coordinator's export permits this node holds (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._permits: OrderedDict[str, ExportPermit] = OrderedDict()

    def grant(self, permit: ExportPermit) -> None:
        self._permits.pop(permit.peer, None)
        self._permits[permit.peer] = permit
        while len(self._permits) > MAX_PERMITS:
            self._permits.popitem(last=False)

    def allows(self, peer: str, stage: int | None = None) -> bool:
        """``peer`` holds an unexpired permit (for ``stage``, when given)."""
        permit = self._permits.get(peer)
        if permit is None:
            return False
        if permit.expires_s + CLOCK_SKEW_S < self.clock():
            del self._permits[peer]
            return False
        return stage is None or permit.stage == stage
