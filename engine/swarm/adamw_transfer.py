"""AdamW moments next to the weights in a ``weights`` message, for a trainer that joins or resyncs.

Every trainer of a stage applies the same aggregated gradient each step; its new weights are the
same as its siblings' only if its AdamW moments (``exp_avg``, ``exp_avg_sq``, the step count of
the bias correction) are the same too. A trainer that joined a stage which had already stepped,
or was resynced after a lost vote, used to receive the weights alone: it kept fresh (or stale)
moments, took a different step at the next ``apply``, lost that weight vote, was resynced with
weights alone again, and after three votes was evicted although it was honest. So a trainer asks
for the moments (``weights_req.optimizer_state``) and the replica answering sends them in the same
bundle as the weights, read together with them on its compute thread (nothing steps in between),
as three flat tensors (a header then names three tensors, not three per parameter: a LoRA stage
of SmolLM2 has hundreds of adapters, and one ``weights`` header is capped at 64 KB):

    adamw:exp_avg      fp32 [sum of parameter sizes]  every first moment, parameters in name order
    adamw:exp_avg_sq   fp32 [the same]                every second moment, the same order
    adamw:step         fp32 [number of parameters]    each parameter's AdamW step count

The moments are not covered by the majority's weights digest: a replica that sends bad ones harms
only the joiner's next step, which the next weight vote catches (and resyncs from another replica).
They are validated whole (shapes, finiteness, non-negative second moments, integer step counts)
before anything is installed. A bundle too large for one message (full fine-tuning of a large
stage) leaves them out; the joiner then starts with fresh moments and says so in its log.

DiLoCo replicas keep their inner moments local by design (``engine.swarm.outer_sync``) and do not
ask for them.

What it does not know: links, backends (moments are numpy arrays in ``backends.optimizer_state``'s
format), votes.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from backends.base import BackendError
from backends.optimizer_state import unpack
from engine.net.errors import ProtocolViolation

#: name prefix of the AdamW tensors carried next to the weights in a ``weights`` message
PREFIX = "adamw:"
_AVG, _SQ, _STEP = PREFIX + "exp_avg", PREFIX + "exp_avg_sq", PREFIX + "step"


def _sizes(weight_shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[str, tuple[int, ...], int]]:
    return [(n, tuple(s), int(np.prod(s, dtype=np.int64)) if s else 1) for n, s in sorted(weight_shapes.items())]


def expected_shapes(weight_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the moments of weights shaped ``weight_shapes`` in a bundle."""
    sizes = _sizes(weight_shapes)
    total = sum(size for _, _, size in sizes)
    return {_AVG: (total,), _SQ: (total,), _STEP: (len(sizes),)}


def attach(weights: Mapping[str, np.ndarray], moments: Mapping[str, np.ndarray],
           max_bytes: int) -> tuple[dict[str, np.ndarray], bool]:
    """``weights`` with ``moments`` (``backends.optimizer_state`` format, for these weights) added as
    the three flat tensors, and whether they were added: not when weights and moments together
    would exceed ``max_bytes`` (one message's payload; everything travels as fp32)."""
    bundle = dict(weights)
    sizes = _sizes({n: np.shape(a) for n, a in weights.items()})
    total = sum(size for _, _, size in sizes)
    if 4 * (3 * total + len(sizes)) > max_bytes:
        return bundle, False
    bundle[_AVG] = np.concatenate([np.ravel(moments[f"{n}.exp_avg"]) for n, _, _ in sizes]).astype(np.float32)
    bundle[_SQ] = np.concatenate([np.ravel(moments[f"{n}.exp_avg_sq"]) for n, _, _ in sizes]).astype(np.float32)
    bundle[_STEP] = np.array([float(moments[f"{n}.step"]) for n, _, _ in sizes], np.float32)
    return bundle, True


def split(received: Mapping[str, np.ndarray], weight_shapes: Mapping[str, tuple[int, ...]],
          sender: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """``(weights, moments)`` of a received bundle, moments in the ``backends.optimizer_state``
    format; None when none came along.

    Raises ``ProtocolViolation`` when some of the three tensors came but not all, or they are not
    a valid AdamW state for ``weight_shapes`` (checked here, before anything is installed)."""
    weights = {n: a for n, a in received.items() if not n.startswith(PREFIX)}
    flat = {n: a for n, a in received.items() if n.startswith(PREFIX)}
    if not flat:
        return weights, None
    if set(flat) != {_AVG, _SQ, _STEP}:
        raise ProtocolViolation(f"AdamW moments from {sender} refused: got {sorted(flat)}, "
                                f"expected {[_AVG, _SQ, _STEP]}")
    moments: dict[str, np.ndarray] = {}
    offset = 0
    for i, (name, shape, size) in enumerate(_sizes(weight_shapes)):
        moments[f"{name}.exp_avg"] = flat[_AVG][offset:offset + size].reshape(shape)
        moments[f"{name}.exp_avg_sq"] = flat[_SQ][offset:offset + size].reshape(shape)
        moments[f"{name}.step"] = np.asarray(flat[_STEP][i])
        offset += size
    try:
        unpack(moments, weight_shapes)  # the whole state, before anything is installed
    except BackendError as exc:
        raise ProtocolViolation(f"AdamW moments from {sender} refused: {exc}") from exc
    return weights, moments
