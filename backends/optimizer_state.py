"""AdamW state at the backend boundary: one format every backend exports and loads.

For each parameter (Hugging Face name ``<name>``) three fp32 numpy arrays:

* ``<name>.exp_avg`` — first moment, the parameter's shape;
* ``<name>.exp_avg_sq`` — second moment, the parameter's shape, ``>= 0``;
* ``<name>.step`` — a scalar (shape ``()``): the number of AdamW steps applied to it,
  which drives the bias correction ``1 - beta**step``.

A parameter that has never been stepped exports zeros and step 0, which every backend
treats exactly like a fresh optimiser. AdamW with bias correction is the same update on
every backend (``backends.base.OptimizerConfig``), so a state exported by one loads into
another. Hyper-parameters (learning rate, betas, ...) are not part of the state: they come
from the ``OptimizerConfig`` the stage was loaded with.

``unpack`` validates a whole state before a backend applies any of it, so a refused state
leaves the backend unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from backends.base import BackendError

SUFFIXES = ("exp_avg", "exp_avg_sq", "step")
#: largest step count accepted (fp32 holds every integer up to 2**24 exactly)
MAX_STEP = 2 ** 24


@dataclass(frozen=True)
class AdamWMoments:
    """The AdamW state of one parameter (fp32 numpy moments, integer step)."""

    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray
    step: int


def pack(moments: Mapping[str, AdamWMoments]) -> dict[str, np.ndarray]:
    """The boundary format of ``moments`` (HF name -> moments)."""
    out: dict[str, np.ndarray] = {}
    for name, m in moments.items():
        out[f"{name}.exp_avg"] = np.ascontiguousarray(m.exp_avg, dtype=np.float32)
        out[f"{name}.exp_avg_sq"] = np.ascontiguousarray(m.exp_avg_sq, dtype=np.float32)
        out[f"{name}.step"] = np.asarray(float(m.step), dtype=np.float32)
    return out


def _listed(names: set[str], limit: int = 4) -> str:
    shown = sorted(names)[:limit]
    return ", ".join(shown) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _floats(key: str, value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
        raise BackendError(f"optimizer state: '{key}' must be floating point, got dtype {array.dtype}")
    if tuple(array.shape) != tuple(shape):
        raise BackendError(f"optimizer state: '{key}' has shape {list(array.shape)}, expected {list(shape)}")
    array = np.array(array, dtype=np.float32)  # an owned copy: later changes by the caller do not leak in
    if not np.isfinite(array).all():
        raise BackendError(f"optimizer state: '{key}' holds non-finite values")
    return array


def _step(key: str, value: np.ndarray) -> int:
    array = np.asarray(value)
    if array.size != 1 or array.dtype.kind not in "fiu":
        raise BackendError(f"optimizer state: '{key}' must be one number, got {array.dtype} {list(array.shape)}")
    step = float(array.reshape(()))
    if not (np.isfinite(step) and step >= 0 and step == int(step) and step <= MAX_STEP):
        raise BackendError(f"optimizer state: '{key}' = {step!r} is not a step count in [0, {MAX_STEP}]")
    return int(step)


def unpack(state: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, AdamWMoments]:
    """Validate ``state`` against the stage's parameter ``shapes``; return HF name -> moments.

    Raises ``BackendError`` on unknown or missing keys, wrong shapes or dtypes, non-finite
    values, a negative second moment or a step that is not a non-negative integer.
    """
    expected = {f"{name}.{suffix}" for name in shapes for suffix in SUFFIXES}
    keys = set(state)
    if keys != expected:
        problems = []
        if expected - keys:
            problems.append(f"missing {_listed(expected - keys)}")
        if keys - expected:
            problems.append(f"unknown {_listed(keys - expected)}")
        raise BackendError(f"optimizer state does not match this stage's parameters: {'; '.join(problems)}")
    out: dict[str, AdamWMoments] = {}
    for name, shape in shapes.items():
        exp_avg = _floats(f"{name}.exp_avg", state[f"{name}.exp_avg"], shape)
        exp_avg_sq = _floats(f"{name}.exp_avg_sq", state[f"{name}.exp_avg_sq"], shape)
        if (exp_avg_sq < 0).any():
            raise BackendError(f"optimizer state: '{name}.exp_avg_sq' holds negative values")
        out[name] = AdamWMoments(exp_avg, exp_avg_sq, _step(f"{name}.step", state[f"{name}.step"]))
    return out
