"""The coordinator's record of the weight streams to inference replicas.

Stage leaders report each round they send (``streamed``: per replica, the
checksum of that replica's shadow, delta and dense bytes, the largest
``|trainer weights - shadow|``); inference replicas report what they now serve
(``served``: version, checksum of the weights they generate with). The book
pairs the two, so ``/api/stats`` shows per replica whether it holds exactly
what its leader thinks it holds, and the stream's compression and residual.

Pure bookkeeping on the coordinator's loop: it knows nothing about tensors,
links or scheduling, and trusts only that messages passed their schemas.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from engine.swarm import messages


@dataclass
class _Replica:
    stage: int | None = None
    source: str | None = None
    served_version: int | None = None
    served_checksum: float | None = None
    served_full: bool = False
    full_loads: int = 0
    deltas_applied: int = 0
    residual_max_abs: float | None = None  #: after the leader's latest round
    #: version -> (leader, shadow checksum) of the latest rounds
    shadows: OrderedDict = field(default_factory=OrderedDict)


class StreamBook:
    """Weight-stream figures per inference replica, and totals.

    keep_rounds: shadow checksums remembered per replica (to pair with a later ``served``).
    """

    def __init__(self, keep_rounds: int = 16) -> None:
        self.keep_rounds = keep_rounds
        self._replicas: dict[str, _Replica] = {}
        self.deltas = 0
        self.delta_bytes = 0
        self.dense_bytes = 0
        self.residual_max_abs = 0.0  #: largest over every round so far

    def _replica(self, peer: str) -> _Replica:
        return self._replicas.setdefault(peer, _Replica())

    def on_streamed(self, leader: str, stage: int | None, version: int,
                    streams: Sequence[messages.StreamReport]) -> None:
        for entry in streams:
            r = self._replica(entry.peer)
            r.stage = stage
            r.shadows[version] = (leader, float(entry.checksum))
            r.shadows.move_to_end(version)
            while len(r.shadows) > self.keep_rounds:
                r.shadows.popitem(last=False)
            r.residual_max_abs = float(entry.residual_max_abs)
            self.deltas += 1
            self.delta_bytes += int(entry.delta_bytes)
            self.dense_bytes += int(entry.dense_bytes)
            self.residual_max_abs = max(self.residual_max_abs, r.residual_max_abs)

    def on_served(self, peer: str, stage: int | None, m: messages.Served) -> None:
        r = self._replica(peer)
        r.stage, r.source = stage, m.source
        r.served_version, r.served_checksum, r.served_full = m.version, float(m.checksum), m.full
        if m.full:
            r.full_loads += 1
        else:
            r.deltas_applied += 1

    def forget(self, peer: str) -> None:
        self._replicas.pop(peer, None)

    def stats(self) -> dict[str, Any]:
        replicas = {}
        for peer, r in sorted(self._replicas.items()):
            shadow = r.shadows.get(r.served_version) if r.served_version is not None else None
            shadow_checksum = shadow[1] if shadow is not None and shadow[0] == r.source else None
            replicas[peer] = {
                "stage": r.stage, "source": r.source, "served_version": r.served_version,
                "served_checksum": r.served_checksum, "served_full": r.served_full,
                "shadow_checksum": shadow_checksum,
                "in_sync": None if shadow_checksum is None or r.served_full else shadow_checksum == r.served_checksum,
                "full_loads": r.full_loads, "deltas_applied": r.deltas_applied,
                "residual_max_abs": r.residual_max_abs}
        return {"deltas": self.deltas, "delta_bytes": self.delta_bytes, "dense_bytes": self.dense_bytes,
                "bytes_per_delta": self.delta_bytes / self.deltas if self.deltas else None,
                "ratio_vs_dense_fp32": self.delta_bytes / self.dense_bytes if self.dense_bytes else None,
                "residual_max_abs": self.residual_max_abs, "replicas": replicas}
