"""Validation helpers for untrusted tensor-header values and payload sections.

Every function here either returns a value that is safe to use (right type, in
range, exact length) or raises :class:`~engine.net.errors.WireFormatError` with a
reason in words. They are shared by the tensor codecs (``tensor_codec``,
``codec_int8``, ``codec_topk``); they know nothing about encodings, sockets or
messages beyond "a header value" and "a slice of payload bytes".
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from engine.net.errors import WireFormatError

#: Largest finite float32; decoded values must stay below it.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def require_int(params: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    """``params[key]`` as an int in ``[lo, hi]`` (bools are not ints here)."""
    if key not in params:
        raise WireFormatError(f"missing parameter {key!r}")
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireFormatError(f"parameter {key!r} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise WireFormatError(f"parameter {key!r}={value} outside [{lo}, {hi}]")
    return value


def require_choice(params: Mapping[str, Any], key: str, choices: Iterable[Any]) -> Any:
    """``params[key]`` if it equals one of ``choices`` (compared with type, so ``True != 1``)."""
    if key not in params:
        raise WireFormatError(f"missing parameter {key!r}")
    value = params[key]
    for choice in choices:
        if type(value) is type(choice) and value == choice:
            return value
    raise WireFormatError(f"parameter {key!r}={value!r:.40} is not one of {sorted(map(repr, choices))}")


def require_exact_keys(params: Any, allowed: set[str], *, what: str = "params") -> Mapping[str, Any]:
    """``params`` must be a dict with str keys, all of them in ``allowed``."""
    if not isinstance(params, dict):
        raise WireFormatError(f"{what} must be a map, got {type(params).__name__}")
    for key in params:
        if not isinstance(key, str):
            raise WireFormatError(f"{what} has a non-string key")
        if key not in allowed:
            raise WireFormatError(f"{what} has unknown key {key!r:.40}")
    return params


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

    def take(self, count: int, dtype: np.dtype | str, what: str) -> np.ndarray:
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
