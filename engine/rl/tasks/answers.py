"""Reading an answer out of a model's free text: in ``<answer>`` tags, or stated without them.

Three pure functions over decoded text, each linear in the text's length and safe on any
input (garbage, megabytes, unbalanced or nested tags):

- ``tagged_answer``: the strict answer, the content of the last complete
  ``<answer>...</answer>`` pair (last tag wins), stripped; ``None`` if there is none, it is
  empty, far longer than the gold answer could be, or not of the gold answer's shape (a number
  where the gold is a number, one word where it is one word). The shape gate narrows the spray
  hole in substring partial credit (reasoning-gym's default ``score_answer`` gives
  len(gold)/len(answer) when the gold occurs inside the answer: ``<answer>7 8 9 10</answer>``
  would earn on every item whose answer it lists).
- ``stated_answer``: the content-only answer, what the text states ignoring the tags: the last
  number for a numeric gold answer, the last word for a one-word gold answer, else the last
  non-empty line. Evals report it beside the strict score so that a rise in format is not taken
  for a rise in skill (DESIGN §9).
- ``well_formed``: the format check: exactly one tag pair, nothing but whitespace after it, and a
  tagged answer as above.

What it does not know: how an answer is scored (the dataset's ``score_answer`` does that), tokens,
models.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

OPEN_TAG = "<answer>"
CLOSE_TAG = "</answer>"
#: only this tail of a completion is searched for a stated answer (completions are bounded by the
#: token budget anyway; this keeps a hostile megabyte from costing more than a normal answer)
SCAN_CHARS = 65536

_NUMBER = re.compile(r"(?<![\d.])-?\d[\d,]*(?:\.\d+)?")
_GOLD_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_PUNCT = " \t\r\n.,;:!?\"'`()[]{}*"


def max_answer_chars(gold: str) -> int:
    """Longest answer taken seriously for ``gold``: longer ones are spray, not answers."""
    return 4 * len(gold) + 16


def is_numeric(gold: str) -> bool:
    return _GOLD_NUMBER.fullmatch(gold.strip().replace(",", "")) is not None


def parses_as_number(answer: str) -> bool:
    """Whether ``answer`` is a finite decimal number as the datasets' scorers read one
    (``Decimal`` after dropping thousands commas: ``-3.``, ``+01,000.00`` and ``1e3`` are numbers)."""
    try:
        return Decimal(answer.replace(",", "")).is_finite()
    except (InvalidOperation, ValueError):
        return False


def has_gold_shape(answer: str, gold: str) -> bool:
    """A number for a numeric gold, a single word for a one-word gold; else any text."""
    if is_numeric(gold):
        return parses_as_number(answer)
    if len(gold.split()) == 1:
        return len(answer.split()) == 1
    return True


def tagged_answer(text: str, gold: str) -> str | None:
    """The content of the last complete ``<answer>...</answer>`` pair if it can be an answer."""
    close = text.rfind(CLOSE_TAG)
    if close < 0:
        return None
    start = text.rfind(OPEN_TAG, 0, close)
    if start < 0:
        return None
    answer = text[start + len(OPEN_TAG):close].strip()
    if not answer or len(answer) > max_answer_chars(gold) or not has_gold_shape(answer, gold):
        return None
    return answer


def stated_answer(text: str, gold: str) -> str | None:
    """What ``text`` states as its answer without regard to tags (see the module docstring)."""
    tail = text[-SCAN_CHARS:].replace(OPEN_TAG, " ").replace(CLOSE_TAG, " ")
    if is_numeric(gold):
        numbers = _NUMBER.findall(tail)
        return numbers[-1].rstrip(",") if numbers else None
    if len(gold.split()) <= 1:
        words = [w.strip(_PUNCT) for w in tail.split()]
        words = [w for w in words if w]
        return words[-1] if words else None
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    if not lines or len(lines[-1]) > max_answer_chars(gold):
        return None
    return lines[-1]


def well_formed(text: str, gold: str) -> bool:
    """One tag pair, at the end, holding an answer of the gold answer's shape."""
    if text.count(OPEN_TAG) != 1 or text.count(CLOSE_TAG) != 1:
        return False
    start, close = text.find(OPEN_TAG), text.find(CLOSE_TAG)
    if close < start or text[close + len(CLOSE_TAG):].strip():
        return False
    return tagged_answer(text, gold) is not None
