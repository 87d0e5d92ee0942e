"""DiLoCo / SparseLoCo between the replicas of a stage: pseudo-gradients and the outer step.

With ``replica_sync.mode = "diloco"`` (``engine.swarm.run_config.ReplicaSyncSettings``) each
replica takes H inner AdamW steps on its own micro-batches, then the replicas sync once:

    delta_r   = anchor - weights_r            (the pseudo-gradient: how far replica r moved)
    sent_r    = Q(topk(delta_r + decay * e_r)),  e_r <- what Q(topk(.)) left out (error feedback)
    mean      = aggregate({r: sent_r}) / R     (``engine.swarm.replica_sync.aggregate``: non-finite
                                                shares skipped, norm clipping, centred clipping
                                                with 3 or more; float64, peer-id order)
    m         = mu * m + mean;  step = mean + mu * m   (Nesterov; mu = 0: step = mean)
    anchor    = weights_r = anchor - outer_lr * step

Every replica starts a round from the same ``anchor``, aggregates the same decoded bytes
(its own share as the receivers decode it) in the same order and holds the same momentum,
so after the outer step every replica holds the same bits (the coordinator checks their
checksums at those versions only). The error-feedback residual ``e_r`` and the AdamW moments
stay local, as in DiLoCo and SparseLoCo (there the decayed residual replaces outer momentum,
so ``outer_momentum`` defaults to 0). A non-finite mean (poisoned shares that survived the
finite check, an overflow) is not applied: every replica goes back to the anchor alike.

What it does not know: links, messages, backends; weights come and go as numpy arrays.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from engine.net.tensor_codec import EncodedTensor
from engine.swarm.replica_sync import ReplicaCompressor
from engine.swarm.run_config import ReplicaSyncSettings

#: name prefix of the outer-momentum tensors carried next to the anchor in a ``weights`` message
MOMENTUM_PREFIX = "outer_momentum:"


class OuterSync:
    """One replica's DiLoCo state: the weights at the last sync, outer momentum, the residual."""

    def __init__(self, settings: ReplicaSyncSettings, anchor: Mapping[str, np.ndarray],
                 momentum: Mapping[str, np.ndarray] | None = None) -> None:
        if settings.mode != "diloco":
            raise ValueError("OuterSync is for replica_sync.mode = diloco")
        self.settings = settings
        self.anchor = {n: np.array(a, dtype=np.float32, copy=True) for n, a in anchor.items()}
        self.momentum = {n: np.array(m, dtype=np.float32, copy=True) for n, m in (momentum or {}).items()}
        unknown = sorted(set(self.momentum) - set(self.anchor))
        if unknown:
            raise ValueError(f"outer momentum for tensors the stage does not hold: {unknown[:3]}")
        self.compressor = ReplicaCompressor(settings.encoding, settings.topk_fraction,
                                            value_bits=settings.value_bits, value_scale=settings.value_scale,
                                            error_decay=settings.error_decay)

    def pseudo_gradient(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``anchor - weights`` per tensor (float32): the direction the inner steps moved against."""
        if sorted(weights) != sorted(self.anchor):
            raise ValueError("the stage's tensors differ from the ones at the last sync")
        return {n: self.anchor[n] - np.asarray(weights[n], dtype=np.float32) for n in sorted(self.anchor)}

    def compress(self, weights: Mapping[str, np.ndarray]) -> tuple[dict[str, EncodedTensor], dict[str, np.ndarray]]:
        """``(encoded, own_decoded)`` of this replica's pseudo-gradient, with error feedback."""
        return self.compressor.compress(self.pseudo_gradient(weights))

    def outer_step(self, aggregated: Mapping[str, np.ndarray], contributors: int) -> dict[str, np.ndarray]:
        """Apply the outer step for the aggregate of ``contributors`` shares; returns the new
        weights (also the new anchor). A non-finite aggregate leaves the anchor as it is."""
        if contributors < 1:
            raise ValueError("an outer step needs at least one contribution")
        mean = {n: np.asarray(aggregated[n], dtype=np.float64) / contributors for n in sorted(self.anchor)}
        if not all(np.isfinite(m).all() for m in mean.values()):
            return self.weights()
        mu, lr = float(self.settings.outer_momentum), float(self.settings.outer_lr)
        for name, delta in mean.items():
            if mu > 0.0:
                previous = self.momentum.get(name)
                m = delta if previous is None else mu * previous.astype(np.float64) + delta
                self.momentum[name] = m.astype(np.float32)
                step = delta + mu * self.momentum[name].astype(np.float64)
            else:
                step = delta
            self.anchor[name] = (self.anchor[name].astype(np.float64) - lr * step).astype(np.float32)
        return self.weights()

    def weights(self) -> dict[str, np.ndarray]:
        """A copy of the anchor: the weights every replica holds right after a sync."""
        return {n: a.copy() for n, a in self.anchor.items()}

    def momentum_state(self) -> dict[str, np.ndarray]:
        """A copy of the outer momentum (empty before the first outer step, or with mu = 0)."""
        return {n: m.copy() for n, m in self.momentum.items()}

    def residual_norm(self) -> float:
        return self.compressor.residual_norm()


def split_momentum(tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(weights, momentum)`` of a ``weights`` bundle that may carry ``MOMENTUM_PREFIX`` tensors."""
    weights = {n: t for n, t in tensors.items() if not n.startswith(MOMENTUM_PREFIX)}
    momentum = {n[len(MOMENTUM_PREFIX):]: t for n, t in tensors.items() if n.startswith(MOMENTUM_PREFIX)}
    return weights, momentum


def scale_grads(grads: Mapping[str, np.ndarray], replicas: float) -> dict[str, np.ndarray]:
    """An inner step's gradient: this replica's share of the step (token-normalised over the
    whole step) times the number of replicas (or 1 / its token share, where the shares were
    unequal), an unbiased estimate of the step's gradient."""
    factor = np.float32(max(1.0, float(replicas)))
    return {n: np.asarray(g, dtype=np.float32) * factor for n, g in grads.items()}

