"""The ``mixture`` chat task: reasoning-gym datasets drawn with weights.

Each entry of ``config.mixture`` becomes its own ``ReasoningGymTask`` (its options, held-out
split, example turn); the mixture composes them:

- held-out split: each dataset contributes ``round(eval_size * weight / total)`` items (at least
  one), so per-dataset figures come with the overall one (``chat.summarise``);
- training stream: a seeded generator picks the dataset of each item by weight and takes the
  next item of that dataset's own seeded stream; an item whose question is held out by *any*
  dataset of the mixture is skipped (different generators may still word a question alike);
- scores: by the item's dataset.

What it does not know: tokens, models; how one dataset generates or scores (its task does).
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from typing import Iterator

import numpy as np

from engine.rl.tasks.chat import ChatTask, Score, TaskItem, zero_score
from engine.rl.tasks.config import REASONING_GYM_PREFIX, TaskConfig
from engine.rl.tasks.reasoning_gym_task import ReasoningGymTask


class MixtureTask(ChatTask):
    """A weighted mixture of reasoning-gym datasets."""

    def __init__(self, config: TaskConfig) -> None:
        super().__init__(config)
        if not config.mixture:
            raise ValueError("a mixture needs at least one dataset")
        total = sum(e.weight for e in config.mixture)
        self.weights = np.array([e.weight / total for e in config.mixture])
        self.parts = [
            ReasoningGymTask(replace(config, name=REASONING_GYM_PREFIX + e.dataset, options=e.options, mixture=[],
                                     eval_size=max(1, round(config.eval_size * w))))
            for e, w in zip(config.mixture, self.weights)]
        self._by_dataset = {part.dataset: part for part in self.parts}  # each dataset once (TaskConfig)

    def eval_items(self) -> list[TaskItem]:
        items: list[TaskItem] = []
        seen: set[str] = set()
        for part in self.parts:
            for item in part.eval_items():
                if item.question not in seen:
                    seen.add(item.question)
                    items.append(item)
        return items

    def is_held_out(self, question: str) -> bool:
        return any(part.is_held_out(question) for part in self.parts)

    def train_items(self, seed: int) -> Iterator[TaskItem]:
        rng = np.random.default_rng([seed, zlib.crc32(b"polis-mixture")])
        streams = [part.train_items(zlib.crc32(f"{seed}/{i}".encode())) for i, part in enumerate(self.parts)]
        while True:
            k = int(rng.choice(len(streams), p=self.weights))
            for _ in range(10_000):
                item = next(streams[k])
                if not self.is_held_out(item.question):
                    yield item
                    break
            else:
                raise ValueError(f"mixture: {self.parts[k].dataset}'s stream yields only questions that another "
                                 "dataset of the mixture holds out; remove the overlap")

    def score(self, item: TaskItem, completion: str) -> Score:
        part = self._by_dataset.get(item.dataset)
        if part is None:
            return zero_score()
        return part.score(item, completion)
