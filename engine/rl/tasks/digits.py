"""Digit-string tasks: reversal, sorting and multi-digit addition.

Formats (character level, the answer follows ``=`` and ends with EOS):
``rev:12345=`` -> ``54321``; ``sort:31412=`` -> ``11234``; ``add:123+45=`` -> ``168``.
Each ``solve`` parses the prompt strictly (anything else answers ``None``).

What it does not know: tokens, rewards (see ``rewards``), models.
"""

from __future__ import annotations

import re

import numpy as np

from engine.rl.tasks.base import Task

_DIGITS = "0123456789"


def _random_digits(rng: np.random.Generator, min_len: int, max_len: int) -> str:
    length = int(rng.integers(min_len, max_len + 1))
    return "".join(_DIGITS[d] for d in rng.integers(0, 10, size=length))


class _DigitStringTask(Task):
    """A task whose prompt is ``prefix + digits + "="`` and whose answer is as long as the digits."""

    def random_prompt(self, rng: np.random.Generator) -> str:
        return f"{self.prefix}{_random_digits(rng, self.config.min_digits, self.config.max_digits)}="

    def solve(self, prompt: str) -> str | None:
        m = re.fullmatch(re.escape(self.prefix) + r"([0-9]{1,64})=", prompt)
        return self.answer(m.group(1)) if m else None

    def answer(self, digits: str) -> str:
        raise NotImplementedError

    def max_answer_chars(self) -> int:
        return self.config.max_digits


class ReversalTask(_DigitStringTask):
    """Reverse a digit string."""

    name = "reversal"
    prefix = "rev:"
    alphabet = _DIGITS + "rev:="

    def answer(self, digits: str) -> str:
        return digits[::-1]


class SortingTask(_DigitStringTask):
    """Sort the digits of a string in ascending order."""

    name = "sorting"
    prefix = "sort:"
    alphabet = _DIGITS + "sort:="

    def answer(self, digits: str) -> str:
        return "".join(sorted(digits))


class AdditionTask(Task):
    """Add two non-negative integers written in decimal without leading zeros."""

    name = "addition"
    prefix = "add:"
    alphabet = _DIGITS + "add:+="

    def _operand(self, rng: np.random.Generator) -> str:
        length = int(rng.integers(self.config.min_digits, self.config.max_digits + 1))
        if length == 1:
            return str(int(rng.integers(0, 10)))
        return str(int(rng.integers(10 ** (length - 1), 10 ** length)))

    def random_prompt(self, rng: np.random.Generator) -> str:
        return f"{self.prefix}{self._operand(rng)}+{self._operand(rng)}="

    def solve(self, prompt: str) -> str | None:
        m = re.fullmatch(r"add:(0|[1-9][0-9]{0,31})\+(0|[1-9][0-9]{0,31})=", prompt)
        return str(int(m.group(1)) + int(m.group(2))) if m else None

    def max_answer_chars(self) -> int:
        return self.config.max_digits + 1
