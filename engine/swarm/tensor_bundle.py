"""Many named tensors in one message: a list of entries in the header, one payload.

Used for replica gradient exchange and for weight transfer between replicas.
Unpacking treats everything as hostile: names must be expected, shapes must
match what the receiver holds, byte counts must add up to the payload exactly,
and each tensor is decoded by ``engine.net.tensor_codec`` with its own cap.

:func:`checksum` fingerprints a set of named tensors (replicas, and a weight
stream's two ends, compare these).

It knows nothing about links, replicas or optimisers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.net.errors import ProtocolViolation
from engine.net.tensor_codec import EncodedTensor, decode_tensor, encode_tensor
from engine.swarm.messages import TensorEntry


def pack(encoded: Mapping[str, EncodedTensor]) -> tuple[list[dict[str, Any]], bytes]:
    """``(entries, payload)`` for ``{name: EncodedTensor}``, in the mapping's order."""
    entries = []
    parts = []
    for name, tensor in encoded.items():
        payload = bytes(tensor.payload)
        entries.append({"name": name, "tensor": tensor.header, "nbytes": len(payload)})
        parts.append(payload)
    return entries, b"".join(parts)


def pack_arrays(arrays: Mapping[str, np.ndarray], encoding: str = "fp32") -> tuple[list[dict[str, Any]], bytes]:
    """Encode every array with ``encoding`` and pack them."""
    return pack({name: encode_tensor(np.asarray(a, dtype=np.float32), encoding) for name, a in arrays.items()})


def wire_entries(entries: list[dict[str, Any]]) -> list[TensorEntry]:
    """The entries of :func:`pack` as the typed records a ``share`` / ``weights`` message carries."""
    return [TensorEntry(name=e["name"], tensor=e["tensor"], nbytes=e["nbytes"]) for e in entries]


def _fields(entry: TensorEntry | Mapping[str, Any]) -> tuple[str, Any, int]:
    if isinstance(entry, TensorEntry):
        return entry.name, entry.tensor, int(entry.nbytes)
    return entry["name"], entry["tensor"], int(entry["nbytes"])


def unpack(entries: list[TensorEntry] | list[dict[str, Any]], payload: bytes | memoryview,
           expected_shapes: Mapping[str, tuple[int, ...]], *, require_all: bool = False) -> dict[str, np.ndarray]:
    """Decode a bundle; every name must be in ``expected_shapes`` with that exact shape.

    Raises :class:`ProtocolViolation` (or its subclass WireFormatError) on any mismatch.
    """
    view = memoryview(payload)
    fields = [_fields(e) for e in entries]
    total = sum(nbytes for _, _, nbytes in fields)
    if total != len(view):
        raise ProtocolViolation(f"bundle entries claim {total} bytes, payload has {len(view)}")
    out: dict[str, np.ndarray] = {}
    offset = 0
    for name, header, nbytes in fields:
        if name not in expected_shapes:
            raise ProtocolViolation(f"bundle names unknown tensor {name[:80]!r}")
        if name in out:
            raise ProtocolViolation(f"bundle repeats tensor {name[:80]!r}")
        shape = tuple(expected_shapes[name])
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        out[name] = decode_tensor(header, view[offset:offset + nbytes], max_elements=max(numel, 1),
                                  expected_shape=shape, expected_dtype="float32")
        offset += nbytes
    if require_all and len(out) != len(expected_shapes):
        missing = sorted(set(expected_shapes) - set(out))
        raise ProtocolViolation(f"bundle lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return out


def checksum(arrays: Mapping[str, np.ndarray]) -> float:
    """A cheap fingerprint of named tensors: about 97 evenly spaced elements of each, summed.

    Equal tensors give equal checksums (bit for bit: the same elements are summed in the
    same order in float64); it is a drift detector, not a cryptographic hash.
    """
    total = 0.0
    for _, a in sorted(arrays.items()):
        flat = np.asarray(a).ravel()
        total += float(flat[:: max(1, flat.size // 97)].astype(np.float64).sum())
    return total
