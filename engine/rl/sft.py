"""Supervised warm-up through the stage API: maximise the log-prob of reference answers.

The loss is the mean negative log-likelihood of the masked target tokens given everything
before them, so ``dloss/dlogp = -mask / N``; it goes down the stage chain exactly like the RL
gradient does. Two ways in, one step: digit examples through the task codec (``sft_arrays``:
answer + EOS trained; ``polis make-base`` gives RL a start whose exact match is above zero),
and token rows with their own loss mask (``sft_token_arrays``: e.g. the trajectories of tool
transcripts, only the model's tokens trained; ``engine.rl.tool_warmup``). It clips the global
gradient norm (it only ever runs in one process, where the global norm is free); the RL update
clips per stage (``engine.rl.update``).

What it does not know: rewards, advantages, checkpoint files.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.rl.codec import TaskCodec
from engine.rl.pipeline import StagePipeline
from engine.rl.tasks import Example
from engine.rl.update import clip_scale


def sft_arrays(examples: Sequence[Example], codec: TaskCodec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(inputs, targets, mask)`` int64/int64/bool ``[B, L]``; mask covers answer + EOS targets."""
    seqs = []
    for ex in examples:
        prompt = codec.encode_prompt(ex.prompt)
        seqs.append((prompt + codec.encode(ex.answer) + [codec.eos_id], len(prompt)))
    width = max(len(s) for s, _ in seqs) - 1
    inputs = np.full((len(seqs), width), codec.pad_id, dtype=np.int64)
    targets = np.full((len(seqs), width), codec.pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=bool)
    for r, (seq, p) in enumerate(seqs):
        inputs[r, :len(seq) - 1] = seq[:-1]
        targets[r, :len(seq) - 1] = seq[1:]
        mask[r, p - 1:len(seq) - 1] = True
    return inputs, targets, mask


def sft_token_arrays(rows: Sequence[tuple[Sequence[int], Sequence[int]]],
                     pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(inputs, targets, mask)`` ``[B, L]`` of token rows ``(ids, loss_mask)``: target ``t`` is
    ``ids[t + 1]``, trained where ``loss_mask[t + 1]`` is 1 (a trajectory's model tokens)."""
    if not rows:
        raise ValueError("no rows")
    for ids, m in rows:
        if len(ids) != len(m) or len(ids) < 2:
            raise ValueError("every row needs at least 2 ids and one mask entry per id")
        if m[0]:
            raise ValueError("the first id of a row has nothing before it and cannot be trained")
    width = max(len(ids) for ids, _ in rows) - 1
    inputs = np.full((len(rows), width), pad_id, dtype=np.int64)
    targets = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=bool)
    for r, (ids, m) in enumerate(rows):
        seq = np.asarray(ids, dtype=np.int64)
        inputs[r, :len(seq) - 1] = seq[:-1]
        targets[r, :len(seq) - 1] = seq[1:]
        mask[r, :len(seq) - 1] = np.asarray(m[1:], dtype=bool)
    if not mask.any():
        raise ValueError("no row has a trained token")
    return inputs, targets, mask


def sft_nll(pipeline: StagePipeline, inputs: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
    """The mean NLL of the masked targets (no gradient, no step)."""
    logp = pipeline.token_logprobs(inputs, targets)
    return float(-(logp * mask).sum() / float(mask.sum()))


def sft_step(pipeline: StagePipeline, examples: Sequence[Example], codec: TaskCodec, *, key: str,
             max_grad_norm: float = 1.0) -> float:
    """One optimiser step on ``examples``; returns the mean answer-token NLL before the step."""
    inputs, targets, mask = sft_arrays(examples, codec)
    return sft_step_arrays(pipeline, inputs, targets, mask, key=key, max_grad_norm=max_grad_norm)


def sft_step_arrays(pipeline: StagePipeline, inputs: np.ndarray, targets: np.ndarray, mask: np.ndarray, *,
                    key: str, max_grad_norm: float = 1.0) -> float:
    """One optimiser step on the masked targets; returns their mean NLL before the step."""
    n = float(mask.sum())
    pipeline.zero_grad()
    logp = pipeline.token_logprobs(inputs, targets, key=key)
    pipeline.backward(key, (mask / -n).astype(np.float32))
    pipeline.step(clip_scale(float(np.sqrt(sum(pipeline.grad_sq_norms()))), max_grad_norm))
    return float(-(logp * mask).sum() / n)
