"""The weight stream from a stage's leader trainer to its inference replicas, as pure state.

An inference replica holds one stage without optimiser state and only generates.
It follows the stage leader's weights through a stream of quantised deltas
(``engine.net.shadow_delta``): the leader keeps, per replica, a *shadow* of what
that replica holds, and after every applied step sends ``weights - shadow``,
advancing the shadow by exactly what the replica will add. The two shadows stay
bit-identical, so the replica never drifts: it differs from the leader only by
the last round's quantisation residual, which the next delta carries.

A stream starts from full weights (the fetch-from-a-replica path): the leader
reads its weights and version together, starts a stream with a fresh id on
exactly those weights, and the replica resets its receiver to the very same
weights (they travel as lossless fp32) when they arrive.

* :class:`StreamLeader` (leader side): one stream per inference replica.
* :class:`StreamFollower` (replica side): decides, for each inbound ``wdelta`` /
  ``wlead``, whether to apply it, ignore it (a leftover of an older stream) or
  fetch full weights again, and applies deltas to its shadow.

Codec: ``int8_rowwise`` (``engine.net.codec_int8``) by default, or ``sparse_exact``
(``engine.net.codec_sparse_exact``: only the entries whose fp32 or bf16 bits changed, at
their exact values, so the replica equals the leader's weights, or their bf16 rounding,
with no residual at all). AdamW moves *every* weight
a little each step, so a step's delta is dense: top-k would leave most of it in
the shadow residual and the replica would lag several versions behind; int8
with one scale per row costs 1/4 of fp32 (plus about a byte per row), its error
is at most half a step of 1/127 of each row's largest change, and its decode is
bit-exact on every machine (ldexp and float32 multiplies), which the shadow
scheme needs. fp16/bf16 would cost twice as much for no benefit here.

Threads: methods that touch tensors (``start``, ``encode``, ``reset``,
``apply``, ``forget``) run on the node's compute thread; ``decide`` runs on the
loop; the node serialises the two. It knows nothing about links, message
transport, backends or the coordinator.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from engine.net.codec_sparse_exact import ENCODING as SPARSE_EXACT
from engine.net.errors import WireFormatError
from engine.net.shadow_delta import DeltaReceiver, DeltaSender, WeightDelta
from engine.swarm.tensor_bundle import checksum

log = logging.getLogger(__name__)

#: stream ids are drawn below this (they travel as a 31-bit int)
STREAM_ID_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class WeightStreamConfig:
    """How a stage leader streams weights to its inference replicas.

    encoding: ``engine.net.tensor_codec`` encoding of the deltas; its decode must be
      bit-exact on every machine (``int8_rowwise``: see the module docstring).
    max_streams: most inference replicas one leader streams to at once; each stream
      holds one fp32 copy of the stage (its shadow). Over the cap the stream used
      least recently is dropped (that replica fetches full weights when it next
      hears from the leader).
    payload_slack_bytes: a delta's payload may exceed the largest encoding of the stage
      (int8: a byte per weight, per row and per column, plus two scale references per
      tensor; sparse_exact: every entry, a 5-byte index and its value) by this much;
      anything larger is refused before decoding.
    value_dtype: with ``sparse_exact``, "float32" (exact weights) or "bfloat16" (exact bf16
      rounding of the weights, what a bf16 generation copy holds).
    """

    encoding: str = "int8_rowwise"
    max_streams: int = 16
    payload_slack_bytes: int = 1 << 16
    value_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.encoding not in ("int8_rowwise", SPARSE_EXACT):
            raise ValueError(f"weight stream encoding must be int8_rowwise or {SPARSE_EXACT}")
        if self.value_dtype not in ("float32", "bfloat16"):
            raise ValueError("value_dtype must be float32 or bfloat16")
        if self.max_streams < 1:
            raise ValueError("max_streams must be >= 1")
        if self.payload_slack_bytes < 0:
            raise ValueError("payload_slack_bytes must be >= 0")


@dataclass(frozen=True)
class DeltaFrame:
    """One round of one stream, ready for the wire.

    header: the ``wdelta`` fields but ``type`` and ``stage`` (``version``, ``stream``, ``delta``).
    payload: the encoded tensors, concatenated.
    report: what the leader tells the coordinator about this round (``streamed`` entry).
    """

    header: dict[str, Any]
    payload: bytes
    report: dict[str, Any]


@dataclass
class _Stream:
    stream_id: int
    sender: DeltaSender
    base_version: int
    used: float = field(default_factory=time.monotonic)


def dense_nbytes(weights: Mapping[str, np.ndarray]) -> int:
    """Bytes of ``weights`` as dense fp32 (what a delta is measured against)."""
    return sum(int(np.asarray(w).size) * 4 for w in weights.values())


def _payload_cap(shape: tuple[int, ...], config: WeightStreamConfig) -> int:
    """Largest honest payload of a tensor of ``shape``: ``int8_rowwise`` (row and column scales
    included) or ``sparse_exact`` (every entry: a varint index of at most 5 bytes and its value)."""
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if config.encoding == SPARSE_EXACT:
        return numel * (5 + (2 if config.value_dtype == "bfloat16" else 4))
    cols = shape[-1] if shape else 1
    rows = numel // cols if cols else 0
    return numel + rows + cols + 8


def _sender(weights: Mapping[str, np.ndarray], config: WeightStreamConfig) -> DeltaSender:
    if config.encoding == SPARSE_EXACT:
        return DeltaSender(weights, SPARSE_EXACT, value_dtype=config.value_dtype)
    return DeltaSender(weights, config.encoding)


class StreamLeader:
    """The leader's streams, one per inference replica (peer id)."""

    def __init__(self, config: WeightStreamConfig | None = None) -> None:
        self.config = config or WeightStreamConfig()
        self._streams: dict[str, _Stream] = {}
        # ids differ across leaders and restarts, so a replica never mistakes an old stream for a new one
        self._next_id = secrets.randbelow(STREAM_ID_LIMIT // 2)

    def peers(self) -> list[str]:
        return sorted(self._streams)

    def has(self, peer: str) -> bool:
        return peer in self._streams

    def stream_id(self, peer: str) -> int | None:
        stream = self._streams.get(peer)
        return None if stream is None else stream.stream_id

    def start(self, peer: str, weights: Mapping[str, np.ndarray], version: int) -> int:
        """Start (or restart) ``peer``'s stream from exactly ``weights``; returns the stream id."""
        if peer not in self._streams and len(self._streams) >= self.config.max_streams:
            oldest = min(self._streams, key=lambda p: self._streams[p].used)
            log.info("weight stream cap (%d) reached; dropping the stream to %s", self.config.max_streams, oldest)
            del self._streams[oldest]
        stream_id = self._next_id
        self._next_id = (self._next_id + 1) % STREAM_ID_LIMIT
        self._streams[peer] = _Stream(stream_id, _sender(weights, self.config), version)
        return stream_id

    def retain(self, peers: Iterable[str]) -> None:
        """Drop the streams of every replica not in ``peers``."""
        keep = set(peers)
        for peer in [p for p in self._streams if p not in keep]:
            del self._streams[peer]

    def clear(self) -> None:
        self._streams.clear()

    def encode(self, peer: str, weights: Mapping[str, np.ndarray], version: int) -> DeltaFrame:
        """The next delta of ``peer``'s stream towards ``weights`` (advances its shadow)."""
        stream = self._streams[peer]
        stream.used = time.monotonic()
        delta = stream.sender.encode(weights)
        header, payload = delta.to_wire()
        shadow = stream.sender.shadow_view
        residual = max((float(np.max(np.abs(np.asarray(w, np.float32) - shadow[n]), initial=0.0))
                        for n, w in weights.items()), default=0.0)
        report = {"peer": peer, "checksum": checksum(shadow), "delta_bytes": len(payload),
                  "dense_bytes": dense_nbytes(weights), "residual_max_abs": residual}
        return DeltaFrame({"version": int(version), "stream": stream.stream_id, "delta": header}, payload, report)

    def shadow(self, peer: str) -> dict[str, np.ndarray]:
        """A copy of what ``peer`` holds (tests, measurements)."""
        return self._streams[peer].sender.shadow


class StreamFollower:
    """An inference replica's view of its stream: whose, which, how far; and its shadow."""

    APPLY = "apply"
    IGNORE = "ignore"
    RESYNC = "resync"

    def __init__(self, config: WeightStreamConfig | None = None) -> None:
        self.config = config or WeightStreamConfig()
        self.source: str | None = None
        self.stream_id: int | None = None
        self.version: int | None = None  #: version of the weights the shadow holds
        self._receiver: DeltaReceiver | None = None
        self._max_payload = 0

    @property
    def following(self) -> bool:
        return self._receiver is not None

    def reset(self, source: str, stream_id: int, weights: Mapping[str, np.ndarray], version: int) -> None:
        """Follow ``source``'s stream ``stream_id``, starting from exactly ``weights``."""
        self._receiver = DeltaReceiver(weights)
        self.source, self.stream_id, self.version = source, int(stream_id), int(version)
        self._max_payload = self.config.payload_slack_bytes + sum(_payload_cap(np.shape(w), self.config)
                                                                 for w in weights.values())

    def forget(self) -> None:
        """Stop following (new stage, or weights loaded some other way)."""
        self._receiver = None
        self.source = self.stream_id = self.version = None

    def decide(self, sender: str, kind: str, version: int, stream_id: int | None = None) -> str:
        """What to do with a ``wlead`` / ``wdelta`` from ``sender`` (a trainer of our stage)."""
        if self._receiver is None or sender != self.source:
            return self.RESYNC  # never synced, or a new leader: full weights first
        if kind == "wlead":
            # the leader holds no stream for us; one sent before our last fetch is stale
            return self.IGNORE if self.version is not None and version <= self.version else self.RESYNC
        if stream_id == self.stream_id:
            return self.APPLY
        # another stream of our source: older ones were sent before the weights we hold
        return self.IGNORE if self.version is not None and version <= self.version else self.RESYNC

    def apply(self, delta_header: Any, payload: bytes, version: int) -> dict[str, np.ndarray]:
        """Apply one delta of our stream; returns the updated tensors (the new shadow values).

        Raises ``OutOfSequence`` (resync, nobody's fault) or another WireFormatError
        (malformed: a strike against the sender, then resync); the shadow is untouched then.
        """
        if self._receiver is None:
            raise WireFormatError("no stream to apply a delta to")
        if len(payload) > self._max_payload:
            raise WireFormatError(f"weight delta of {len(payload)} bytes exceeds this stage's cap "
                                  f"of {self._max_payload}")
        delta = WeightDelta.from_wire(delta_header, payload)
        if not delta.tensors:
            raise WireFormatError("weight delta without tensors")
        updated = self._receiver.apply_updates(delta)
        self.version = int(version)
        return updated

    def shadow(self) -> dict[str, np.ndarray]:
        """A copy of the weights as the stream left them (tests, measurements)."""
        if self._receiver is None:
            return {}
        return self._receiver.weights
