"""A stage whose boundary tensors go through the wire encoding, as between two nodes, and what that costs.

``EncodedBoundary`` wraps a ``StageBackend`` living in this process: the activations it
hands to the next stage and the input gradient it hands back to the previous one are
encoded with a run's ``activation_encoding`` (``engine.swarm.boundary_basis.BoundaryCodec``, what
a node uses; a ``basis`` scheme fits its bases from the first tensors, as a node does),
decoded again (with the checks a receiving node applies) and metered: bytes on the wire, bytes
as dense float32, and the squared error against the exact tensor. So ``polis bench act`` can
chain stages with ``LocalPipeline`` or ``greedy_decode`` and measure a scheme's accuracy,
learning and bytes without processes or links.

What it does not know: tasks, RL training, which scheme is good.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from backends.base import StageBackend
from engine.net.codec_predictor import TokenTable
from engine.swarm.boundary_basis import BoundaryCodec, tokens_of
from engine.swarm.pipeline_hops import scheme_of
from engine.swarm.stage_loading import load_token_table


@dataclass
class BoundaryMeter:
    """Totals over every tensor of one kind (``act`` or ``grad``) that crossed the boundary."""

    tensors: int = 0
    rows: int = 0
    wire_bytes: int = 0
    fp32_bytes: int = 0
    err_sq: float = 0.0
    ref_sq: float = 0.0

    def add(self, exact: np.ndarray, decoded: np.ndarray, header: dict, payload: bytes) -> None:
        self.tensors += 1
        self.rows += int(np.prod(exact.shape[:-1]))
        self.wire_bytes += len(msgpack.packb(header)) + len(payload)
        self.fp32_bytes += 4 * exact.size
        diff = decoded.astype(np.float64) - exact.astype(np.float64)
        self.err_sq += float(np.sum(diff * diff))
        self.ref_sq += float(np.sum(exact.astype(np.float64) ** 2))

    def merge(self, other: "BoundaryMeter") -> None:
        """Add ``other``'s totals to ours."""
        self.tensors += other.tensors
        self.rows += other.rows
        self.wire_bytes += other.wire_bytes
        self.fp32_bytes += other.fp32_bytes
        self.err_sq += other.err_sq
        self.ref_sq += other.ref_sq

    def summary(self) -> dict[str, Any]:
        """JSON-able totals: ratio vs float32 and the relative (Frobenius) error."""
        return {"tensors": self.tensors, "rows": self.rows, "wire_bytes": self.wire_bytes,
                "fp32_bytes": self.fp32_bytes,
                "x_fewer_than_fp32": round(self.fp32_bytes / self.wire_bytes, 2) if self.wire_bytes else None,
                "relative_error": round((self.err_sq / self.ref_sq) ** 0.5, 5) if self.ref_sq else None}


class EncodedBoundary:
    """``inner`` with its outgoing activations and gradients sent through ``encoding`` and back."""

    def __init__(self, inner: StageBackend, encoding: str, codec: BoundaryCodec | None = None) -> None:
        scheme_of(encoding)  # unknown names fail here, not on the first tensor
        self._inner = inner
        self.encoding = encoding
        self.codec = codec or BoundaryCodec()  # this stage's node: sends its tensors, receives its neighbours'
        self.upstream: EncodedBoundary | None = None  # the neighbours' nodes (wrap_stages links them); alone,
        self.downstream: EncodedBoundary | None = None  # this codec plays both ends of the boundary
        self.meters = {"act": BoundaryMeter(), "grad": BoundaryMeter()}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _cross(self, kind: str, exact: np.ndarray, tokens: np.ndarray | None = None) -> np.ndarray:
        index = self._inner.spec.stage_index
        neighbour = self.downstream if kind == "act" else self.upstream
        peer = f"stage{index + 1}" if kind == "act" else f"stage{index - 1}"
        header, payload = self.codec.encode(kind, exact, self.encoding, peer, index, tokens=tokens)
        receiver = self.codec if neighbour is None else neighbour.codec
        decoded = receiver.decode(header, payload, exact.shape[-1], sender=f"stage{index}")
        self.codec.sent(peer, header)
        self.meters[kind].add(exact, decoded, header, payload)
        return decoded

    def forward(self, inputs: np.ndarray, *, cache_id: str | None = None, key: str | None = None,
                last_only: bool = False, segments=None) -> np.ndarray:
        out = self._inner.forward(inputs, cache_id=cache_id, key=key, last_only=last_only, segments=segments)
        return out if self._inner.spec.is_last else self._cross("act", out, tokens_of(inputs, out))

    def token_logprobs(self, inputs: np.ndarray, targets: np.ndarray, *, key: str | None = None,
                       temperature: float = 1.0, segments=None) -> np.ndarray:
        return self._inner.token_logprobs(inputs, targets, key=key, temperature=temperature, segments=segments)

    def backward(self, key: str, grad_output: np.ndarray) -> np.ndarray | None:
        grad = self._inner.backward(key, grad_output)
        return None if grad is None else self._cross("grad", grad)

    def reset_meters(self) -> None:
        self.meters = {"act": BoundaryMeter(), "grad": BoundaryMeter()}


def wrap_stages(stages: list[StageBackend], encoding: str,
                token_table: TokenTable | None = None) -> list[EncodedBoundary]:
    """Every stage of a chain wrapped (the last one's logits and the first one's token ids stay
    exact); ``token_table``: what every node holds for a token-predicted scheme."""
    chain = [EncodedBoundary(stage, encoding, BoundaryCodec(token_table=token_table)) for stage in stages]
    for upstream, downstream in zip(chain, chain[1:]):  # one node per stage: each decodes what its neighbour sends
        upstream.downstream, downstream.upstream = downstream, upstream
    return chain


def token_table_for(encoding: str, model: Path) -> TokenTable | None:
    """``model``'s input embeddings when ``encoding`` predicts rows from their tokens (else None, nothing read)."""
    return load_token_table(model) if scheme_of(encoding).params.get("predict") else None


def totals(stages: list[EncodedBoundary], kind: str) -> dict[str, Any]:
    """One kind's meters summed over the chain."""
    total = BoundaryMeter()
    for stage in stages:
        total.merge(stage.meters[kind])
    return total.summary()


def signed_micro_batches(sequences: list[list[int]], prompt_lens: list[int], rows: int, pad_id: int):
    """Right-padded ``(inputs, targets, grad_logprobs)`` micro-batches: +-1 advantages on completion tokens."""
    for start in range(0, len(sequences), rows):
        chunk = list(range(start, min(start + rows, len(sequences))))
        width = max(len(sequences[i]) for i in chunk) - 1
        inputs = np.full((len(chunk), width), pad_id, np.int64)
        targets = np.full((len(chunk), width), pad_id, np.int64)
        grad = np.zeros((len(chunk), width), np.float32)
        for row, i in enumerate(chunk):
            seq = sequences[i]
            inputs[row, :len(seq) - 1] = seq[:-1]
            targets[row, :len(seq) - 1] = seq[1:]
            grad[row, prompt_lens[i] - 1:len(seq) - 1] = 1.0 if i % 2 == 0 else -1.0
        count = max(1.0, float(np.abs(grad).sum()))
        yield inputs, targets, grad / count


def gradient_pass(stages, sequences, prompt_lens, rows: int, pad_id: int) -> dict[str, np.ndarray]:
    """One forward and backward pass of fixed ``sequences`` (+-1 advantages, :func:`signed_micro_batches`)
    through ``stages``: the first stage's gradients, zeroed again after (no weight moves). Through
    wrapped stages it is also what fits a ``basis`` scheme's bases before anything is measured."""
    from engine.rl.pipeline import LocalPipeline

    pipeline = LocalPipeline(stages)
    pipeline.zero_grad()
    for n, (inputs, targets, grad) in enumerate(signed_micro_batches(sequences, prompt_lens, rows, pad_id)):
        pipeline.token_logprobs(inputs, targets, key=f"act-bench-{n}")
        pipeline.backward(f"act-bench-{n}", grad)
    grads = stages[0].grads()
    pipeline.zero_grad()
    return grads
