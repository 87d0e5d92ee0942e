"""What RL needs from a chain of pipeline stages, and the in-process chain.

``StagePipeline`` is the whole contract between the RL code and the model: cached
decoding to next-token logits, keyed training forwards to last-stage token log-probs,
backward of a log-prob gradient down the chain, gradient norms, optimiser steps, and a
policy version per stage (stages may step at different times in a swarm). ``step`` takes
one gradient scale per stage, so each stage can be clipped on its own (the rule of
``engine.rl.update``). ``LocalPipeline`` chains ``StageBackend`` objects living in this
process (possibly of different backends); the swarm drives its stages by messages instead
(``engine.swarm.step_runner``), with the same update planner.
With an embedding tied across its first and last stage (``StageBackend.tied_names``),
``LocalPipeline`` sums the two copies' gradients once per step, before gradient norms,
``grads`` or ``step``, and installs the sum on both, so both copies stay identical
(Megatron's rule); the gradient norm counts that tensor once, and the two stages form one
clipping unit (``clip_units``) so that both copies are scaled alike.

What it does not know: transports, tasks, rewards, the objective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from backends.base import OptimizerConfig, StageBackend


@runtime_checkable
class StagePipeline(Protocol):
    """A chain of stages seen as one model. Synchronous; not thread-safe."""

    @property
    def num_stages(self) -> int: ...

    def next_token_logits(self, tokens: np.ndarray, cache_id: str, expand: np.ndarray | None = None,
                          keep: np.ndarray | None = None) -> np.ndarray:
        """Append ``tokens int64 [B, T]`` to cache ``cache_id``; logits ``[B, V]`` of the last position.

        ``expand`` (opening a cache only): ``tokens`` holds distinct rows, prefilled once, and the
        cache and the logits get ``len(expand)`` rows, row ``i`` a copy of ``tokens`` row ``expand[i]``
        (the samples of one prompt share its prefill). ``keep``: the cache first keeps only these
        rows (rows that finished), and ``tokens`` has one row for each."""

    def drop_cache(self, cache_id: str) -> None:
        """Free a cache on every stage (unknown ids are ignored)."""

    def token_logprobs(self, inputs: np.ndarray, targets: np.ndarray, *, key: str | None = None,
                       temperature: float = 1.0, segments: Sequence[Sequence[int] | None] | None = None
                       ) -> np.ndarray:
        """``log softmax(logits / temperature)`` at ``targets`` (``[B, T]``); with ``key``, keep the graph;
        ``segments``: packed rows (``backends.base.segment_layout``)."""

    def backward(self, key: str, grad_logprobs: np.ndarray) -> None:
        """Backpropagate ``dloss/dlogprobs`` of a keyed call through every stage (accumulating grads)."""

    def release(self, key: str) -> None:
        """Forget a keyed forward without backpropagating."""

    def grad_sq_norms(self) -> list[float]:
        """Squared L2 norm of the accumulated gradients, one per stage (a tied tensor counted once)."""

    def clip_units(self) -> list[tuple[int, ...]]:
        """The stages that clip together: each stage alone, except that the first and the last
        stage form one unit when they hold a tied tensor (both copies must scale alike)."""

    def grads(self) -> list[dict[str, np.ndarray]]:
        """Accumulated gradients of each stage (fp32 numpy, HF names; tied copies summed)."""

    def set_grads(self, grads: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Replace each stage's accumulated gradients (e.g. after replica aggregation)."""

    def zero_grad(self) -> None: ...

    def step(self, grad_scale: float | Sequence[float] = 1.0) -> None:
        """Scale gradients (one factor for all stages, or one per stage), optimiser step on every
        stage, bump every stage's version."""

    def versions(self) -> tuple[int, ...]:
        """Policy version of each stage (number of optimiser steps it has applied)."""

    def state_dicts(self) -> list[dict[str, np.ndarray]]:
        """Parameters of each stage (fp32 numpy, HF names)."""

    def set_weights(self, weights: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Overwrite each stage's parameters (versions are left alone)."""

    def set_versions(self, versions: Sequence[int]) -> None:
        """Declare the version of each stage (used when resuming)."""


def clip_units(num_stages: int, *, tied: bool) -> list[tuple[int, ...]]:
    """:meth:`StagePipeline.clip_units` for ``num_stages`` stages, with or without a tied
    first/last tensor (one implementation for the in-process pipeline and the swarm)."""
    if not tied or num_stages < 2:
        return [(i,) for i in range(num_stages)]
    return [(0, num_stages - 1)] + [(i,) for i in range(1, num_stages - 1)]


class LocalPipeline:
    """``StagePipeline`` over ``StageBackend`` objects in this process, stage 0 first."""

    def __init__(self, backends: Sequence[StageBackend], versions: Sequence[int] | None = None) -> None:
        if not backends:
            raise ValueError("a pipeline needs at least one stage")
        self.backends = list(backends)
        self._versions = list(versions) if versions is not None else [0] * len(self.backends)
        if len(self._versions) != len(self.backends):
            raise ValueError("one version per stage")
        first, last = self.backends[0], self.backends[-1]
        self._tied = [n for n in first.tied_names if n in last.tied_names] if len(self.backends) > 1 else []
        self._tied_pending = self._tied_summed = False  # per-stage tied gradients not yet summed / summed

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, num_stages: int = 1, backend: str = "auto",
                        device: str | None = None, optimizer: OptimizerConfig | None = None,
                        backend_per_stage: Sequence[str] | None = None) -> "LocalPipeline":
        """Load ``checkpoint_dir`` split into ``num_stages`` stages (one backend name each, or all ``backend``)."""
        from engine.model.checkpoint import Checkpoint
        from engine.model.loader import load_stage
        from engine.model.shard_plan import plan_stages

        checkpoint = Checkpoint(checkpoint_dir)
        specs = plan_stages(checkpoint.config.num_hidden_layers, num_stages)
        names = list(backend_per_stage) if backend_per_stage is not None else [backend] * num_stages
        if len(names) != num_stages:
            raise ValueError("one backend name per stage")
        return cls([load_stage(checkpoint, spec, names[i], device, optimizer) for i, spec in enumerate(specs)])

    @property
    def num_stages(self) -> int:
        return len(self.backends)

    def _run(self, inputs: np.ndarray, *, key: str | None = None, upto_last: bool = False,
             segments: Sequence[Sequence[int] | None] | None = None) -> np.ndarray:
        x = inputs
        stages = self.backends[:-1] if upto_last else self.backends
        for stage in stages:
            x = stage.forward(x, key=key, segments=segments)
        return x

    def next_token_logits(self, tokens: np.ndarray, cache_id: str, expand: np.ndarray | None = None,
                          keep: np.ndarray | None = None) -> np.ndarray:
        x = np.asarray(tokens, dtype=np.int64)
        for stage in self.backends:
            if keep is not None:
                stage.expand_cache(cache_id, keep)
            x = stage.forward(x, cache_id=cache_id, last_only=True)
            if expand is not None:
                stage.expand_cache(cache_id, expand)
        logits = x[:, -1, :]
        return logits if expand is None else logits[np.asarray(expand, dtype=np.int64)]

    def drop_cache(self, cache_id: str) -> None:
        for stage in self.backends:
            stage.drop_cache(cache_id)

    def token_logprobs(self, inputs: np.ndarray, targets: np.ndarray, *, key: str | None = None,
                       temperature: float = 1.0, segments: Sequence[Sequence[int] | None] | None = None
                       ) -> np.ndarray:
        inputs = np.asarray(inputs, dtype=np.int64)
        try:
            hidden = self._run(inputs, key=key, upto_last=True, segments=segments)
            return self.backends[-1].token_logprobs(hidden, np.asarray(targets, dtype=np.int64), key=key,
                                                    temperature=temperature, segments=segments)
        except Exception:
            if key is not None:
                self.release(key)
            raise

    def backward(self, key: str, grad_logprobs: np.ndarray) -> None:
        if self._tied_summed:
            raise ValueError("backward after the tied gradients were summed: call step or zero_grad first")
        grad = np.ascontiguousarray(grad_logprobs, dtype=np.float32)
        for stage in reversed(self.backends):
            grad = stage.backward(key, grad)
        self._tied_pending = bool(self._tied)

    def release(self, key: str) -> None:
        for stage in self.backends:
            stage.release(key)

    def _sum_tied_grads(self) -> None:
        """Install ``g_first + g_last`` of each tied tensor on both stages (once per step)."""
        if self._tied_pending:
            first, last = self.backends[0], self.backends[-1]
            a, b = first.grads(self._tied), last.grads(self._tied)
            total = {n: a[n] + b[n] for n in self._tied}
            first.set_grads(total)
            last.set_grads(total)
            self._tied_pending, self._tied_summed = False, True

    def grad_sq_norms(self) -> list[float]:
        return [float(sum(np.square(g, dtype=np.float64).sum() for n, g in grads.items()
                          if not (i and n in self._tied)))  # a tied tensor counts once, on stage 0
                for i, grads in enumerate(self.grads())]

    def clip_units(self) -> list[tuple[int, ...]]:
        return clip_units(self.num_stages, tied=bool(self._tied))

    def grads(self) -> list[dict[str, np.ndarray]]:
        self._sum_tied_grads()
        return [stage.grads() for stage in self.backends]

    def set_grads(self, grads: Sequence[Mapping[str, np.ndarray]]) -> None:
        if len(grads) != self.num_stages:
            raise ValueError("one gradient dict per stage")
        for stage, g in zip(self.backends, grads):
            stage.set_grads(g)
        self._tied_pending = False  # the caller installs final gradients

    def zero_grad(self) -> None:
        for stage in self.backends:
            stage.zero_grad()
        self._tied_pending = self._tied_summed = False

    def step(self, grad_scale: float | Sequence[float] = 1.0) -> None:
        scales = [float(grad_scale)] * self.num_stages if np.isscalar(grad_scale) else [float(s) for s in grad_scale]
        if len(scales) != self.num_stages:
            raise ValueError("one gradient scale per stage")
        if self._tied and scales[0] != scales[-1]:
            raise ValueError("stages holding a tied tensor must step with one scale (see clip_units)")
        self._sum_tied_grads()
        self._tied_summed = False
        for i, (stage, scale) in enumerate(zip(self.backends, scales)):
            stage.step(scale)
            self._versions[i] += 1

    def versions(self) -> tuple[int, ...]:
        return tuple(self._versions)

    def set_versions(self, versions: Sequence[int]) -> None:
        if len(versions) != self.num_stages:
            raise ValueError("one version per stage")
        self._versions = [int(v) for v in versions]

    def state_dicts(self) -> list[dict[str, np.ndarray]]:
        return [stage.state_dict() for stage in self.backends]

    def set_weights(self, weights: Sequence[Mapping[str, np.ndarray]]) -> None:
        if len(weights) != self.num_stages:
            raise ValueError("one weight dict per stage")
        for stage, w in zip(self.backends, weights):
            stage.set_weights(w)

    def close(self) -> None:
        for stage in self.backends:
            stage.close()
