"""Exact sparse weight deltas: the entries whose bits changed, at their new exact values.

For a weight stream against a shadow (``engine.net.shadow_delta``): instead of adding a
quantised difference, the sender lists the entries whose value (in ``value_dtype``) differs
from the shadow's and sends each one's new value bit for bit; the receiver *assigns* them.
So the shadow equals the sender's weights exactly (``float32``), or equals their bf16
rounding exactly (``bfloat16``: an entry is sent when its bf16 rounding changed, and the
shadow holds that rounding), with nothing left over for a later round. RL at small
learning rates changes few bf16 values per step (PULSE, 2026), so such a delta is small;
AdamW changes every fp32 value every step, so with full fp32 fine-tuning it is not
(``polis bench comm --weights`` measures both against ``int8_rowwise``).

Wire form: a header map ::

    {"encoding": "sparse_exact", "v": 1, "shape": [...], "value_dtype": "float32" | "bfloat16",
     "k": entries sent, "index_bytes": bytes of the index section}

and the payload ``[indices as LEB128 gaps (engine.net.codec_topk.varint_encode)][values:
k little-endian float32, or k bf16 bit patterns as uint16]``. Everything is checked on decode:
exact lengths, indices strictly increasing and in range, finite values.

What it does not know: streams, sequence numbers, links.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from msgspec import Meta

from engine.net.codec_checks import PayloadReader, convert_params, require_in_range
from engine.net.codec_topk import varint_decode, varint_encode
from engine.net.errors import WireFormatError
from engine.net.tensor_codec import DEFAULT_MAX_ELEMENTS, MAX_NDIM, EncodedTensor
from engine.net.wire import WireRecord

ENCODING = "sparse_exact"
ValueDtype = Literal["float32", "bfloat16"]
_MAX_VARINT_BYTES = 5


class SparseExactHeader(WireRecord, frozen=True):
    """The header of one exact sparse delta (bounds that depend on the shape are checked in apply)."""

    encoding: Literal["sparse_exact"]
    v: Literal[1]
    shape: Annotated[list[Annotated[int, Meta(ge=0, le=1 << 40)]], Meta(max_length=MAX_NDIM)]
    value_dtype: ValueDtype  # what the values are (and what "changed" compares)
    k: Annotated[int, Meta(ge=0, le=1 << 40)]  # entries sent
    index_bytes: Annotated[int, Meta(ge=0, le=_MAX_VARINT_BYTES << 40)]  # bytes of the index section


def is_sparse_exact(header: Any) -> bool:
    return isinstance(header, dict) and header.get("encoding") == ENCODING


def round_to(values: np.ndarray, value_dtype: str) -> np.ndarray:
    """``values`` (float32) as the nearest ``value_dtype`` values, held in float32."""
    values = np.asarray(values, dtype=np.float32)
    if value_dtype == "float32":
        return values
    bits = values.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)  # round to nearest even (finite inputs: the stream refuses others)


def encode(shadow: np.ndarray, new: np.ndarray, value_dtype: str = "float32") -> tuple[EncodedTensor, np.ndarray]:
    """``(delta, updated shadow)``: the entries of ``new`` whose ``value_dtype`` value differs
    from ``shadow``'s; the updated shadow is exactly what :func:`apply` will make of it."""
    if value_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"value_dtype must be float32 or bfloat16, not {value_dtype!r}")
    shadow = np.asarray(shadow, dtype=np.float32)
    new = np.asarray(new, dtype=np.float32)
    if shadow.shape != new.shape:
        raise ValueError(f"shape {new.shape} differs from the shadow's {shadow.shape}")
    if not np.isfinite(new).all():
        raise ValueError("sparse_exact cannot send NaN or inf")
    target = round_to(new, value_dtype).reshape(-1)
    flat = shadow.reshape(-1)
    indices = np.flatnonzero(target.view(np.uint32) != flat.view(np.uint32))
    gaps = np.diff(indices, prepend=-1) - 1
    index_section = varint_encode(gaps)
    values = target[indices]
    value_section = (values.view(np.uint32) >> np.uint32(16)).astype("<u2").tobytes() \
        if value_dtype == "bfloat16" else values.astype("<f4").tobytes()
    header = {"encoding": ENCODING, "v": 1, "shape": [int(d) for d in shadow.shape], "value_dtype": value_dtype,
              "k": int(indices.size), "index_bytes": len(index_section)}
    updated = flat.copy()
    updated[indices] = values
    return EncodedTensor(header, index_section + value_section), updated.reshape(shadow.shape)


def apply(shadow: np.ndarray, header: Any, payload: Any, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> np.ndarray:
    """The shadow with an untrusted delta's entries assigned (a new array; raises WireFormatError)."""
    typed = convert_params(header, SparseExactHeader, "sparse_exact header")
    shadow = np.asarray(shadow, dtype=np.float32)
    if tuple(typed.shape) != shadow.shape:
        raise WireFormatError(f"shape {typed.shape} differs from the shadow's {list(shadow.shape)}")
    numel = int(shadow.size)
    if numel > max_elements:
        raise WireFormatError(f"tensor of {numel} elements exceeds {max_elements}")
    k = require_in_range(typed.k, "k", 0, numel)
    index_bytes = require_in_range(typed.index_bytes, "index_bytes", k, _MAX_VARINT_BYTES * k)
    value_bytes = (2 if typed.value_dtype == "bfloat16" else 4) * k
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise WireFormatError("sparse_exact payload must be bytes")
    reader = PayloadReader(memoryview(payload).cast("B"))
    reader.expect_total(index_bytes + value_bytes)
    gaps = varint_decode(reader.take(index_bytes, np.uint8, "index varints"), k)
    if k and int(gaps.max()) >= numel:
        raise WireFormatError("index gap beyond the tensor")
    positions = (np.cumsum(gaps + np.uint64(1)) - np.uint64(1)).astype(np.int64)
    if k and int(positions[-1]) >= numel:
        raise WireFormatError(f"index {int(positions[-1])} beyond {numel} elements")
    if typed.value_dtype == "bfloat16":
        values = (reader.take(k, "<u2", "bf16 values").astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        values = reader.take(k, "<f4", "float32 values").astype(np.float32)
    reader.finish()
    if not np.isfinite(values).all():
        raise WireFormatError("sparse_exact values contain NaN or inf")
    out = shadow.reshape(-1).copy()
    out[positions] = values
    return out.reshape(shadow.shape)
