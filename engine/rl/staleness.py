"""Policy-version bookkeeping: how stale a rollout is, the hard bound, and a lagged queue.

*Staleness* of a group = how many optimiser steps the trainer has applied since the
oldest policy that produced any of its tokens, taken per stage and maximised over stages.
Groups staler than ``max_staleness`` are dropped and counted. ``LaggedQueue`` simulates,
honestly and in one process, a generator that runs ``lag`` versions ahead of the trainer:
batches are generated with the current weights and trained on ``lag`` steps later.

What it does not know: models, rewards, the objective.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Generic, Sequence, TypeVar

import numpy as np

from engine.rl.rollout import Group

T = TypeVar("T")


def group_staleness(group: Group, trainer_versions: Sequence[int]) -> int:
    """Versions the trainer is ahead of the oldest policy that produced ``group`` (max over stages)."""
    lag = np.asarray(trainer_versions, dtype=np.int64) - group.oldest_versions()
    return int(lag.max())


def filter_stale(groups: Sequence[Group], trainer_versions: Sequence[int],
                 max_staleness: int) -> tuple[list[Group], list[int], int]:
    """Split off groups staler than ``max_staleness``.

    Returns ``(kept, staleness of every group seen, number dropped)``.
    """
    if max_staleness < 0:
        raise ValueError("max_staleness must be >= 0")
    kept, seen, dropped = [], [], 0
    for group in groups:
        s = group_staleness(group, trainer_versions)
        seen.append(s)
        if s > max_staleness:
            dropped += 1
        else:
            kept.append(group)
    return kept, seen, dropped


def histogram(values: Sequence[int]) -> dict[int, int]:
    """``{staleness: count}`` in ascending order."""
    return dict(sorted(Counter(int(v) for v in values).items()))


class LaggedQueue(Generic[T]):
    """FIFO that releases an item only once ``lag`` newer items have been pushed after it.

    With one push and one pop per trainer step, what is trained at version v was generated
    at version ``v - lag`` in steady state (the first ``lag`` steps only generate).
    """

    def __init__(self, lag: int) -> None:
        if lag < 0:
            raise ValueError("lag must be >= 0")
        self.lag = lag
        self._items: deque[T] = deque()

    def push(self, item: T) -> None:
        self._items.append(item)

    def pop_ready(self) -> T | None:
        """The oldest item if more than ``lag`` items are queued, else ``None``."""
        if len(self._items) > self.lag:
            return self._items.popleft()
        return None

    def clear(self) -> None:
        self._items.clear()

    def pending(self) -> list[T]:
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)
