"""Quantised weight deltas against a shadow copy, so sender and receiver never drift.

A trainer pushes its weights to inference replicas as compressed deltas. Both
sides keep a *shadow*: the weights as the receiver knows them. The sender encodes
``weights - shadow`` and then advances its shadow by the **decoded** delta, the
very values the receiver adds to its own shadow, with the same float32
operations; so the two shadows stay bit-identical however lossy the encoding,
and whatever one round drops is still in the next round's delta.

``WeightDelta`` is the message: a sequence number and one encoded tensor per
name, with :meth:`WeightDelta.to_wire` / :meth:`WeightDelta.from_wire` for a
``(header, payload)`` frame. A receiver refuses a delta out of sequence
(:class:`OutOfSequence`: it must resync from full weights instead), and a delta
whose sum would not be finite; a refused delta leaves its shadow untouched.

With ``encoding="sparse_exact"`` (``engine.net.codec_sparse_exact``) a delta is not added
but assigned: only the entries whose bits changed travel, at their exact new values
(``value_dtype`` float32 or bfloat16), and the shadow then equals the sender's weights (or
their bf16 rounding) exactly.

What this module does not know: links, framing, or where weights come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any, Mapping

import numpy as np
from msgspec import Meta

from engine.net import codec_sparse_exact
from engine.net.codec_checks import convert_params
from engine.net.errors import WireFormatError
from engine.net.tensor_codec import DEFAULT_MAX_ELEMENTS, EncodedTensor, decode_tensor, encode_tensor
from engine.net.wire import WireRecord


class OutOfSequence(WireFormatError):
    """A delta that does not follow the last one applied: the shadows no longer agree."""


#: Most tensors in one delta message.
MAX_TENSORS = 4096
_NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,256}\Z"
TensorName = Annotated[str, Meta(pattern=_NAME_PATTERN, max_length=256)]


class DeltaHeader(WireRecord, frozen=True):
    """The header of a weight-delta frame (``WeightDelta.to_wire``)."""

    seq: Annotated[int, Meta(ge=0, le=2**63 - 1)]  # round of the stream
    # [name, tensor_codec header (checked by decode_tensor), payload bytes] per tensor
    tensors: Annotated[list[tuple[TensorName, dict[str, Any], Annotated[int, Meta(ge=0, le=1 << 40)]]],
                       Meta(max_length=MAX_TENSORS)]


@dataclass(frozen=True)
class WeightDelta:
    """Round ``seq`` of a weight stream: encoded deltas by parameter name."""

    seq: int
    tensors: dict[str, EncodedTensor]

    @property
    def wire_nbytes(self) -> int:
        return sum(t.wire_nbytes for t in self.tensors.values())

    def to_wire(self) -> tuple[dict[str, Any], bytes]:
        """``({"seq", "tensors": [[name, header, nbytes], ...]}, concatenated payloads)``."""
        entries = [[name, t.header, len(t.payload)] for name, t in self.tensors.items()]
        return {"seq": self.seq, "tensors": entries}, b"".join(t.payload for t in self.tensors.values())

    @classmethod
    def from_wire(cls, header: Any, payload: Any) -> "WeightDelta":
        """Parse an untrusted frame (tensor headers are checked later by the receiver)."""
        typed = convert_params(header, DeltaHeader, "weight delta header")
        seq = typed.seq
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise WireFormatError("weight delta payload must be bytes")
        view = memoryview(payload).cast("B") if isinstance(payload, memoryview) else memoryview(payload)
        tensors: dict[str, EncodedTensor] = {}
        offset = 0
        for name, tensor_header, nbytes in typed.tensors:
            if name in tensors:
                raise WireFormatError(f"repeated tensor name {name[:40]!r}")
            if nbytes > view.nbytes - offset:
                raise WireFormatError(f"{name}: payload size out of range")
            tensors[name] = EncodedTensor(tensor_header, bytes(view[offset:offset + nbytes]))
            offset += nbytes
        if offset != view.nbytes:
            raise WireFormatError(f"weight delta payload has {view.nbytes - offset} trailing bytes")
        return cls(seq=seq, tensors=tensors)


def _copy_weights(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.array(value, dtype=np.float32, order="C") for name, value in weights.items()}


class DeltaSender:
    """Encodes weights as deltas against its shadow; the shadow follows the decoded deltas."""

    def __init__(self, initial: Mapping[str, np.ndarray], encoding: str = "int8_rowwise",
                 **params: Any) -> None:
        self._shadow = _copy_weights(initial)
        self.encoding = encoding
        self.params = params
        self._seq = 0

    def encode(self, weights: Mapping[str, np.ndarray]) -> WeightDelta:
        """Delta for every tensor in ``weights`` (a subset of the names is fine)."""
        tensors: dict[str, EncodedTensor] = {}
        for name, value in weights.items():
            shadow = self._shadow.get(name)
            value = np.asarray(value, dtype=np.float32)
            if shadow is None or value.shape != shadow.shape:
                raise ValueError(f"{name}: not in the shadow or shape {value.shape} differs")
            if self.encoding == codec_sparse_exact.ENCODING:
                encoded, updated = codec_sparse_exact.encode(shadow, value, **self.params)
            else:
                delta = value - shadow
                encoded = encode_tensor(delta, self.encoding, **self.params)
                decoded = decode_tensor(encoded.header, encoded.payload,
                                        max_elements=max(1, shadow.size), expected_shape=shadow.shape)
                updated = shadow + decoded
            updated.flags.writeable = False
            self._shadow[name] = updated
            tensors[name] = encoded
        message = WeightDelta(seq=self._seq, tensors=tensors)
        self._seq += 1
        return message

    @property
    def shadow(self) -> dict[str, np.ndarray]:
        """A copy of the weights as the receiver holds them."""
        return _copy_weights(self._shadow)

    @property
    def shadow_view(self) -> Mapping[str, np.ndarray]:
        """The shadow itself, read-only and without a copy (its arrays are not writeable)."""
        return MappingProxyType(self._shadow)


class DeltaReceiver:
    """Applies deltas in sequence to its shadow; refuses anything malformed or out of order."""

    def __init__(self, initial: Mapping[str, np.ndarray], *,
                 max_elements: int = DEFAULT_MAX_ELEMENTS) -> None:
        self._shadow = _copy_weights(initial)
        self._max_elements = max_elements
        self._next_seq = 0

    def apply(self, delta: WeightDelta) -> dict[str, np.ndarray]:
        """Validate every tensor first, then apply all of them; returns the new weights (copies)."""
        self.apply_updates(delta)
        return self.weights

    def apply_updates(self, delta: WeightDelta) -> dict[str, np.ndarray]:
        """Like :meth:`apply`, but returns only the tensors the delta changed (copies)."""
        if delta.seq != self._next_seq:
            raise OutOfSequence(f"weight delta seq {delta.seq}, expected {self._next_seq}: resync needed")
        updated: dict[str, np.ndarray] = {}
        for name, encoded in delta.tensors.items():
            shadow = self._shadow.get(name)
            if shadow is None:
                raise WireFormatError(f"weight delta for unknown tensor {name[:40]!r}")
            if codec_sparse_exact.is_sparse_exact(encoded.header):
                updated[name] = codec_sparse_exact.apply(shadow, encoded.header, encoded.payload,
                                                         max_elements=self._max_elements)
                continue
            value = decode_tensor(encoded.header, encoded.payload,
                                  max_elements=min(self._max_elements, max(1, shadow.size)),
                                  expected_shape=shadow.shape, expected_dtype="float32")
            with np.errstate(over="ignore", invalid="ignore"):  # refused just below
                updated[name] = shadow + value
            if not np.isfinite(updated[name]).all():
                raise WireFormatError(f"weight delta for {name[:40]!r} makes the weights non-finite")
        self._shadow.update(updated)
        self._next_seq += 1
        return _copy_weights(updated)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return _copy_weights(self._shadow)
