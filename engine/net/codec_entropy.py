"""Range coding of integer codes under a per-column Laplace model: the entropy coder of a coded basis.

A basis fitted at (nearly) full rank puts a row's energy into few principal coefficients.
Quantising every coefficient with one step (``codec_basis``: ``round(coefficient / step)``)
then spends bits where the energy is: a low-variance coefficient is almost always 0, and a
range coder under a model of each column's spread codes it in a small fraction of a bit.
That is transform coding, as image and audio codecs do it; the one step is the optimal
(reverse water-filling) allocation for squared error, and no coefficient is cut outright.

The model of column ``j`` is a Laplace distribution of scale ``scales[j]`` (in steps)
centred on 0, quantised to integers over ``[-CODE_LIMIT, CODE_LIMIT]`` with every code
possible (a leaky quantiser: a code the model thinks unlikely costs more bits, never fails).
The scales are fitted with the basis and travel inline with it; rows unlike the fitted ones
(generated answers against a calibration of mostly shared system-prompt rows: their spreads
were 1.4x the fitted ones in the median column, 36x in the 90th percentile) would pay for the
mismatch, so a tensor may carry its columns' own scales instead (a byte each, ``tensor_scale_codes``)
when that codes it in fewer bytes.
Measured on SmolLM2-135M's layer-15 boundary rows (step 0.2 of the coefficients' RMS): the
Laplace model codes within ~10 % of the codes' empirical entropy, 9 % fewer bytes than a
Gaussian one; coding ~30 us a row on one core.

The coder is ``constriction``'s range coder (queue semantics, 32-bit words): its words are
the bytes on the wire. Decoding untrusted words cannot overrun: the number of codes comes
from the tensor's shape, and words the model cannot have produced raise WireFormatError.

What this module does not know: bases, steps, payload layout (``codec_basis``).
"""

from __future__ import annotations

import constriction
import numpy as np

from engine.net.errors import WireFormatError

#: the largest code magnitude (a coefficient past it is clipped; the codec sends the worst misses exactly)
CODE_LIMIT = (1 << 15) - 1
#: the smallest Laplace scale of a column, in steps: a column that stayed near 0 in the fit must still
#: code a stray value cheaply (measured on SmolLM2 rows, step 0.2: floors 0.02 / 0.1 / 0.25 / 0.5 cost
#: 95 / 77 / 75 / 93 bytes a row)
MIN_SCALE = 0.25
#: codes per doubling of a tensor's own column scales (``tensor_scale_codes``): 2**(1/16), ~4 % apart
SCALE_GRID_STEPS = 16
#: bytes of one range-coder word (the coded section is a whole number of words)
WORD_BYTES = 4

_MODEL = constriction.stream.model.QuantizedLaplace(-CODE_LIMIT, CODE_LIMIT)


def _params(rows: int, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-code (mean, scale) arrays of ``rows`` rows under column ``scales``."""
    per_code = np.tile(np.maximum(np.asarray(scales, np.float64), MIN_SCALE), rows)
    return np.zeros_like(per_code), per_code


def encode_codes(codes: np.ndarray, scales: np.ndarray) -> bytes:
    """The range-coded words of integer ``codes [rows, cols]`` (each in ``[-CODE_LIMIT, CODE_LIMIT]``)
    under per-column Laplace ``scales [cols]``; a whole number of ``WORD_BYTES``."""
    matrix = np.asarray(codes)
    if matrix.ndim != 2 or matrix.shape[1] != np.asarray(scales).shape[0]:
        raise ValueError(f"codes of shape {matrix.shape} do not fit {np.asarray(scales).shape[0]} column scales")
    if matrix.size and int(np.abs(matrix).max()) > CODE_LIMIT:
        raise ValueError(f"codes must be within +-{CODE_LIMIT}")
    if not matrix.size:
        return b""
    means, per_code = _params(matrix.shape[0], scales)
    encoder = constriction.stream.queue.RangeEncoder()
    encoder.encode(np.ascontiguousarray(matrix, np.int32).reshape(-1), _MODEL, means, per_code)
    return encoder.get_compressed().astype("<u4").tobytes()


def decode_codes(words: bytes | memoryview | np.ndarray, rows: int, scales: np.ndarray) -> np.ndarray:
    """``[rows, cols]`` int32 codes from untrusted range-coded ``words`` (raw bytes or ``<u4``
    words) under ``scales [cols]`` (WireFormatError where no encoder could have made them)."""
    data = np.frombuffer(words, dtype="<u4") if not isinstance(words, np.ndarray) else words
    cols = int(np.asarray(scales).shape[0])
    if rows * cols == 0:
        if data.size:
            raise WireFormatError("coded coefficients of an empty tensor must be empty")
        return np.zeros((rows, cols), np.int32)
    means, per_code = _params(rows, scales)
    try:
        codes = constriction.stream.queue.RangeDecoder(data.astype(np.uint32)).decode(_MODEL, means, per_code)
    except (AssertionError, ValueError, RuntimeError) as exc:  # constriction's words-not-from-this-model error
        raise WireFormatError(f"coded coefficients do not decode: {exc}") from None
    return np.asarray(codes, np.int32).reshape(rows, cols)


def tensor_scale_codes(codes: np.ndarray) -> np.ndarray:
    """uint8 ``[cols]``: each column's own Laplace scale of integer ``codes [rows, cols]`` on the
    log grid ``scales_of`` reads (a tensor that left its basis's fitted spreads sends these)."""
    spread = np.maximum(np.mean(np.abs(np.asarray(codes, np.float64)), axis=0), MIN_SCALE)
    return np.clip(np.rint(SCALE_GRID_STEPS * np.log2(spread / MIN_SCALE)), 0, 255).astype(np.uint8)


def scales_of(scale_codes: np.ndarray) -> np.ndarray:
    """The Laplace scales, in steps, of uint8 ``scale_codes`` (``MIN_SCALE`` up to ~16k steps)."""
    return (MIN_SCALE * np.exp2(np.asarray(scale_codes, np.float64) / SCALE_GRID_STEPS)).astype(np.float32)


def fit_scales(coefficients: np.ndarray, step: float) -> np.ndarray:
    """Per-column Laplace scales, in steps, of ``coefficients [n, cols]`` (the maximum-likelihood
    scale: the mean absolute value; at least ``MIN_SCALE``)."""
    spread = np.mean(np.abs(np.asarray(coefficients, np.float64)), axis=0) / float(step)
    return np.maximum(spread, MIN_SCALE).astype(np.float32)
