"""Gradient exchange between replicas of one stage: compress, aggregate, identically everywhere.

Before each optimiser step every replica of a stage holds the gradient of its
own micro-batches (already token-normalised over the whole step, so the step's
gradient is the *sum* over replicas). Each replica compresses its gradient with
error feedback (the residual stays local and is sent in later steps) - int8 with
per-row scales (dense, ~1/4 of fp32) or top-k with int8 values (a few % of fp32) -
sends it to the others, and aggregates its *own decoded* contribution with the
ones it received. Because every replica aggregates the same decoded bytes in the
same order (sorted by peer id), all replicas compute the same aggregate and
their weights stay identical without ever sending weights.

Robustness: with three or more contributions, each is norm-clipped to
``clip_factor`` times the median contribution norm before summing, so one
faulty or hostile replica cannot dominate a step. (With two, nobody can tell
which one is wrong; the per-stage gradient-norm clip after aggregation bounds
the damage.)

It knows nothing about links, backends or what a stage is.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from engine.net.error_feedback import ErrorFeedback
from engine.net.tensor_codec import EncodedTensor, encode_tensor
from engine.swarm.run_config import UPDATE_ENCODINGS


def dense_nbytes(grads: Mapping[str, np.ndarray]) -> int:
    """Bytes of ``grads`` as dense fp32 (the baseline compression is measured against)."""
    return sum(int(np.asarray(g).size) * 4 for g in grads.values())


def global_norm(tensors: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.square(t, dtype=np.float64).sum()) for t in tensors.values())))


class ReplicaCompressor:
    """One replica's compression state (the error-feedback residuals live here).

    ``encoding``: ``"int8"`` (every entry, int8 with per-row scales), ``"topk"`` (the
    ``topk_fraction`` largest entries of gradient + residual, int8 values) or ``"fp32"``
    (dense, lossless, no residual).
    """

    def __init__(self, encoding: str = "int8", topk_fraction: float = 0.02) -> None:
        if encoding not in UPDATE_ENCODINGS:
            raise ValueError(f"update encoding must be one of {UPDATE_ENCODINGS}, not {encoding!r}")
        if not 0.0 < topk_fraction <= 1.0:
            raise ValueError("topk_fraction must be in (0, 1]")
        self.encoding = encoding
        self.topk_fraction = topk_fraction
        self._feedback = {"int8": lambda: ErrorFeedback("int8_rowwise"),
                          "topk": lambda: ErrorFeedback("topk", fraction=topk_fraction),
                          "fp32": lambda: None}[encoding]()

    def compress(self, grads: Mapping[str, np.ndarray]) -> tuple[dict[str, EncodedTensor], dict[str, np.ndarray]]:
        """``(encoded, own_decoded)``: what to send, and exactly what the receivers will decode."""
        encoded: dict[str, EncodedTensor] = {}
        decoded: dict[str, np.ndarray] = {}
        for name in sorted(grads):
            grad = np.asarray(grads[name], dtype=np.float32)
            if self._feedback is None:
                encoded[name], decoded[name] = encode_tensor(grad, "fp32"), grad.copy()
            else:
                encoded[name], decoded[name] = self._feedback.compress_with_decoded(name, grad)
        return encoded, decoded

    def residual_norm(self) -> float:
        return 0.0 if self._feedback is None else self._feedback.residual_norm()

    def reset(self) -> None:
        if self._feedback is not None:
            self._feedback.reset()


def aggregate(contributions: Mapping[str, Mapping[str, np.ndarray]], *, clip_factor: float = 2.0,
              robust_from: int = 3) -> dict[str, np.ndarray]:
    """Sum ``{peer_id: {name: grad}}`` in peer-id order; norm-clip outliers with ``robust_from``+ replicas.

    Every contribution must hold the same names. The result is a fresh dict of fp32 arrays.
    """
    if not contributions:
        raise ValueError("nothing to aggregate")
    peers = sorted(contributions)
    names = sorted(contributions[peers[0]])
    for peer in peers[1:]:
        if sorted(contributions[peer]) != names:
            raise ValueError(f"replica {peer} sent a different set of tensors")
    scales = {peer: 1.0 for peer in peers}
    if len(peers) >= robust_from:
        norms = {peer: global_norm(contributions[peer]) for peer in peers}
        cap = clip_factor * float(np.median(list(norms.values())))
        for peer in peers:
            if norms[peer] > cap > 0.0:
                scales[peer] = cap / norms[peer]
    out: dict[str, np.ndarray] = {}
    for name in names:
        total = np.zeros_like(np.asarray(contributions[peers[0]][name], dtype=np.float32))
        for peer in peers:
            total += np.float32(scales[peer]) * np.asarray(contributions[peer][name], dtype=np.float32)
        out[name] = total
    return out
