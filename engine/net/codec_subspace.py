"""The ``subspace`` encoding: a tensor's rows as a mean, a low-rank part, a residual, and exact outliers.

Made for stage-boundary activations ``[batch, seq, hidden]`` of real models and their
gradients. A pretrained model's residual stream is nearly low-rank (SmolLM2-135M at its
layer-15 boundary: 64 of 576 principal directions hold 99 % of the energy) but carries a
few *massive* entries (the attention-sink token holds ~25 000 in one channel where the
median row peak is ~80) that any per-row or per-channel scale crushes the rest under.
So the encoder

1. takes the ``outliers`` largest-magnitude entries out and sends them exactly (bfloat16,
   positions as varint gaps, as ``codec_topk`` writes them);
2. centres the rows (``centred``: the column mean as float32) and finds the top ``rank``
   right singular vectors of what is left (per tensor, from its own rows: no state and
   nothing to agree on beforehand; the basis travels in the payload, int8 per row);
3. sends each row's coefficients in that basis (int8, per-row scales, column-scaled
   when the columns differ, i.e. ``codec_int8``'s payload);
4. optionally (``residual``) sends what the low-rank part misses as per-row int8.

``code_bits`` 4 (default 8) writes the basis and the coefficients with 4-bit codes
(``codec_int8``'s ``bits=4``): half their bytes, for tensors whose low-rank fit loses far
more than 4-bit rounding adds (stage-boundary gradients: rank 64 of their own misses ~20 %
of SmolLM2's, 4-bit rounding ~6 % of what is kept). The residual is always int8.

With ``rank=0`` and ``residual`` it is per-row int8 with the outliers kept exact (what
a few rows, e.g. one decoding step, want). Payload, in order (little-endian)::

    [mean: float32 x cols]                         when params["centred"]
    [basis: int8_rowwise payload of [rank, cols], not column-scaled]   code_bits-bit codes
    [coefficients: int8_rowwise payload of [rows, rank]]   column-scaled per params, code_bits-bit
    [residual: int8_rowwise payload of [rows, cols]]       when params["residual"]
    [outlier positions: varint gaps (codec_topk), outlier_index_bytes long]
    [outlier values: bfloat16 bits as uint16 x outliers]

    value = mean + coefficients @ basis (+ residual), then value[position] = outlier

Rows of 576 values with rank 32 cost 33 bytes each plus 18.5 kB per tensor for the basis
(about 30x fewer bytes than float32 for a 1 200-row micro-batch). Decoding does a matrix
product, so two machines may decode a few ulps apart: fine for activations, not for
shadow copies. This module knows the encoding only; header checks live in
``tensor_codec``; which tensor gets which rank is the caller's choice.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import ml_dtypes
import numpy as np
from msgspec import Meta

from engine.net import codec_int8, codec_outliers
from engine.net.codec_checks import PayloadReader, convert_params, require_in_range
from engine.net.errors import WireFormatError
from engine.net.wire import WireRecord

#: most basis vectors one tensor may carry
MAX_RANK = 1024
#: default share of entries sent exactly as outliers
DEFAULT_OUTLIER_FRACTION = 0.001
_VARINT_MAX_BYTES = 5
_BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


class SubspaceParams(WireRecord, frozen=True):
    """The header params of ``subspace`` (bounds that depend on the shape are checked in decode)."""

    rank: Annotated[int, Meta(ge=0, le=MAX_RANK)]  # basis vectors (<= rows and <= cols)
    centred: bool  # a float32 column mean leads the payload
    coef_col_scaled: bool  # the coefficients' int8 payload carries column scales
    residual: bool  # a per-row int8 residual follows the coefficients
    residual_col_scaled: bool  # the residual's int8 payload carries column scales (False without residual)
    outliers: Annotated[int, Meta(ge=0, le=1 << 40)]  # entries sent exactly (<= the tensor's elements)
    outlier_index_bytes: Annotated[int, Meta(ge=0, le=_VARINT_MAX_BYTES << 40)]  # bytes of their positions
    code_bits: Literal[8, 4] = 8  # bits per code of the basis and the coefficients


def payload_nbytes(rows: int, cols: int, rank: int, *, centred: bool, coef_col_scaled: bool, residual: bool,
                   residual_col_scaled: bool, outliers: int, outlier_index_bytes: int, code_bits: int = 8) -> int:
    """Exact payload length the params imply (the decoder refuses any other)."""
    total = 4 * cols if centred else 0
    if rank:
        total += (codec_int8.payload_nbytes(rank, cols, False, code_bits)
                  + codec_int8.payload_nbytes(rows, rank, coef_col_scaled, code_bits))
    if residual:
        total += codec_int8.payload_nbytes(rows, cols, residual_col_scaled)
    return total + outlier_index_bytes + 2 * outliers


def _top_basis(matrix: np.ndarray, rank: int) -> np.ndarray:
    """The top ``rank`` right singular vectors of ``matrix`` as rows ``[rank, cols]`` (float64)."""
    rows, cols = matrix.shape
    if rows >= cols:
        values, vectors = np.linalg.eigh(matrix.T @ matrix)
        return vectors[:, ::-1][:, :rank].T
    values, vectors = np.linalg.eigh(matrix @ matrix.T)
    order = np.argsort(values)[::-1][:rank]
    basis = (matrix.T @ vectors[:, order]).T
    norms = np.linalg.norm(basis, axis=1, keepdims=True)
    return basis / np.where(norms > 0, norms, 1.0)


#: rounds of refilling the outlier positions with the low-rank fit before the final one
FILL_ROUNDS = 2


def _fill_outliers(matrix: np.ndarray, positions: np.ndarray, rank: int, centred: bool) -> np.ndarray:
    """``matrix`` with the outlier positions replaced by what the low-rank fit of the rest says
    (they are sent exactly, so they must not bend the basis the other entries are fitted in)."""
    rows, cols = matrix.shape
    if not positions.size or not rows:
        return matrix
    keep_flat = np.ones(matrix.size, bool)
    keep_flat[positions] = False
    keep = keep_flat.reshape(rows, cols)
    counts = keep.sum(axis=0)
    col_mean = np.where(counts > 0, (matrix * keep).sum(axis=0) / np.maximum(counts, 1), 0.0)
    out = np.where(keep, matrix, col_mean[None, :])
    for _ in range(FILL_ROUNDS if rank else 0):
        mean = out.mean(axis=0) if centred else np.zeros(cols)
        basis = _top_basis(out - mean, rank)
        fit = (out - mean) @ basis.T @ basis + mean
        out.reshape(-1)[positions] = fit.reshape(-1)[positions]
    return out


def _int8_roundtrip(matrix: np.ndarray, col_scaling: str | bool, bits: int = 8) -> tuple[bool, bytes, np.ndarray]:
    """(col_scaled, payload, decoded) of ``matrix`` through ``codec_int8`` with ``bits``-bit codes."""
    params, payload = codec_int8.encode(matrix.astype(np.float32), col_scaling=col_scaling, bits=bits)
    decoded = codec_int8.decode(matrix.shape, matrix.size, params, PayloadReader(memoryview(payload)), bits)
    return bool(params["col_scaled"]), payload, decoded.reshape(matrix.shape)


def encode(array: np.ndarray, rank: int = 32, outlier_fraction: float = DEFAULT_OUTLIER_FRACTION,
           residual: bool = False, centred: bool = True, code_bits: int = 8) -> tuple[dict[str, Any], bytes]:
    """Encode a float32 array (rows = all leading dims, cols = the last dim); ``rank`` is
    clamped to the rows and columns there are."""
    if code_bits not in codec_int8.CODE_BITS:
        raise ValueError(f"code_bits must be one of {codec_int8.CODE_BITS}, got {code_bits!r}")
    if not np.isfinite(array).all():
        raise ValueError("subspace cannot encode NaN or inf")
    if not 0 <= rank <= MAX_RANK:
        raise ValueError(f"rank must be in [0, {MAX_RANK}], got {rank}")
    if not 0.0 <= outlier_fraction <= 1.0:
        raise ValueError(f"outlier_fraction must be in [0, 1], got {outlier_fraction}")
    rows, cols = codec_int8.rows_and_cols(array.shape, array.size)
    if array.size >= 2 ** 32:
        raise ValueError("subspace supports tensors below 2**32 elements")
    if np.abs(array).max(initial=0.0) > _BF16_MAX:
        raise ValueError("subspace cannot encode values beyond the bfloat16 range")
    matrix = array.reshape(rows, cols).astype(np.float64)
    flat = matrix.reshape(-1)
    n_out = min(flat.size, math.ceil(outlier_fraction * flat.size)) if flat.size else 0
    positions = np.sort(np.argpartition(np.abs(flat), flat.size - n_out)[flat.size - n_out:]) if n_out \
        else np.zeros(0, np.int64)
    rank = min(rank, rows, cols)
    rest = _fill_outliers(matrix, positions, rank, centred)
    parts: list[bytes] = []
    mean = rest.mean(axis=0).astype(np.float32) if centred and rows else np.zeros(cols, np.float32)
    if centred:
        parts.append(mean.astype("<f4").tobytes())
    centred_rest = rest - mean.astype(np.float64)
    coef_col_scaled = False
    approx = np.zeros((rows, cols))
    if rank:
        _, basis_payload, basis_q = _int8_roundtrip(_top_basis(centred_rest, rank), False, code_bits)
        basis_q = basis_q.astype(np.float64)
        # least squares against the basis as decoded, so its rounding is not paid twice (lstsq: a tensor
        # of lower rank than asked can quantise some vectors to zero, which a normal-equation solve refuses)
        coef = np.linalg.lstsq(basis_q.T, centred_rest.T, rcond=None)[0].T
        coef_col_scaled, coef_payload, coef_q = _int8_roundtrip(coef, "auto", code_bits)
        parts += [basis_payload, coef_payload]
        approx = coef_q.astype(np.float64) @ basis_q
    residual_col_scaled = False
    if residual:
        residual_col_scaled, res_payload, _ = _int8_roundtrip(centred_rest - approx, "auto")
        parts.append(res_payload)
    index_section, values = codec_outliers.pack(flat, positions)
    parts += [index_section, values]
    params = {"rank": int(rank), "centred": bool(centred), "coef_col_scaled": coef_col_scaled,
              "residual": bool(residual), "residual_col_scaled": residual_col_scaled,
              "outliers": int(n_out), "outlier_index_bytes": len(index_section)}
    if code_bits != 8:  # 8-bit headers stay as they were
        params["code_bits"] = code_bits
    return params, b"".join(parts)


def decode(shape: tuple[int, ...], numel: int, params: Any, reader: PayloadReader) -> np.ndarray:
    """Decode an untrusted payload into a flat float32 array (raises WireFormatError)."""
    typed = convert_params(params, SubspaceParams, "subspace params")
    rows, cols = codec_int8.rows_and_cols(shape, numel)
    rank = require_in_range(typed.rank, "rank", 0, min(rows, cols))
    n_out = require_in_range(typed.outliers, "outliers", 0, numel)
    index_bytes = require_in_range(typed.outlier_index_bytes, "outlier_index_bytes", n_out,
                                   _VARINT_MAX_BYTES * n_out)
    if typed.residual_col_scaled and not typed.residual:
        raise WireFormatError("residual_col_scaled without a residual")
    reader.expect_total(payload_nbytes(rows, cols, rank, centred=typed.centred,
                                       coef_col_scaled=typed.coef_col_scaled, residual=typed.residual,
                                       residual_col_scaled=typed.residual_col_scaled, outliers=n_out,
                                       outlier_index_bytes=index_bytes, code_bits=typed.code_bits))
    out = np.zeros((rows, cols), np.float32)
    if typed.centred:
        mean = reader.take(cols, "<f4", "column mean")
        if not np.isfinite(mean).all():
            raise WireFormatError("column mean contains NaN or inf")
        out += mean[None, :]
    if typed.coef_col_scaled and not rank:
        raise WireFormatError("coef_col_scaled without a basis")
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow shows as inf: tensor_codec refuses it
        if rank:
            basis = codec_int8.take_matrix(reader, rank, cols, False, "basis", typed.code_bits)
            coef = codec_int8.take_matrix(reader, rows, rank, typed.coef_col_scaled, "coefficients", typed.code_bits)
            out += coef @ basis
        if typed.residual:
            out += codec_int8.take_matrix(reader, rows, cols, typed.residual_col_scaled, "residual")
    codec_outliers.apply(reader, out, n_out, index_bytes)
    return out.reshape(-1)
