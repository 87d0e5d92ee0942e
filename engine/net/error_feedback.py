"""Error feedback for lossy update compression (top-k, quantisation).

A lossy encoder drops most of each update; error feedback remembers what was
dropped and adds it to the next update, so over many rounds everything is sent:

    acc        = grad + residual
    sent       = decode(encode(acc))
    residual'  = acc - sent

hence ``sum(sent over N rounds) == sum(grad over N rounds) - residual_N``.
One residual is kept per tensor name, in float32 like the gradients. With a
``decay`` below 1 the residual is multiplied by it first (``acc = grad + decay *
residual``): SparseLoCo's accumulator, which then also plays the role of momentum.

What this module does not know: where the encoded tensors go, how replicas
aggregate them, or which optimiser consumes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.net.tensor_codec import EncodedTensor, decode_tensor, encode_tensor


class ErrorFeedback:
    """Per-tensor residual memory around one lossy encoding (default: top 1 %, int8 values)."""

    def __init__(self, encoding: str = "topk", *, decay: float = 1.0, **params: Any) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        self.encoding = encoding
        self.decay = float(decay)
        self.params = dict(params) if params or encoding != "topk" else {"fraction": 0.01}
        self._residuals: dict[str, np.ndarray] = {}

    def compress(self, name: str, grad: np.ndarray) -> EncodedTensor:
        """Encode ``grad`` plus the carried residual of ``name``; keep the new residual."""
        return self.compress_with_decoded(name, grad)[0]

    def compress_with_decoded(self, name: str, grad: np.ndarray) -> tuple[EncodedTensor, np.ndarray]:
        """Like :meth:`compress`, also returning exactly what a receiver will decode."""
        grad = np.asarray(grad, dtype=np.float32)
        residual = self._residuals.get(name)
        if residual is not None and residual.shape != grad.shape:
            raise ValueError(f"{name}: shape {grad.shape} differs from the residual's {residual.shape}")
        if residual is None:
            acc = grad.copy()
        elif self.decay == 1.0:
            acc = grad + residual
        else:
            acc = grad + np.float32(self.decay) * residual
        encoded = encode_tensor(acc, self.encoding, **self.params)
        sent = decode_tensor(encoded.header, encoded.payload, max_elements=max(1, acc.size), expected_shape=acc.shape)
        self._residuals[name] = acc - sent
        return encoded, sent

    def residual(self, name: str) -> np.ndarray | None:
        """A copy of what ``name`` still owes (None before its first compress)."""
        residual = self._residuals.get(name)
        return None if residual is None else residual.copy()

    def residual_norm(self) -> float:
        """L2 norm over all residuals (how much has not been sent yet)."""
        return float(np.sqrt(sum(float(np.square(r, dtype=np.float64).sum())
                                 for r in self._residuals.values())))

    def reset(self, name: str | None = None) -> None:
        """Forget the residual of ``name`` (or all), e.g. after a resync."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)
