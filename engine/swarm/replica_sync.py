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

Robustness (:func:`aggregate`): non-finite contributions are skipped; each
contribution is norm-clipped (to ``clip_factor`` times the median norm, or the
smaller norm with two replicas); with three or more, centred clipping around the
coordinate-wise median keeps one hostile replica (x10, sign-flipped, noise) from
steering the step; float64 throughout. What it cannot do: out-vote a colluding
majority of a stage, or tell which of two replicas is honest (it only bounds the
liar's weight to ``clip_factor`` times the other's norm).

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
    ``topk_fraction`` largest entries of gradient + residual, ``value_bits`` per value; with a
    fraction of 1.0 every entry, without indices: a dense low-bit quantiser; ``value_scale``
    picks its block scales, ``engine.net.codec_topk``) or ``"fp32"`` (dense, lossless, no
    residual). ``error_decay``: the residual's decay before it is added to the next update
    (``engine.net.error_feedback``).
    """

    def __init__(self, encoding: str = "int8", topk_fraction: float = 0.02, *, value_bits: int = 8,
                 value_scale: str = "absmax", error_decay: float = 1.0) -> None:
        if encoding not in UPDATE_ENCODINGS:
            raise ValueError(f"update encoding must be one of {UPDATE_ENCODINGS}, not {encoding!r}")
        if not 0.0 < topk_fraction <= 1.0:
            raise ValueError("topk_fraction must be in (0, 1]")
        self.encoding = encoding
        self.topk_fraction = topk_fraction
        self._feedback = {"int8": lambda: ErrorFeedback("int8_rowwise", decay=error_decay),
                          "topk": lambda: ErrorFeedback("topk", decay=error_decay, fraction=topk_fraction,
                                                        value_bits=value_bits, scale_rule=value_scale,
                                                        # every entry: no indices
                                                        index_coding="all" if topk_fraction == 1.0
                                                        else "varint_delta"),
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
              centre_factor: float = 1.0, robust_from: int = 3,
              shares: Mapping[str, float] | None = None) -> dict[str, np.ndarray]:
    """The step's gradient from ``{peer_id: {name: grad}}``, robust to a minority of bad replicas.

    In float64, in peer-id order (every replica computes the same bytes):

    1. a contribution with any non-finite entry is skipped;
    2. every contribution is norm-clipped to ``clip_factor`` times a reference norm: the median
       norm with ``robust_from`` or more contributions, the smaller one with two (so a x10 share
       counts at most x``clip_factor``, even where nobody can tell which replica is wrong);
    3. with ``robust_from`` or more, centred clipping: around the coordinate-wise median, each
       contribution's deviation is clipped to ``centre_factor`` times the median deviation, and the
       step is the mean of the clipped contributions times the number of replicas (the sum an
       all-honest stage would give); with fewer it is the plain sum of the clipped ones.

    ``shares`` (the coordinator's ``apply``: each replica's fraction of the step's tokens, when the
    micro-batches were shared unequally, slow trainers getting fewer rows) makes it the weighted rule:
    each contribution is divided by its share first (an estimate of the whole step's gradient, so
    replicas with unequal rows are compared like with like in 2. and 3.), and the step is the
    share-weighted sum of the clipped estimates (3.: the centre plus the share-weighted mean of the
    clipped deviations). Honest replicas, nothing clipped: exactly the plain sum. A replica with no
    share (it trained nothing) is left out. Without ``shares`` every replica weighs the same.

    Every contribution must hold the same names. Returns fp32 arrays; an aggregate past the fp32
    range (colluders sending 3e38 each) comes back as inf, and no usable contribution at all as
    NaN, which the stage's ``apply`` (``engine.swarm.stage_runtime``) skips, keeping its weights.
    """
    if not contributions:
        raise ValueError("nothing to aggregate")
    peers = sorted(contributions)
    names = sorted(contributions[peers[0]])
    for peer in peers[1:]:
        if sorted(contributions[peer]) != names:
            raise ValueError(f"replica {peer} sent a different set of tensors")
    shapes = {name: np.shape(contributions[peers[0]][name]) for name in names}
    good = [p for p in peers if all(np.isfinite(contributions[p][n]).all() for n in names)]
    if shares is not None:
        good = [p for p in good if shares.get(p, 0.0) > 0]
    if not good:
        return {name: np.full(shapes[name], np.nan, dtype=np.float32) for name in names}
    # without shares every replica weighs 1/N: the clipped contributions' sum, or N x their robust mean
    weights = {p: float(shares[p]) for p in good} if shares is not None else {p: 1.0 / len(peers) for p in good}
    return _weighted(contributions, good, names, shapes, weights, clip_factor, centre_factor, robust_from)


def _weighted(contributions: Mapping[str, Mapping[str, np.ndarray]], good: list[str], names: list[str],
              shapes: dict, shares: dict[str, float], clip_factor: float, centre_factor: float,
              robust_from: int) -> dict[str, np.ndarray]:
    """:func:`aggregate` by shares (see there): clip the per-share estimates, weigh by share."""
    est = {p: {n: np.asarray(contributions[p][n], dtype=np.float64) / shares[p] for n in names} for p in good}
    norms = {p: global_norm(est[p]) for p in good}
    robust = len(good) >= robust_from
    cap = clip_factor * (float(np.median(list(norms.values()))) if robust else min(norms.values()))
    scale = {p: cap / norms[p] if norms[p] > cap else 1.0 for p in good}
    out: dict[str, np.ndarray] = {}
    if not robust:
        for name in names:
            total = np.zeros(shapes[name], dtype=np.float64)
            for p in good:
                total += shares[p] * scale[p] * est[p][name]
            out[name] = _to_fp32(total)
        return out
    centre = {n: np.median(np.stack([scale[p] * est[p][n] for p in good]), axis=0) for n in names}
    deviation = {p: float(np.sqrt(sum(float(np.square(scale[p] * est[p][n] - centre[n]).sum()) for n in names)))
                 for p in good}
    tau = centre_factor * float(np.median(list(deviation.values())))
    pull = {p: tau / deviation[p] if deviation[p] > tau else 1.0 for p in good}
    weight = sum(shares.values())
    for name in names:
        moved = np.zeros(shapes[name], dtype=np.float64)
        for p in good:
            moved += shares[p] * pull[p] * (scale[p] * est[p][name] - centre[name])
        out[name] = _to_fp32(centre[name] + moved / weight)
    return out


def _to_fp32(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # past the fp32 range -> inf, which apply skips
        return values.astype(np.float32)
