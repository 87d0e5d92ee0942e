"""Exact outliers inside a low-rank payload: the entries a low-rank code misses most, sent as bfloat16.

Shared by ``codec_subspace`` and ``codec_basis``. The section is the outliers' flat positions as
varint gaps (``codec_topk``'s index coding), then their values as bfloat16 bits (uint16). This
module writes and reads that section; which entries are outliers is the caller's choice.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from engine.net.codec_checks import PayloadReader
from engine.net.codec_topk import varint_decode, varint_encode
from engine.net.errors import WireFormatError


def pack(flat: np.ndarray, positions: np.ndarray) -> tuple[bytes, bytes]:
    """``(index_section, values)`` for the entries of ``flat`` at sorted ``positions``."""
    if not positions.size:
        return b"", b""
    index_section = varint_encode(np.diff(positions, prepend=-1) - 1)
    values = flat[positions].astype(np.float32).astype(ml_dtypes.bfloat16).view("<u2")
    return index_section, values.tobytes()


def apply(reader: PayloadReader, out: np.ndarray, count: int, index_bytes: int) -> None:
    """Read ``count`` outliers from an untrusted payload and write them into ``out`` (any shape;
    positions index its flat view); raises WireFormatError for a position beyond it."""
    if not count:
        return
    numel = out.size
    gaps = varint_decode(reader.take(index_bytes, np.uint8, "outlier positions"), count)
    if int(gaps.max()) >= numel:
        raise WireFormatError("outlier gap beyond the tensor")
    positions = np.cumsum(gaps + np.uint64(1)) - np.uint64(1)
    if int(positions[-1]) >= numel:
        raise WireFormatError(f"outlier position {int(positions[-1])} beyond {numel} elements")
    values = reader.take(count, "<u2", "outlier values").view(ml_dtypes.bfloat16).astype(np.float32)
    out.reshape(-1)[positions.astype(np.int64)] = values
