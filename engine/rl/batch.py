"""Turn scored groups into padded training arrays for keyed log-prob forwards.

A sample ``prompt_ids + completion_ids`` becomes one row: ``inputs = seq[:-1]``,
``targets = seq[1:]``, with the loss mask on the completion targets only (and, in a multi-turn
episode, only on the model's own tokens of it: ``Sample.loss_mask``; tool and template tokens
are context, never trained, and their behaviour log-probs are 0 and never enter a ratio). Rows are
right-padded (harmless under causal attention; padding carries no loss). Micro-batches
are row slices of one batch, so token-level normalisation uses the batch-wide count.

With ``pack`` a group becomes one *packed* row instead of G: its prompt once (all but its last
token), then per sample the prompt's last token and the completion but its last token, each
completion a segment that attends to the prompt and to itself only (``backends.base.segment_layout``;
``TrainBatch.segments`` says where they lie). The targets, mask and behaviour log-probs of every
completion token are those of its plain row; the prompt's are never trained. A real model's prompt
is most of a sample's tokens (SmolLM2's chat prompt ~94 of ~120), so G samples cost about one
prompt instead of G. Advantages are then per token (``[B, L]``); without packing, one per row.

What it does not know: models, the objective's formula, rewards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.rl.rollout import Group

#: a row's samples: (the group's index in the build, the indices of its samples in the group)
RowSource = tuple[int, tuple[int, ...]]


@dataclass
class TrainBatch:
    """Row-aligned arrays of one optimisation batch."""

    inputs: np.ndarray  #: int64 [B, L]
    targets: np.ndarray  #: int64 [B, L]
    mask: np.ndarray  #: bool [B, L], True on completion targets
    behaviour: np.ndarray  #: float32 [B, L], behaviour log-prob of each target (0 off the mask)
    advantages: np.ndarray  #: float32 [B] (one per row), or [B, L] (per token, when rows are packed)
    staleness: np.ndarray  #: int64 [B], versions behind the trainer (max over stages and the row's samples)
    #: per row its packed layout ``(prefix_len, n_1, ..., n_G)``, or None for a plain row; None: all plain
    segments: list[tuple[int, ...] | None] | None = None
    #: per row, where its samples came from (``build_batch`` sets it; None: unknown)
    sources: list[RowSource] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def num_samples(self) -> int:
        """Samples the rows hold (a packed row holds its group's)."""
        return sum(self.samples_in_row(r) for r in range(self.num_rows))

    def samples_in_row(self, r: int) -> int:
        """Samples row ``r`` holds (a packed row: its group's)."""
        seg = None if self.segments is None else self.segments[r]
        return 1 if seg is None else len(seg) - 1

    def rows_for_samples(self, samples: int) -> int:
        """Rows of this batch that hold about ``samples`` samples (at least one): micro-batch sizes
        are set in samples, whether rows are plain or packed."""
        return max(1, round(samples * self.num_rows / max(self.num_samples, 1)))

    def rows(self, start: int, stop: int) -> "TrainBatch":
        """A micro-batch of rows ``[start, stop)``, trimmed to its longest row."""
        sl = slice(start, stop)
        width = int(np.max(np.nonzero(self.mask[sl].any(axis=0))[0], initial=0)) + 1
        if self.segments is not None:
            width = max([width] + [sum(seg) for seg in self.segments[sl] if seg is not None])
        adv = self.advantages[sl] if self.advantages.ndim == 1 else self.advantages[sl, :width]
        return TrainBatch(self.inputs[sl, :width], self.targets[sl, :width], self.mask[sl, :width],
                          self.behaviour[sl, :width], adv, self.staleness[sl],
                          None if self.segments is None else self.segments[sl],
                          None if self.sources is None else self.sources[sl])

    def take(self, order: Sequence[int] | np.ndarray) -> "TrainBatch":
        """The rows of this batch in ``order``."""
        order = np.asarray(order, dtype=np.int64)
        return TrainBatch(self.inputs[order], self.targets[order], self.mask[order], self.behaviour[order],
                          self.advantages[order], self.staleness[order],
                          None if self.segments is None else [self.segments[i] for i in order],
                          None if self.sources is None else [self.sources[i] for i in order])

    def segment_list(self) -> list[list[int] | None] | None:
        """``segments`` as plain lists (for a wire message), or None when every row is plain."""
        if self.segments is None or all(seg is None for seg in self.segments):
            return None
        return [None if seg is None else [int(v) for v in seg] for seg in self.segments]


@dataclass
class _Row:
    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    behaviour: np.ndarray
    advantages: np.ndarray  #: per token
    staleness: int
    segments: tuple[int, ...] | None
    source: RowSource


def _own_mask(sample, n: int) -> np.ndarray:
    return np.ones(n, dtype=bool) if sample.loss_mask is None else np.asarray(sample.loss_mask, dtype=bool)


def _plain_row(group: Group, s: int, adv: float, stale: int, g: int) -> _Row:
    sample = group.samples[s]
    seq = np.concatenate([group.prompt_ids, sample.completion_ids])
    p, length = len(group.prompt_ids), len(seq) - 1
    mask = np.zeros(length, dtype=bool)
    behaviour = np.zeros(length, dtype=np.float32)
    mask[p - 1:] = _own_mask(sample, length - p + 1)
    behaviour[p - 1:] = np.where(mask[p - 1:], sample.behaviour_logprobs, 0.0)
    return _Row(seq[:-1], seq[1:], mask, behaviour, np.full(length, adv, np.float32), stale, None, (g, (s,)))


def _packed_row(group: Group, adv: np.ndarray, stale: list[int], g: int) -> _Row:
    prompt = group.prompt_ids
    inputs, targets = [prompt[:-1]], [prompt[1:]]
    mask, behaviour, advantages = [np.zeros(len(prompt) - 1, bool)], [np.zeros(len(prompt) - 1, np.float32)], \
        [np.zeros(len(prompt) - 1, np.float32)]
    for sample, a in zip(group.samples, adv):
        c = sample.completion_ids
        own = _own_mask(sample, len(c))
        inputs.append(np.concatenate([prompt[-1:], c[:-1]]))
        targets.append(c)
        mask.append(own)
        behaviour.append(np.where(own, sample.behaviour_logprobs, 0.0).astype(np.float32))
        advantages.append(np.full(len(c), a, np.float32))
    segments = (len(prompt) - 1, *(len(s.completion_ids) for s in group.samples))
    return _Row(np.concatenate(inputs), np.concatenate(targets), np.concatenate(mask), np.concatenate(behaviour),
                np.concatenate(advantages), max(stale), segments, (g, tuple(range(len(group.samples)))))


def _packable(group: Group) -> bool:
    return len(group.samples) > 1 and len(group.prompt_ids) >= 1 and \
        all(len(s.completion_ids) >= 1 for s in group.samples)


def build_batch(groups: Sequence[Group], advantages: Sequence[np.ndarray], pad_id: int,
                trainer_versions: Sequence[int], pack: bool | Sequence[bool] = False) -> TrainBatch:
    """One row per sample of ``groups`` (advantages: one array of G values per group), or one
    packed row per group where ``pack`` says so (one flag for all groups, or one per group).

    Rows are sorted by length (longest first) so micro-batches carry little padding.
    """
    flags = [pack] * len(groups) if isinstance(pack, bool) else list(pack)
    if len(flags) != len(groups):
        raise ValueError("one pack flag per group")
    current = np.asarray(trainer_versions, dtype=np.int64)
    rows: list[_Row] = []
    for g, (group, adv, packed) in enumerate(zip(groups, advantages, flags)):
        stale = [int(np.max(current - s.oldest_versions())) if len(s.completion_ids) else 0 for s in group.samples]
        if packed and _packable(group):
            rows.append(_packed_row(group, np.asarray(adv), stale, g))
        else:
            rows += [_plain_row(group, s, float(a), stale[s], g) for s, a in enumerate(adv)]
    if not rows:
        raise ValueError("empty batch")
    rows.sort(key=lambda r: -len(r.inputs))
    width, n = len(rows[0].inputs), len(rows)
    inputs = np.full((n, width), pad_id, dtype=np.int64)
    targets = np.full((n, width), pad_id, dtype=np.int64)
    mask = np.zeros((n, width), dtype=bool)
    behaviour = np.zeros((n, width), dtype=np.float32)
    per_token = np.zeros((n, width), dtype=np.float32)
    for r, row in enumerate(rows):
        length = len(row.inputs)
        inputs[r, :length], targets[r, :length] = row.inputs, row.targets
        mask[r, :length], behaviour[r, :length], per_token[r, :length] = row.mask, row.behaviour, row.advantages
    any_packed = any(row.segments is not None for row in rows)
    advantages_arr = per_token if any_packed else np.array([row.advantages[0] for row in rows], dtype=np.float32)
    staleness = np.array([row.staleness for row in rows], dtype=np.int64)
    return TrainBatch(inputs, targets, mask, behaviour, advantages_arr, staleness,
                      [row.segments for row in rows] if any_packed else None, [row.source for row in rows])


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
    if all(b.advantages.ndim == 1 for b in batches):
        advantages = np.concatenate([b.advantages for b in batches])
    else:  # per token where any batch has packed rows
        advantages = np.concatenate([pad(np.broadcast_to(b.advantages[:, None], b.mask.shape)
                                         if b.advantages.ndim == 1 else b.advantages, 0.0) for b in batches])
    segments = None
    if any(b.segments is not None for b in batches):
        segments = [seg for b in batches for seg in (b.segments or [None] * b.num_rows)]
    stacked = TrainBatch(np.concatenate([pad(b.inputs, pad_id) for b in batches]),
                         np.concatenate([pad(b.targets, pad_id) for b in batches]),
                         np.concatenate([pad(b.mask, False) for b in batches]),
                         np.concatenate([pad(b.behaviour, 0.0) for b in batches]),
                         advantages, np.concatenate([b.staleness for b in batches]), segments)
    return stacked, offsets
