"""Supervised warm-up through the stage API: maximise the log-prob of reference answers.

The loss is the mean negative log-likelihood of the answer tokens (and EOS) given the
prompt, so ``dloss/dlogp = -mask / N``; it goes down the stage chain exactly like the RL
gradient does. Used by ``polis make-base`` to give RL a start whose exact match is
above zero. It clips the global gradient norm (it only ever runs in one process, where the
global norm is free); the RL update clips per stage (``engine.rl.update``).

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


def sft_step(pipeline: StagePipeline, examples: Sequence[Example], codec: TaskCodec, *, key: str,
             max_grad_norm: float = 1.0) -> float:
    """One optimiser step on ``examples``; returns the mean answer-token NLL before the step."""
    inputs, targets, mask = sft_arrays(examples, codec)
    n = float(mask.sum())
    pipeline.zero_grad()
    logp = pipeline.token_logprobs(inputs, targets, key=key)
    pipeline.backward(key, (mask / -n).astype(np.float32))
    pipeline.step(clip_scale(float(np.sqrt(sum(pipeline.grad_sq_norms()))), max_grad_norm))
    return float(-(logp * mask).sum() / n)
