"""Turn scored groups into padded training arrays for keyed log-prob forwards.

A sample ``prompt_ids + completion_ids`` becomes one row: ``inputs = seq[:-1]``,
``targets = seq[1:]``, with the loss mask on the completion targets only (and, in a multi-turn
episode, only on the model's own tokens of it: ``Sample.loss_mask``; tool and template tokens
are context, never trained, and their behaviour log-probs are 0 and never enter a ratio). Rows are
right-padded (harmless under causal attention; padding carries no loss). Micro-batches
are row slices of one batch, so token-level normalisation uses the batch-wide count.

What it does not know: models, the objective's formula, rewards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.rl.rollout import Group


@dataclass
class TrainBatch:
    """Row-aligned arrays of one optimisation batch."""

    inputs: np.ndarray  #: int64 [B, L]
    targets: np.ndarray  #: int64 [B, L]
    mask: np.ndarray  #: bool [B, L], True on completion targets
    behaviour: np.ndarray  #: float32 [B, L], behaviour log-prob of each target (0 off the mask)
    advantages: np.ndarray  #: float32 [B]
    staleness: np.ndarray  #: int64 [B], versions behind the trainer (max over stages)

    @property
    def num_rows(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    def rows(self, start: int, stop: int) -> "TrainBatch":
        """A micro-batch of rows ``[start, stop)``, trimmed to its longest row."""
        sl = slice(start, stop)
        width = int(np.max(np.nonzero(self.mask[sl].any(axis=0))[0], initial=0)) + 1
        return TrainBatch(self.inputs[sl, :width], self.targets[sl, :width], self.mask[sl, :width],
                          self.behaviour[sl, :width], self.advantages[sl], self.staleness[sl])


def build_batch(groups: Sequence[Group], advantages: Sequence[np.ndarray], pad_id: int,
                trainer_versions: Sequence[int]) -> TrainBatch:
    """One row per sample of ``groups`` (advantages: one array of G values per group).

    Rows are sorted by length (longest first) so micro-batches carry little padding.
    """
    rows = []
    current = np.asarray(trainer_versions, dtype=np.int64)
    for group, adv in zip(groups, advantages):
        for sample, a in zip(group.samples, adv):
            seq = np.concatenate([group.prompt_ids, sample.completion_ids])
            stale = int(np.max(current - sample.oldest_versions())) if len(sample.completion_ids) else 0
            rows.append((seq, len(group.prompt_ids), sample.behaviour_logprobs, float(a), stale, sample.loss_mask))
    if not rows:
        raise ValueError("empty batch")
    rows.sort(key=lambda r: -len(r[0]))
    width = len(rows[0][0]) - 1
    n = len(rows)
    inputs = np.full((n, width), pad_id, dtype=np.int64)
    targets = np.full((n, width), pad_id, dtype=np.int64)
    mask = np.zeros((n, width), dtype=bool)
    behaviour = np.zeros((n, width), dtype=np.float32)
    for r, (seq, p, blp, _, _, own) in enumerate(rows):
        length = len(seq) - 1
        inputs[r, :length] = seq[:-1]
        targets[r, :length] = seq[1:]
        mask[r, p - 1:length] = True if own is None else np.asarray(own, dtype=bool)
        behaviour[r, p - 1:length] = np.where(mask[r, p - 1:length], blp, 0.0)
    advantages_arr = np.array([r[3] for r in rows], dtype=np.float32)
    staleness = np.array([r[4] for r in rows], dtype=np.int64)
    return TrainBatch(inputs, targets, mask, behaviour, advantages_arr, staleness)


def stack_batches(batches: Sequence[TrainBatch], pad_id: int) -> tuple[TrainBatch, list[int]]:
    """The rows of ``batches`` one after another in one batch (padded to the widest), and the
    first row of each batch in it (plus the total), so one forward pass can serve all of them."""
    if not batches:
        raise ValueError("nothing to stack")
    width = max(b.inputs.shape[1] for b in batches)

    def pad(a: np.ndarray, value) -> np.ndarray:
        return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=value)

    offsets = [0]
    for b in batches:
        offsets.append(offsets[-1] + b.num_rows)
    stacked = TrainBatch(np.concatenate([pad(b.inputs, pad_id) for b in batches]),
                         np.concatenate([pad(b.targets, pad_id) for b in batches]),
                         np.concatenate([pad(b.mask, False) for b in batches]),
                         np.concatenate([pad(b.behaviour, 0.0) for b in batches]),
                         np.concatenate([b.advantages for b in batches]),
                         np.concatenate([b.staleness for b in batches]))
    return stacked, offsets
