"""Running a chain of in-process stages: one forward pass and greedy KV-cached decoding.

The demo and ``polis bench shard`` use these to drive stages that live in this
process (possibly on different backends). Only the boundary format of
``backends.base`` crosses between stages. It knows nothing about networks or RL
(``engine.rl`` has its own pipeline abstraction for training).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from backends.base import StageBackend

_cache_ids = itertools.count()


def pipeline_forward(stages: Sequence[StageBackend], tokens: np.ndarray, *,
                     cache_id: str | None = None, last_only: bool = False) -> np.ndarray:
    """Token ids ``[B, T]`` through every stage in order; returns the last stage's logits
    (``[B, 1, V]``, the last position only, with ``last_only``)."""
    x = tokens
    for stage in stages:
        x = stage.forward(x, cache_id=cache_id, last_only=last_only)
    return x


def greedy_decode(stages: Sequence[StageBackend], prompt: np.ndarray, max_new_tokens: int,
                  eos_id: int | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """Greedy continuation of a batch of equal-length prompts ``[B, T]`` with KV caches.

    Returns ``(new_tokens [B, N], step_logits)`` where ``step_logits[i]`` is the
    ``[B, V]`` logits that chose token ``i``. Stops early once every row has
    produced ``eos_id``; rows that finished keep emitting ``eos_id``.
    """
    cache_id = f"greedy-{next(_cache_ids)}"
    batch = prompt.shape[0]
    done = np.zeros(batch, dtype=bool)
    new_tokens, step_logits = [], []
    try:
        logits = pipeline_forward(stages, prompt, cache_id=cache_id, last_only=True)[:, -1]
        for _ in range(max_new_tokens):
            step_logits.append(logits)
            token = logits.argmax(axis=-1).astype(np.int64)
            if eos_id is not None:
                token = np.where(done, eos_id, token)
                done |= token == eos_id
            new_tokens.append(token)
            if done.all() or len(new_tokens) == max_new_tokens:
                break
            logits = pipeline_forward(stages, token[:, None], cache_id=cache_id, last_only=True)[:, -1]
    finally:
        for stage in stages:
            stage.drop_cache(cache_id)
    return np.stack(new_tokens, axis=1) if new_tokens else np.zeros((batch, 0), np.int64), step_logits
