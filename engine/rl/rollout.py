"""Rollouts: sampling completions through a stage pipeline with KV caches.

A *group* is G samples of one prompt. Groups whose prompts have the same token length
share one KV cache (all rows of a cache have the same length, so no attention mask is
needed); each prompt is prefilled once and its cache rows copied to its G samples
(``StagePipeline.next_token_logits``' ``expand``); each decode step appends one token per
row. For every sampled token we keep the behaviour log-prob (under
``softmax(logits / temperature)``, before top-p) and the policy version of every stage at
the moment the token was produced.

What it does not know: rewards, advantages, the objective, transports.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from backends.base import sample_from_logits
from engine.rl.pipeline import StagePipeline

_cache_counter = itertools.count()
#: rows that finished are dropped from the cache once they are at least this share of its rows (each
#: drop copies the remaining rows once; decoding a finished row costs as much as decoding a live one)
DROP_FINISHED_SHARE = 0.25


def rows_going_on(finished: np.ndarray) -> np.ndarray | None:
    """The cache rows to keep decoding (``finished``: per cache row), or None to keep them all."""
    if not finished.any() or finished.mean() < DROP_FINISHED_SHARE:
        return None
    return np.flatnonzero(~finished)


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled.

    Fields:
      temperature: softmax temperature (0 = greedy); the trainer scores tokens at the same one.
      top_p: nucleus truncation (1 = off).
      max_new_tokens: completion budget including EOS; a completion without EOS by then is unfinished.
      max_rows_per_cache: most rows decoded together in one KV cache (bounds memory).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    max_rows_per_cache: int = 512

    def __post_init__(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 1 <= self.max_new_tokens <= 4096:
            raise ValueError(f"max_new_tokens must be in [1, 4096], got {self.max_new_tokens}")
        if self.max_rows_per_cache < 1:
            raise ValueError("max_rows_per_cache must be >= 1")


@dataclass
class Sample:
    """One sampled completion of a prompt."""

    completion_ids: np.ndarray  #: int64 [T], ends with EOS if ``finished``
    behaviour_logprobs: np.ndarray  #: float32 [T], log-prob of each sampled token when sampled
    versions: np.ndarray  #: int64 [T, S], policy version of each stage when each token was sampled
    finished: bool  #: emitted EOS within the budget
    reward: float | None = None
    #: bool [T]: True on the model's own tokens (trained); False on context ids inside the completion
    #: (a multi-turn episode's tool and template tokens). None: every token is the model's.
    loss_mask: np.ndarray | None = None

    def oldest_versions(self) -> np.ndarray:
        """Per stage, the oldest version that produced any token of this sample."""
        return self.versions.min(axis=0)


@dataclass
class Group:
    """G samples of one prompt."""

    prompt: str
    prompt_ids: np.ndarray  #: int64 [P], as fed to the model (BOS included if any)
    samples: list[Sample] = field(default_factory=list)

    def oldest_versions(self) -> np.ndarray:
        return np.min([s.oldest_versions() for s in self.samples], axis=0)

    def rewards(self) -> np.ndarray:
        if any(s.reward is None for s in self.samples):
            raise ValueError("group has unscored samples")
        return np.array([s.reward for s in self.samples], dtype=np.float64)


def _buckets(prompt_ids: Sequence[np.ndarray], rows_per_prompt: int, max_rows: int) -> list[list[int]]:
    """Indices of prompts grouped by token length, each bucket at most ``max_rows`` rows."""
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        by_len.setdefault(len(ids), []).append(i)
    per_bucket = max(1, max_rows // rows_per_prompt)
    return [idx[k:k + per_bucket] for _, idx in sorted(by_len.items()) for k in range(0, len(idx), per_bucket)]


def _stop_array(stop_ids: int | Sequence[int] | np.ndarray) -> np.ndarray:
    """The ids that end a completion (one EOS id, or EOS and end-of-turn ids of a chat model)."""
    stops = np.atleast_1d(np.asarray(stop_ids, dtype=np.int64))
    if stops.size == 0:
        raise ValueError("need at least one stop id")
    return stops


def _decode(pipeline: StagePipeline, tokens: np.ndarray, sampling: SamplingConfig,
            stop_ids: int | Sequence[int] | np.ndarray,
            rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decode rows of equal-length prompts together. Returns (ids, logprobs, versions, lengths)."""
    stops = _stop_array(stop_ids)
    rows = tokens.shape[0]
    steps = sampling.max_new_tokens
    out_ids = np.zeros((rows, steps), dtype=np.int64)
    out_lp = np.zeros((rows, steps), dtype=np.float32)
    out_ver = np.zeros((rows, steps, pipeline.num_stages), dtype=np.int64)
    lengths = np.full(rows, steps, dtype=np.int64)
    done = np.zeros(rows, dtype=bool)
    cache_id = f"rollout-{next(_cache_counter)}"
    distinct, expand = np.unique(tokens, axis=0, return_inverse=True)
    try:
        if len(distinct) < rows:  # the samples of one prompt: prefill it once
            logits = pipeline.next_token_logits(distinct, cache_id, expand=expand.reshape(-1))
        else:
            logits = pipeline.next_token_logits(tokens, cache_id)
        live = np.arange(rows)  # the row of each cache row (rows that finished leave the cache)
        for t in range(steps):
            out_ver[live, t] = pipeline.versions()
            draws = rng.random((rows, 1))[live]  # each row's draw, whichever rows are still decoded
            tok, lp = sample_from_logits(logits, rng, temperature=sampling.temperature, top_p=sampling.top_p,
                                         draws=draws)
            out_ids[live, t], out_lp[live, t] = tok, lp
            newly = ~done[live] & np.isin(tok, stops)
            lengths[live[newly]] = t + 1
            done[live[newly]] = True
            if done.all() or t == steps - 1:
                break
            keep = rows_going_on(done[live])
            if keep is not None:
                live, tok = live[keep], tok[keep]
            logits = pipeline.next_token_logits(tok[:, None], cache_id, keep=keep)
    finally:
        pipeline.drop_cache(cache_id)
    return out_ids, out_lp, out_ver, lengths


def generate_groups(pipeline: StagePipeline, prompts: Sequence[str], prompt_ids: Sequence[Sequence[int]],
                    group_size: int, sampling: SamplingConfig, stop_ids: int | Sequence[int],
                    rng: np.random.Generator) -> list[Group]:
    """Sample ``group_size`` completions of every prompt; groups come back in prompt order.

    A completion ends at the first of ``stop_ids`` (an EOS id, or a chat model's EOS and
    end-of-turn ids), which it keeps."""
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    if len(prompts) != len(prompt_ids):
        raise ValueError("one id list per prompt")
    arrays = [np.asarray(ids, dtype=np.int64) for ids in prompt_ids]
    groups = [Group(prompt=p, prompt_ids=a) for p, a in zip(prompts, arrays)]
    stops = _stop_array(stop_ids)
    for bucket in _buckets(arrays, group_size, sampling.max_rows_per_cache):
        tokens = np.repeat(np.stack([arrays[i] for i in bucket]), group_size, axis=0)
        ids, lps, vers, lengths = _decode(pipeline, tokens, sampling, stops, rng)
        for row in range(tokens.shape[0]):
            n = int(lengths[row])
            finished = bool(np.isin(ids[row, n - 1], stops))
            groups[bucket[row // group_size]].samples.append(
                Sample(completion_ids=ids[row, :n].copy(), behaviour_logprobs=lps[row, :n].copy(),
                       versions=vers[row, :n].copy(), finished=finished))
    return groups


def greedy_completions(pipeline: StagePipeline, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
                       stop_ids: int | Sequence[int], max_rows_per_cache: int = 512) -> list[np.ndarray]:
    """Greedy completion ids (the stop id included when emitted) of every prompt, in order."""
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens, max_rows_per_cache=max_rows_per_cache)
    arrays = [np.asarray(ids, dtype=np.int64) for ids in prompt_ids]
    out: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * len(arrays)
    rng = np.random.default_rng(0)  # unused by greedy decoding
    for bucket in _buckets(arrays, 1, max_rows_per_cache):
        ids, _, _, lengths = _decode(pipeline, np.stack([arrays[i] for i in bucket]), sampling, stop_ids, rng)
        for row, i in enumerate(bucket):
            out[i] = ids[row, :int(lengths[row])].copy()
    return out
