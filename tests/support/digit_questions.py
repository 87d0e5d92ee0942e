"""A chat question source over the digit addition task, for tool-environment tests.

It has the shape ``engine.envs.tool_env.QuestionSource`` asks for (the chat tasks of
``engine.rl.tasks`` have it too): items with ``item_id``/``question``/``answer`` and a score
with parts ``answer`` (1.0 for the exact sum inside one ``<answer>`` tag pair at the end) and
``format`` (``format_weight`` for that tag pair, whatever is inside).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Mapping

from engine.rl.tasks import TaskConfig, make_task

_TAGGED = re.compile(r"<answer>([^<>]*)</answer>\s*\Z")


@dataclass(frozen=True)
class Question:
    item_id: str
    question: str
    answer: str


@dataclass(frozen=True)
class QuestionScore:
    parts: Mapping[str, float]


class DigitAdditionQuestions:
    def __init__(self, digits: int = 4, eval_size: int = 50, format_weight: float = 0.1) -> None:
        self.task = make_task(TaskConfig(name="addition", min_digits=digits, max_digits=digits, eval_size=eval_size))
        self.format_weight = format_weight

    def _question(self, prompt: str, answer: str) -> Question:
        a, b = prompt[len("add:"):-1].split("+")
        return Question(item_id=prompt, question=f"What is {a} + {b}?", answer=answer)

    def train_items(self, seed: int) -> Iterator[Question]:
        for ex in self.task.train_stream(seed):
            yield self._question(ex.prompt, ex.answer)

    def eval_items(self) -> list[Question]:
        return [self._question(ex.prompt, ex.answer) for ex in self.task.eval_split()]

    def score(self, item: Question, completion: str) -> QuestionScore:
        m = _TAGGED.search(completion)
        if m is None or completion.count("<answer>") != 1:
            return QuestionScore({"answer": 0.0, "format": 0.0})
        answer = m.group(1).strip()
        return QuestionScore({"answer": float(answer == item.answer), "format": self.format_weight})
