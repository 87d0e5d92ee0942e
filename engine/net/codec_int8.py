"""The ``int8_rowwise`` encoding: int8 codes with one scale per row (last dim).

Made for activations ``[batch, seq, hidden]`` and their gradients: a row is one
token's hidden vector, so a token with unusually large values (an "attention
sink") gets its own scale. Real activations also have a few *outlier channels*
(hidden dims that are large in every token); one scale per row would then be set
by the outlier and crush every other channel. When the rows show such channels
the encoder first divides each column by its own scale (``col_scaled``), which
keeps the relative error near 0.65 % whatever the outliers.

Scales are *log-coded*: a float32 reference (the largest scale) plus one byte per
row or column, ``scale = ref * 2**(-code / 8)`` (1/8-octave steps, rounded up so
codes never clip; code 255 = zero). Payload, in order (little-endian)::

    [col ref: float32][col codes: uint8, one per column]   only when params["col_scaled"]
    [row ref: float32][row codes: uint8, one per row]
    [codes: int8, rows * cols, C order]

    value[r, c] = code[r, c] * row_scale[r] (* col_scale[c])

``hidden = 128`` thus costs 129 bytes a row instead of 512: 3.95x fewer than
float32. Inside other encodings' payloads (``subspace`` coefficients and bases, where a
low-rank fit already loses far more than int8 rounding) the codes may be 4-bit instead
(``bits=4``): codes in [-7, 7] stored as ``code + 8``, two per byte, low nibble first, a
zero nibble padding an odd count; the standalone ``int8_rowwise`` encoding is always 8-bit.
Decoding uses only exact operations (ldexp, one float32 multiply), so
every machine decodes the same bits (shadow copies rely on that).
This module knows the encoding only; header checks live in ``tensor_codec``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.net.codec_checks import FLOAT32_MAX, PayloadReader, check_scales, convert_params
from engine.net.errors import WireFormatError
from engine.net.wire import WireRecord

#: Largest code; codes are in [-127, 127] (the decoder tolerates -128).
MAX_CODE = 127
#: Code widths a section may use, and the largest code of each (4-bit: [-7, 7], -8 tolerated).
CODE_BITS = (8, 4)
_MAX_CODES = {8: MAX_CODE, 4: 7}
#: Column scaling is considered only with at least this many rows.
MIN_ROWS_FOR_COL_SCALES = 8
#: "auto" column scaling when the largest column absmax exceeds the median by this factor.
OUTLIER_COLUMN_FACTOR = 3.0
#: Log-coded scales: steps per octave, the "zero" code and the largest other code.
LOG_STEPS_PER_OCTAVE = 8
ZERO_SCALE_CODE = 255
_MAX_LOG_CODE = 254
#: 2**(-j/8) for j = 0..7 as float32: the fractional part of a log-coded scale.
_FRACTIONS = np.array([2.0 ** (-j / LOG_STEPS_PER_OCTAVE) for j in range(LOG_STEPS_PER_OCTAVE)],
                      dtype=np.float32)


def rows_and_cols(shape: tuple[int, ...], numel: int) -> tuple[int, int]:
    """Rows (all leading dims flattened) and columns (the last dim) of a tensor."""
    cols = shape[-1] if shape else 1
    rows = numel // cols if cols else 0
    return rows, cols


def decode_log_scales(ref: float | np.floating, codes: np.ndarray) -> np.ndarray:
    """float32 scales ``ref * 2**(-code/8)`` (0 where code is 255), bit-exact everywhere."""
    codes = codes.astype(np.int32)
    mantissa = np.float32(ref) * _FRACTIONS[codes % LOG_STEPS_PER_OCTAVE]
    scales = np.ldexp(mantissa, -(codes // LOG_STEPS_PER_OCTAVE)).astype(np.float32)
    scales[codes == ZERO_SCALE_CODE] = 0.0
    return scales


def encode_log_scales(wanted: np.ndarray) -> tuple[np.float32, np.ndarray, np.ndarray]:
    """(ref, uint8 codes, decoded scales) with every decoded scale >= ``wanted`` (>= 0).

    Scales more than 2**31.75 below the largest are clamped up to that floor.
    """
    wanted = wanted.astype(np.float32)
    ref = np.float32(wanted.max()) if wanted.size else np.float32(0.0)
    codes = np.full(wanted.shape, ZERO_SCALE_CODE, np.uint8)
    positive = wanted > 0
    if positive.any():
        octaves = np.log2(np.float64(ref)) - np.log2(wanted[positive].astype(np.float64))
        codes[positive] = np.clip(np.floor(octaves * LOG_STEPS_PER_OCTAVE), 0, _MAX_LOG_CODE)
        scales = decode_log_scales(ref, codes)
        short = positive & (scales < wanted) & (codes > 0)  # float rounding: step one code up
        codes[short] -= 1
    return ref, codes, decode_log_scales(ref, codes)


def _wants_col_scales(colmax: np.ndarray, rows: int) -> bool:
    if rows < MIN_ROWS_FOR_COL_SCALES or colmax.size < 2:
        return False
    median = float(np.median(colmax))
    return float(colmax.max()) > OUTLIER_COLUMN_FACTOR * max(median, float(np.finfo(np.float32).tiny))


def _pack_nibbles(codes: np.ndarray) -> bytes:
    """4-bit codes in [-7, 7] as ``code + 8``, two a byte, low nibble first (a zero nibble pads)."""
    nibbles = (codes.reshape(-1).astype(np.int16) + 8).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << np.uint8(4))).tobytes()


def _unpack_nibbles(packed: np.ndarray, count: int) -> np.ndarray:
    """int8 codes in [-8, 7] from :func:`_pack_nibbles` bytes (raises on a non-zero pad nibble)."""
    nibbles = np.stack([packed & np.uint8(15), packed >> np.uint8(4)], axis=1).reshape(-1)
    if nibbles[count:].any():
        raise WireFormatError("non-zero padding nibble after the last 4-bit code")
    return nibbles[:count].astype(np.int8) - np.int8(8)


def encode(array: np.ndarray, col_scaling: str | bool = "auto", bits: int = 8) -> tuple[dict[str, Any], bytes]:
    """Encode a float32 array; ``col_scaling`` is ``"auto"``, ``True`` or ``False``; ``bits``: 8,
    or 4 inside another encoding's payload (the params do not say it: the caller's do)."""
    if col_scaling not in ("auto", True, False):
        raise ValueError(f"col_scaling must be 'auto', True or False, got {col_scaling!r}")
    if bits not in CODE_BITS:
        raise ValueError(f"bits must be one of {CODE_BITS}, got {bits!r}")
    if not np.isfinite(array).all():
        raise ValueError("int8_rowwise cannot encode NaN or inf")
    rows, cols = rows_and_cols(array.shape, array.size)
    matrix = array.reshape(rows, cols)
    parts: list[bytes] = []
    col_scaled = False
    if rows and cols:
        colmax = np.abs(matrix).max(axis=0)
        col_scaled = bool(col_scaling) if col_scaling != "auto" else _wants_col_scales(colmax, rows)
    if col_scaled:
        col_ref, col_codes, col_scales = encode_log_scales(colmax)
        matrix = matrix / np.where(col_scales > 0, col_scales, 1.0).astype(np.float32)
        parts += [np.array([col_ref], "<f4").tobytes(), col_codes.tobytes()]
    rowmax = np.abs(matrix).max(axis=1) if rows and cols else np.zeros(rows, np.float32)
    top = _MAX_CODES[bits]
    row_ref, row_codes, row_scales = encode_log_scales(rowmax / np.float32(top))
    safe = np.where(row_scales > 0, row_scales, 1.0).astype(np.float32)
    codes = np.clip(np.rint(matrix / safe[:, None]), -top, top).astype(np.int8)
    parts += [np.array([row_ref], "<f4").tobytes(), row_codes.tobytes(),
              codes.tobytes() if bits == 8 else _pack_nibbles(codes)]
    return {"col_scaled": col_scaled}, b"".join(parts)


def _take_log_scales(reader: PayloadReader, count: int, what: str, max_code: float) -> np.ndarray:
    ref = check_scales(reader.take(1, "<f4", f"{what} reference"), f"{what} reference",
                       max_code=max_code)
    return decode_log_scales(ref[0], reader.take(count, np.uint8, what))


class Int8Params(WireRecord, frozen=True):
    """The header params of ``int8_rowwise``."""

    col_scaled: bool  # per-column log scales precede the row scales


def decode(shape: tuple[int, ...], numel: int, params: Any, reader: PayloadReader, bits: int = 8) -> np.ndarray:
    """Decode an untrusted payload into a flat float32 array (raises WireFormatError); ``bits``
    comes from the enclosing encoding's params (8 for a standalone ``int8_rowwise`` tensor)."""
    col_scaled = convert_params(params, Int8Params, "int8_rowwise params").col_scaled
    if bits not in CODE_BITS:
        raise WireFormatError(f"code bits must be one of {CODE_BITS}, got {bits!r}")
    rows, cols = rows_and_cols(shape, numel)
    reader.expect_total(payload_nbytes(rows, cols, col_scaled, bits))
    bound = _MAX_CODES[bits] + 1
    col_scales = _take_log_scales(reader, cols, "column scales", 1.0) if col_scaled else None
    row_scales = _take_log_scales(reader, rows, "row scales", bound)
    if col_scales is not None and col_scales.size and row_scales.size:
        if float(col_scales.max()) * float(row_scales.max()) * bound >= FLOAT32_MAX:
            raise WireFormatError("row and column scales together would overflow float32")
    if bits == 8:
        codes = reader.take(numel, np.int8, "int8 codes").reshape(rows, cols)
    else:
        codes = _unpack_nibbles(reader.take(_code_nbytes(numel, bits), np.uint8, "4-bit codes"), numel)
        codes = codes.reshape(rows, cols)
    out = codes.astype(np.float32) * row_scales[:, None]
    if col_scales is not None:
        out *= col_scales[None, :]
    return out.reshape(-1)


def _code_nbytes(count: int, bits: int) -> int:
    return count if bits == 8 else (count + 1) // 2


def payload_nbytes(rows: int, cols: int, col_scaled: bool, bits: int = 8) -> int:
    """Bytes of an ``int8_rowwise`` payload of ``[rows, cols]`` (column scales, row scales, codes)."""
    return ((4 + cols) if col_scaled else 0) + 4 + rows + _code_nbytes(rows * cols, bits)


def take_matrix(reader: PayloadReader, rows: int, cols: int, col_scaled: bool, what: str,
                bits: int = 8) -> np.ndarray:
    """A ``[rows, cols]`` int8_rowwise section (``bits``-bit codes) inside a larger untrusted payload, decoded."""
    section = reader.take(payload_nbytes(rows, cols, col_scaled, bits), np.uint8, what)
    try:
        decoded = decode((rows, cols), rows * cols, {"col_scaled": col_scaled},
                         PayloadReader(memoryview(section.tobytes())), bits)
    except WireFormatError as exc:
        raise WireFormatError(f"{what}: {exc}") from None
    return decoded.reshape(rows, cols)
