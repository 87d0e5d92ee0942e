"""Shortcut monitor: is the policy giving one answer to many different questions?

RL finds whatever a reward can be fooled by; on reasoning-gym ``letter_counting`` SmolLM2 learned
one constant answer that scores on many items (DESIGN §9). The tell is in a batch's answer
histogram: the commonest answer the policy gives is far more common than the commonest gold
answer of the same questions. ``shortcut_report`` is a pure function over a batch of
(gold answer, given answer) pairs that measures exactly that, for a run to show and log.

The other tell is over time: the figure trained on rises while the figure that matters falls
(DESIGN §9: strict 7 % -> 11 % while content fell 61 % -> 11 %, the model learned the tags and
lost the arithmetic). ``divergence`` compares the two series of a run's evals.

Answers are compared after light normalisation (surrounding space, case, thousands commas, and
numbers by value: ``"07"`` == ``"7"`` == ``"7.0"``).

What it does not know: how answers were extracted (``engine.rl.tasks.answers``), rewards, models.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Iterable, Sequence


def normalise(answer: str) -> str:
    text = answer.strip().lower()
    plain = text.replace(",", "")
    if 0 < len(plain) <= 64:
        try:
            value = Decimal(plain)
        except InvalidOperation:
            return text
        if value.is_finite():
            return format(value.normalize(), "f") if value != 0 else "0"
    return text


@dataclass(frozen=True)
class ShortcutReport:
    """The answer histogram of a batch against its gold answers.

    Fields:
      samples: pairs in the batch.
      answered: samples that gave an answer at all.
      commonest_answer: the answer given most often (normalised), ``None`` if none was given.
      commonest_share: its share of all samples.
      gold_share: the share of all samples whose gold is the commonest gold answer (what a
        constant answer can at best deserve).
      commonest_correct: the share of all samples that gave the commonest answer and were right.
      excess: ``commonest_share - gold_share``; near 0 for an honest policy.
      suspicious: ``excess > margin`` on at least ``min_samples`` samples.
    """

    samples: int
    answered: int
    commonest_answer: str | None
    commonest_share: float
    gold_share: float
    commonest_correct: float
    excess: float
    suspicious: bool

    def to_dict(self) -> dict[str, object]:
        return {"samples": self.samples, "answered": self.answered, "commonest_answer": self.commonest_answer,
                "commonest_share": round(self.commonest_share, 4), "gold_share": round(self.gold_share, 4),
                "commonest_correct": round(self.commonest_correct, 4), "excess": round(self.excess, 4),
                "suspicious": self.suspicious}


def shortcut_report(pairs: Iterable[tuple[str, str | None]], *, margin: float = 0.2,
                    min_samples: int = 16) -> ShortcutReport:
    """Measure the batch ``pairs`` of (gold answer, given answer or ``None``)."""
    if not 0.0 <= margin <= 1.0 or min_samples < 1:
        raise ValueError("need 0 <= margin <= 1 and min_samples >= 1")
    golds: list[str] = []
    given: list[str | None] = []
    for gold, answer in pairs:
        golds.append(normalise(gold))
        given.append(normalise(answer) if isinstance(answer, str) and answer.strip() else None)
    n = len(golds)
    if n == 0:
        return ShortcutReport(0, 0, None, 0.0, 0.0, 0.0, 0.0, False)
    answered = [a for a in given if a is not None]
    gold_share = Counter(golds).most_common(1)[0][1] / n
    if not answered:
        return ShortcutReport(n, 0, None, 0.0, gold_share, 0.0, -gold_share, False)
    commonest, count = Counter(answered).most_common(1)[0]
    share = count / n
    correct = sum(1 for g, a in zip(golds, given) if a == commonest and g == commonest) / n
    excess = share - gold_share
    return ShortcutReport(samples=n, answered=len(answered), commonest_answer=commonest, commonest_share=share,
                          gold_share=gold_share, commonest_correct=correct, excess=excess,
                          suspicious=n >= min_samples and excess > margin)


@dataclass(frozen=True)
class DivergenceReport:
    """Two eval series, early against late.

    Fields:
      evals: points in each series.
      trained_change: mean of the last ``window`` points of the trained-on figure (e.g. reward
        or strict score) minus the mean of its first ``window``.
      honest_change: the same for the figure that matters (e.g. held-out content score).
      diverging: the trained figure rose while the honest one fell by more than ``margin``.
    """

    evals: int
    trained_change: float
    honest_change: float
    diverging: bool


def divergence(trained: Sequence[float], honest: Sequence[float], *, window: int = 2,
               margin: float = 0.05) -> DivergenceReport:
    """Whether ``trained`` rose while ``honest`` fell between the first and last ``window`` evals."""
    if len(trained) != len(honest):
        raise ValueError(f"{len(trained)} trained points but {len(honest)} honest ones")
    if window < 1 or not 0.0 <= margin <= 1.0:
        raise ValueError("need window >= 1 and 0 <= margin <= 1")
    n = len(trained)
    if n < 2 * window:
        return DivergenceReport(n, 0.0, 0.0, False)

    def change(series: Sequence[float]) -> float:
        return sum(series[-window:]) / window - sum(series[:window]) / window

    up, down = change(trained), change(honest)
    return DivergenceReport(n, up, down, up > 0.0 and down < -margin)
