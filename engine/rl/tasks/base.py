"""What a verifiable task is: prompts, the answer a prompt implies, a held-out split, rewards.

A task turns a seeded random stream into prompt strings such as ``"rev:12345="`` and
knows, from the prompt alone, the one correct answer (``"54321"``). The reward of a
completion is a pure function of (task, prompt, completion text), so a coordinator can
recompute it from tokens without trusting anyone. Held-out prompts never appear in the
train stream.

What it does not know: token ids (``engine.rl.codec`` and ``engine.rl.tasks.rewards`` turn
tokens into text; ``engine.rl.tasks.scoring`` scores text), models, or how rollouts are produced.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from engine.rl.tasks.config import TaskConfig
from engine.rl.tasks.scoring import text_reward


@dataclass(frozen=True)
class Example:
    """One prompt and its correct answer (both plain text, no special tokens)."""

    prompt: str
    answer: str


class Task(ABC):
    """A family of prompts with one verifiable answer each."""

    #: registry name
    name: str = ""
    #: every character a prompt or an answer of this task may contain
    alphabet: str = ""
    #: prompt prefix, e.g. ``"rev:"``
    prefix: str = ""

    def __init__(self, config: TaskConfig) -> None:
        self.config = config
        self._eval: list[Example] | None = None
        self._eval_prompts: frozenset[str] | None = None

    # -- task-specific -------------------------------------------------------
    @abstractmethod
    def random_prompt(self, rng: np.random.Generator) -> str:
        """A random well-formed prompt (ending in ``=``)."""

    @abstractmethod
    def solve(self, prompt: str) -> str | None:
        """The correct answer for ``prompt``, or ``None`` if it is not a prompt of this task."""

    @abstractmethod
    def max_answer_chars(self) -> int:
        """Longest correct answer this configuration can ask for."""

    def max_prompt_chars(self) -> int:
        return max(len(self.random_prompt(np.random.default_rng(s))) for s in range(64))

    # -- shared ----------------------------------------------------------------
    def example(self, prompt: str) -> Example:
        answer = self.solve(prompt)
        if answer is None:
            raise ValueError(f"not a {self.name} prompt: {prompt!r}")
        return Example(prompt, answer)

    def _eval_seed(self) -> int:
        c = self.config
        return zlib.crc32(f"polis-eval/{self.name}/{c.min_digits}/{c.max_digits}".encode())

    def eval_split(self) -> list[Example]:
        """The fixed held-out split: same prompts in every process and run."""
        if self._eval is None:
            rng = np.random.default_rng(self._eval_seed())
            seen: dict[str, Example] = {}
            attempts = 0
            while len(seen) < self.config.eval_size and attempts < 50 * self.config.eval_size:
                prompt = self.random_prompt(rng)
                seen.setdefault(prompt, self.example(prompt))
                attempts += 1
            self._eval = list(seen.values())
            self._eval_prompts = frozenset(seen)
        return list(self._eval)

    def is_held_out(self, prompt: str) -> bool:
        if self._eval_prompts is None:
            self.eval_split()
        assert self._eval_prompts is not None
        return prompt in self._eval_prompts

    def train_stream(self, seed: int) -> Iterator[Example]:
        """An endless seeded stream of training examples, never a held-out prompt."""
        rng = np.random.default_rng([seed, zlib.crc32(self.name.encode())])
        while True:
            prompt = self.random_prompt(rng)
            if not self.is_held_out(prompt):
                yield self.example(prompt)

    def reward_text(self, prompt: str, completion: str) -> float:
        """Score a decoded completion (without EOS) for ``prompt``; never raises."""
        try:
            answer = self.solve(prompt)
        except Exception:  # a malformed prompt is the caller's problem, not a crash
            return 0.0
        if answer is None:
            return 0.0
        return text_reward(answer, completion, self.config.reward, max_chars=self.max_answer_chars())
