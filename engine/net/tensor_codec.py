"""Tensor wire format: a small msgpack-able header plus one payload of bytes.

A tensor travels as ``EncodedTensor(header, payload)``::

    header = {"v": 1, "dtype": "float32", "shape": [8, 32, 128],
              "encoding": "int8_rowwise", "params": {...}}

``dtype`` is the tensor's logical dtype (what :func:`decode_tensor` returns),
``encoding`` says how the payload represents it:

============== ======== =====================================================
encoding       lossless payload
============== ======== =====================================================
``raw``        yes      the array's bytes, little-endian, C order (any dtype)
``fp32``       floats   float32 values (exact for float32 tensors)
``fp16``       no       float16 values (saturating at +-65504)
``bf16``       no       bfloat16 bits as uint16 (round to nearest even)
``int8_rowwise`` no     per-row scales + int8 codes; see ``codec_int8``
``topk``       no       k largest-magnitude entries, quantised; see ``codec_topk``
``subspace``   no       low-rank rows + exact outliers (+ int8 residual); see ``codec_subspace``
``basis``      no       coefficients in a basis held by both ends + exact outliers; see ``codec_basis``
============== ======== =====================================================

:func:`decode_tensor` treats header and payload as hostile: the header is decoded
into :class:`TensorHeader` (typed, bounded, unknown keys refused), every codec's
params into its own struct, the element count is capped *before* anything is
allocated, the payload must have exactly the implied length, and (unless asked
otherwise) float results must be finite. Any failure is a
:class:`~engine.net.errors.WireFormatError` with a reason.

``basis`` tensors need the receiver's :class:`~engine.net.codec_basis_model.BasisBook` of the
sender (``decode_tensor(..., bases=book)``); every other encoding is self-contained.

What this module does not know: framing, chunking, links or which tensor a
message carries (the caller passes ``expected_shape``/``expected_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

import ml_dtypes
import msgpack
import numpy as np
from msgspec import Meta

from engine.net import codec_basis, codec_int8, codec_subspace, codec_topk
from engine.net.codec_basis_model import BasisBook
from engine.net.codec_checks import NoParams, PayloadReader, convert_params
from engine.net.errors import WireFormatError
from engine.net.wire import WireRecord

#: Version of the header layout; bumped on incompatible changes.
WIRE_VERSION = 1
#: Default cap on the element count of one decoded tensor (128 MiB as float32).
DEFAULT_MAX_ELEMENTS = 1 << 25
#: Most decoded bytes per payload byte when the caller cannot say the expected shape: a
#: top-k header of 123 bytes must not make a receiver allocate 256 MiB (top-k at 0.1 %
#: expands ~1400x; rarer top-k needs the caller's ``expected_shape``).
DEFAULT_MAX_EXPANSION = 4096.0
#: decoded bytes always allowed on top of the expansion bound (small tensors, headers' worth)
EXPANSION_SLACK_BYTES = 64 * 1024
#: Most dimensions a tensor on the wire may have.
MAX_NDIM = 8

#: Logical dtypes that may cross the wire, by name (little-endian).
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype("<f8"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
_FP16_MAX = float(np.finfo(np.float16).max)
_BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)

#: wire names of DTYPES and of the encodings (unit-tested to match DTYPES and _CODECS)
DtypeName = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
                    "bool"]
EncodingName = Literal["raw", "fp32", "fp16", "bf16", "int8_rowwise", "topk", "subspace", "basis"]


class TensorHeader(WireRecord, frozen=True):
    """The header of one tensor on the wire (see the module docstring)."""

    v: Literal[1]  # WIRE_VERSION
    dtype: DtypeName  # logical dtype
    shape: Annotated[list[Annotated[int, Meta(ge=0, le=1 << 62)]], Meta(max_length=MAX_NDIM)]  # dimensions
    encoding: EncodingName  # how the payload is written
    params: Annotated[dict[str, Any], Meta(max_length=16)]  # the encoding's params, checked by its codec


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor ready for the wire: ``header`` (msgpack-able dict) + ``payload``."""

    header: dict[str, Any]
    payload: bytes

    @property
    def wire_nbytes(self) -> int:
        """Bytes on the wire: the msgpack'd header plus the payload."""
        return len(msgpack.packb(self.header)) + len(self.payload)

    @property
    def numel(self) -> int:
        return int(np.prod(self.header["shape"], dtype=np.int64))

    @property
    def ratio_vs_fp32(self) -> float:
        """How many times fewer bytes than the same tensor as dense float32."""
        return 4.0 * self.numel / max(1, self.wire_nbytes)


def dtype_name(dtype: np.dtype) -> str:
    """Wire name of a numpy dtype; ValueError if it may not cross the wire."""
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    for name, known in DTYPES.items():
        if dtype == known:
            return name
    raise ValueError(f"dtype {dtype} cannot be sent (allowed: {', '.join(DTYPES)})")


# ---------------------------------------------------------------- dense encodings

def _encode_raw(array: np.ndarray, params: dict) -> tuple[dict, bytes]:
    _no_params("raw", params)
    wire = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {}, np.ascontiguousarray(wire).tobytes()


def _decode_raw(shape: tuple[int, ...], numel: int, dtype: str, params: Any,
                reader: PayloadReader, bases: Any = None) -> np.ndarray:
    convert_params(params, NoParams, "raw params")
    np_dtype = DTYPES[dtype]
    reader.expect_total(numel * np_dtype.itemsize)
    if dtype == "bool":
        as_bytes = reader.take(numel, np.uint8, "bool values")
        if as_bytes.size and int(as_bytes.max()) > 1:
            raise WireFormatError("bool payload has bytes other than 0 and 1")
        return as_bytes.astype(np.bool_)
    return reader.take(numel, np_dtype, "raw values").copy()


def _encode_float(wire_dtype: np.dtype, limit: float | None) -> Callable[[np.ndarray, dict], tuple[dict, bytes]]:
    def encode(array: np.ndarray, params: dict) -> tuple[dict, bytes]:
        _no_params(str(wire_dtype), params)
        values = array.astype(np.float32, copy=False)
        if limit is not None:
            values = np.clip(values, -limit, limit)  # saturate; NaN stays NaN
        wire = values.astype(wire_dtype)
        if wire_dtype == DTYPES["bfloat16"]:
            wire = wire.view("<u2")
        return {}, np.ascontiguousarray(wire).tobytes()
    return encode


def _decode_float(wire_dtype: np.dtype) -> Callable[..., np.ndarray]:
    def decode(shape: tuple[int, ...], numel: int, dtype: str, params: Any,
               reader: PayloadReader, bases: Any = None) -> np.ndarray:
        convert_params(params, NoParams, f"{wire_dtype} params")
        reader.expect_total(numel * wire_dtype.itemsize)
        if wire_dtype == DTYPES["bfloat16"]:
            bits = reader.take(numel, "<u2", "bf16 values")
            return bits.view(ml_dtypes.bfloat16).astype(np.float32)
        return reader.take(numel, wire_dtype, "float values").astype(np.float32)
    return decode


def _no_params(encoding: str, params: dict) -> None:
    if params:
        raise ValueError(f"encoding {encoding!r} takes no parameters, got {sorted(params)}")


@dataclass(frozen=True)
class _Codec:
    #: (array, params) -> (wire params, payload); raises ValueError on sender mistakes.
    encode: Callable[[np.ndarray, dict], tuple[dict, bytes]]
    #: (shape, numel, dtype, untrusted params, reader, basis book or None) -> flat array; raises WireFormatError.
    decode: Callable[..., np.ndarray]
    float_only: bool


def _float_codec(module) -> _Codec:
    """Adapter for the codecs in their own modules (int8 rows, top-k, subspace)."""
    def encode(array: np.ndarray, params: dict) -> tuple[dict, bytes]:
        return module.encode(array.astype(np.float32, copy=False), **params)

    def decode(shape: tuple[int, ...], numel: int, dtype: str, params: Any,
               reader: PayloadReader, bases: Any = None) -> np.ndarray:
        if module is codec_basis:
            return module.decode(shape, numel, params, reader, bases)
        return module.decode(shape, numel, params, reader)
    return _Codec(encode, decode, float_only=True)


_CODECS: dict[str, _Codec] = {
    "raw": _Codec(_encode_raw, _decode_raw, float_only=False),
    "fp32": _Codec(_encode_float(np.dtype("<f4"), None), _decode_float(np.dtype("<f4")), True),
    "fp16": _Codec(_encode_float(np.dtype("<f2"), _FP16_MAX), _decode_float(np.dtype("<f2")), True),
    "bf16": _Codec(_encode_float(DTYPES["bfloat16"], _BF16_MAX), _decode_float(DTYPES["bfloat16"]), True),
    "int8_rowwise": _float_codec(codec_int8),
    "topk": _float_codec(codec_topk),
    "subspace": _float_codec(codec_subspace),
    "basis": _float_codec(codec_basis),
}
#: Names of all encodings.
ENCODINGS = tuple(_CODECS)
#: Encodings whose decode equals the input exactly (for float32 input; raw for any dtype).
LOSSLESS_ENCODINGS = frozenset({"raw", "fp32"})


# ---------------------------------------------------------------------- public API

def encode_tensor(array: Any, encoding: str = "fp32", **params: Any) -> EncodedTensor:
    """Encode ``array`` with ``encoding`` (see the module table); ``params`` go to the codec.

    Raises ValueError/TypeError for a sender-side mistake (unknown encoding, a
    dtype that may not travel, a lossy encoding of non-finite values, bad params).
    """
    array = np.asarray(array)
    if encoding not in _CODECS:
        raise ValueError(f"unknown encoding {encoding!r} (known: {', '.join(ENCODINGS)})")
    codec = _CODECS[encoding]
    name = dtype_name(array.dtype)
    if codec.float_only and name not in FLOAT_DTYPES:
        raise ValueError(f"encoding {encoding!r} needs a float tensor, got {name}")
    if array.ndim > MAX_NDIM:
        raise ValueError(f"tensor has {array.ndim} dims, at most {MAX_NDIM} may travel")
    wire_params, payload = codec.encode(np.ascontiguousarray(array), dict(params))
    header = {"v": WIRE_VERSION, "dtype": name, "shape": [int(d) for d in array.shape],
              "encoding": encoding, "params": wire_params}
    return EncodedTensor(header=header, payload=payload)


def decode_tensor(header: Any, payload: Any, *, max_elements: int = DEFAULT_MAX_ELEMENTS,
                  expected_shape: tuple[int, ...] | None = None,
                  expected_dtype: str | np.dtype | None = None,
                  allow_nonfinite: bool = False,
                  max_expansion: float | None = DEFAULT_MAX_EXPANSION,
                  bases: BasisBook | None = None) -> np.ndarray:
    """Decode an untrusted ``(header, payload)`` into a fresh, writable C-contiguous array.

    ``max_elements`` caps the decoded size (checked before allocating);
    ``expected_shape``/``expected_dtype`` must match the header when given; without an
    ``expected_shape``, the decoded bytes may be at most ``max_expansion`` times the payload
    (plus ``EXPANSION_SLACK_BYTES``; None = no ratio bound), also checked before allocating;
    float results containing NaN/inf are refused unless ``allow_nonfinite``; ``bases``: the
    sender's basis book (``basis`` tensors only; an inline basis is added to it).
    Raises :class:`WireFormatError` (with a reason) and nothing else on bad input.
    """
    shape, dtype, encoding, params = _validate_header(header, max_elements)
    if expected_shape is not None and tuple(shape) != tuple(expected_shape):
        raise WireFormatError(f"shape {list(shape)} differs from expected {list(expected_shape)}")
    if expected_dtype is not None:
        want = expected_dtype if isinstance(expected_dtype, str) else dtype_name(expected_dtype)
        if dtype != want:
            raise WireFormatError(f"dtype {dtype} differs from expected {want}")
    view = _as_byte_view(payload)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if expected_shape is None and max_expansion is not None and \
            numel * DTYPES[dtype].itemsize > max_expansion * view.nbytes + EXPANSION_SLACK_BYTES:
        raise WireFormatError(f"{view.nbytes} payload bytes cannot honestly decode to shape {list(shape)}")
    reader = PayloadReader(view)
    flat = _CODECS[encoding].decode(tuple(shape), numel, dtype, params, reader, bases)
    reader.finish()
    out = flat.reshape(shape)
    if dtype in FLOAT_DTYPES:
        out = out.astype(DTYPES[dtype], copy=False)
        if not allow_nonfinite and not np.isfinite(out).all():
            raise WireFormatError("tensor contains NaN or inf")
    if not out.flags.writeable or not out.flags.c_contiguous:
        out = np.array(out, order="C")
    return out


def tensor_shape(header: Any, max_elements: int = DEFAULT_MAX_ELEMENTS) -> tuple[tuple[int, ...], str]:
    """``(shape, dtype)`` of an untrusted header, validated, without touching any payload
    (so a receiver can check the shape it expects before anything is decoded)."""
    shape, dtype, _, _ = _validate_header(header, max_elements)
    return tuple(shape), dtype


def _validate_header(header: Any, max_elements: int) -> tuple[list[int], str, str, Any]:
    typed = convert_params(header, TensorHeader, "tensor header")
    if _CODECS[typed.encoding].float_only and typed.dtype not in FLOAT_DTYPES:
        raise WireFormatError(f"encoding {typed.encoding} cannot carry dtype {typed.dtype}")
    numel = 1
    for dim in typed.shape:
        numel *= dim
        if numel > max_elements:
            raise WireFormatError(f"tensor of shape {typed.shape} exceeds {max_elements} elements")
    return typed.shape, typed.dtype, typed.encoding, typed.params


def _as_byte_view(payload: Any) -> memoryview:
    if isinstance(payload, memoryview):
        view = payload
    elif isinstance(payload, (bytes, bytearray)):
        view = memoryview(payload)
    else:
        raise WireFormatError(f"payload must be bytes, got {type(payload).__name__}")
    if not view.c_contiguous:
        raise WireFormatError("payload memoryview is not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
