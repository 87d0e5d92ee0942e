"""Validation helpers for untrusted tensor-header values and payload sections.

Every function here either returns a value that is safe to use (right type, in
range, exact length) or raises :class:`~engine.net.errors.WireFormatError` with a
reason in words. Header maps are decoded into typed structs (:func:`convert_params`,
msgspec: bounds in the types, unknown keys refused); only bounds that depend on
other fields are checked by hand (:func:`require_in_range`). Shared by the tensor
codecs (``tensor_codec``, ``codec_int8``, ``codec_topk``) and ``shadow_delta``; they
know nothing about encodings, sockets or messages beyond "a header value" and "a
slice of payload bytes".
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import numpy as np
from numpy.typing import DTypeLike

from engine.net.errors import WireFormatError
from engine.net.wire import WireRecord

#: Largest finite float32; decoded values must stay below it.
FLOAT32_MAX = float(np.finfo(np.float32).max)


T = TypeVar("T")


class NoParams(WireRecord, frozen=True):
    """The params map of an encoding that takes none (must be ``{}``)."""


def convert_params(value: Any, kind: type[T], what: str) -> T:
    """An untrusted header map as the typed struct ``kind`` (bounds, types, no unknown keys)."""
    try:
        return msgspec.convert(value, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise WireFormatError(f"{what}: {str(exc)[:200]}") from None


def require_in_range(value: int, name: str, lo: int, hi: int) -> int:
    """A bound that depends on other fields (e.g. ``k <= numel``), checked after decoding."""
    if not lo <= value <= hi:
        raise WireFormatError(f"parameter {name!r}={value} outside [{lo}, {hi}]")
    return value


class PayloadReader:
    """Cuts a payload into consecutive sections whose sizes the header implies.

    ``take`` raises if the payload is too short; :meth:`finish` raises unless every
    byte was consumed, so a payload must have exactly the implied length.
    """

    def __init__(self, payload: memoryview) -> None:
        self._payload = payload
        self._offset = 0

    @property
    def remaining(self) -> int:
        return self._payload.nbytes - self._offset

    def expect_total(self, nbytes: int) -> None:
        """Fail early (before any allocation) unless exactly ``nbytes`` remain."""
        if self.remaining != nbytes:
            raise WireFormatError(
                f"payload has {self.remaining} bytes, header implies {nbytes}")

    def take(self, count: int, dtype: DTypeLike, what: str) -> np.ndarray:
        """The next ``count`` items of ``dtype`` as a read-only array view."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        if nbytes > self.remaining:
            raise WireFormatError(
                f"payload too short for {what}: need {nbytes} bytes, {self.remaining} left")
        section = np.frombuffer(self._payload, dtype=dtype, count=count, offset=self._offset)
        self._offset += nbytes
        return section

    def finish(self) -> None:
        if self.remaining:
            raise WireFormatError(f"payload has {self.remaining} trailing bytes")


def check_scales(scales: np.ndarray, what: str, *, max_code: float) -> np.ndarray:
    """Scales must be finite, non-negative, and ``scale * max_code`` must fit float32."""
    if scales.size == 0:
        return scales
    as64 = scales.astype(np.float64)
    if not np.isfinite(as64).all():
        raise WireFormatError(f"{what} contain NaN or inf")
    if (as64 < 0).any():
        raise WireFormatError(f"{what} contain negative values")
    if float(as64.max()) * max_code >= FLOAT32_MAX:
        raise WireFormatError(f"{what} too large: decoded values would overflow float32")
    return scales
