"""Ingestion checks of a generation result: what a last stage reports is evidence, not fact.

The coordinator scores and stores rollouts that came from machines it does not trust. Before a
``gen_done`` becomes rollouts, :func:`check_result` applies the rules an honest sampler can never
break, so one forged message cannot stop training or steer it:

* every token id lies in the model's vocabulary (stage 0 refuses an id past its embedding rows,
  and a refused micro-batch used to abort every later step);
* a row ends at its first stop id (anything after it is cut, with its log-probs) and has at most
  ``max_new_tokens`` ids;
* behaviour log-probs are <= 0 (the wire format already refuses NaN/inf); values a hair above
  0 from float rounding are clamped to 0;
* no stage's reported version is newer than the coordinator's current version (versions only
  come from the coordinator's ``apply``; a version from the future would make a stale rollout
  look fresh).

A result that breaks a rule is refused as a whole and its generator (the route's last stage)
is flagged by the caller. What it does not know: rewards, routes, the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: log-probs this far above 0 are float rounding of an honest log-softmax (clamped to 0)
LOGPROB_ROUNDING = 1e-4


@dataclass(frozen=True)
class RolloutLimits:
    """What an honest result of one run can contain."""

    vocab_size: int  #: rows of the model's embedding matrix; ids must be below it
    stop_ids: frozenset[int]  #: ids that end a completion (EOS and end-of-turn tokens)
    max_new_tokens: int  #: the completion budget (stop id included)


@dataclass(frozen=True)
class CheckedResult:
    """A result that passed: rows cut at their first stop id, log-probs clamped to <= 0."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[int]


class RefusedResult(ValueError):
    """The result breaks a rule no honest sampler breaks (the message says which)."""


def check_result(tokens: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], versions: Sequence[int],
                 limits: RolloutLimits, current_version: int) -> CheckedResult:
    """The sanitised result, or raise :class:`RefusedResult`."""
    if any(v > current_version for v in versions):
        raise RefusedResult(f"reports version {max(versions)}, newer than the run's {current_version}")
    out_tokens, out_logprobs = [], []
    for row, lps in zip(tokens, logprobs, strict=True):
        if len(row) != len(lps):
            raise RefusedResult("a row's log-probs do not match its tokens")
        if any(not 0 <= t < limits.vocab_size for t in row):
            raise RefusedResult(f"a token id outside the vocabulary [0, {limits.vocab_size})")
        end = next((i + 1 for i, t in enumerate(row) if t in limits.stop_ids), len(row))
        if end > limits.max_new_tokens:
            raise RefusedResult(f"a completion of {end} ids, over the budget of {limits.max_new_tokens}")
        if any(lp > LOGPROB_ROUNDING for lp in lps[:end]):
            raise RefusedResult("a positive log-probability")
        out_tokens.append([int(t) for t in row[:end]])
        out_logprobs.append([min(float(lp), 0.0) for lp in lps[:end]])
    return CheckedResult(out_tokens, out_logprobs, [int(v) for v in versions])
