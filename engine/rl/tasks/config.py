"""The one task configuration: which task, how hard, how it is prompted and scored.

``TaskConfig`` names either a character-level digit task (``reversal``, ``sorting``,
``addition``: ``min_digits``, ``max_digits``, ``reward`` apply) or a chat task for a real model
(``reasoning_gym:<dataset>`` with that dataset's ``options``, or ``mixture`` of such datasets with
weights: ``system_prompt``, ``example`` and ``format_weight`` apply). It survives
``dataclasses.asdict`` -> JSON -> ``TaskConfig(**data)`` unchanged, so it can travel in a run
config. Validation here is by shape and size only; a dataset's own option names and ranges are
checked when the task is built (``engine.rl.tasks.make_chat_task``), which needs reasoning-gym.

What it does not know: the datasets themselves, tokens, models.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from engine.rl.tasks.scoring import RewardKind

#: prefix of the chat task names backed by a reasoning-gym dataset
REASONING_GYM_PREFIX = "reasoning_gym:"
#: name of the weighted mixture of reasoning-gym datasets
MIXTURE_NAME = "mixture"
#: how the worked example turn before the question is written
EXAMPLE_STYLES = ("worked", "bare", "none")
#: the default system turn: working first, then the answer in tags (DESIGN §9: a model asked for
#: the tags alone learned the tags and lost the arithmetic it did when it wrote its working)
DEFAULT_SYSTEM_PROMPT = ("Work the problem out briefly, then give only the final answer inside "
                         "<answer></answer> tags.")

_MAX_OPTIONS = 32
_MAX_OPTION_LIST = 64
_MAX_TEXT = 2000
_MAX_MIXTURE = 16
_DIGIT_DEFAULTS = {"min_digits": 4, "max_digits": 4, "reward": RewardKind.PER_POSITION}


def is_chat_task_name(name: str) -> bool:
    """Whether ``name`` is a chat task (reasoning-gym dataset or mixture), not a digit task."""
    return name == MIXTURE_NAME or name.startswith(REASONING_GYM_PREFIX)


def _canonical(options: Mapping[str, Any]) -> str:
    return json.dumps(options, sort_keys=True)


def _check_options(options: Any, what: str) -> dict[str, Any]:
    """A copy of ``options`` if it is a small JSON object of scalars / short scalar lists."""
    if not isinstance(options, Mapping):
        raise ValueError(f"{what} must be an object of option names to values")
    if len(options) > _MAX_OPTIONS:
        raise ValueError(f"{what}: at most {_MAX_OPTIONS} options")
    out: dict[str, Any] = {}
    for key, value in options.items():
        if not isinstance(key, str) or not key.isidentifier() or len(key) > 64:
            raise ValueError(f"{what}: option names must be identifiers, got {key!r}")
        if key in ("seed", "size"):
            raise ValueError(f"{what}: {key!r} is set by Polis (the held-out split and the seeded stream)")
        items = value if isinstance(value, (list, tuple)) else [value]
        if len(items) > _MAX_OPTION_LIST:
            raise ValueError(f"{what}.{key}: at most {_MAX_OPTION_LIST} values")
        for v in items:
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{what}.{key}: values must be finite")
            if not isinstance(v, (bool, int, float, str)) or (isinstance(v, str) and len(v) > 200):
                raise ValueError(f"{what}.{key}: values must be numbers, booleans or short strings")
        out[key] = list(value) if isinstance(value, (list, tuple)) else value
    return out


@dataclass(frozen=True)
class MixtureEntry:
    """One reasoning-gym dataset of a mixture.

    Fields:
      dataset: reasoning-gym dataset name (``chain_sum``), without the ``reasoning_gym:`` prefix.
      weight: relative share of the training stream and of the held-out split (> 0).
      options: that dataset's config (its dataclass fields except ``seed`` and ``size``).
    """

    dataset: str
    weight: float = 1.0
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not self.dataset.isidentifier():
            raise ValueError(f"mixture dataset must be a reasoning-gym dataset name, got {self.dataset!r}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) \
                or not 0.0 < float(self.weight) <= 1e6:
            raise ValueError(f"mixture weight of {self.dataset} must be in (0, 1e6], got {self.weight!r}")
        object.__setattr__(self, "weight", float(self.weight))
        object.__setattr__(self, "options", _check_options(self.options, f"mixture[{self.dataset}].options"))

    def __hash__(self) -> int:  # options is a dict: hash its canonical JSON
        return hash((self.dataset, self.weight, _canonical(self.options)))


@dataclass(frozen=True)
class TaskConfig:
    """Which task and how hard. Validated on construction.

    The defaults are the task of the shipped base checkpoint (``engine.rl.recipe``).

    Fields, all tasks:
      name: ``reversal``, ``sorting``, ``addition`` (digit tasks, character level), or
        ``reasoning_gym:<dataset>`` (e.g. ``reasoning_gym:chain_sum``), or ``mixture``.
      eval_size: number of held-out items (fixed, independent of any run seed); the training
        stream never yields one of them. A chat task holds out at most half of the distinct
        questions it finds, so a small task space yields fewer.
    Digit tasks only:
      min_digits / max_digits: inclusive range of the digit-string length (reversal,
        sorting) or of each operand's length (addition).
      reward: how completions are scored (``exact``, ``per_position``, ``lcs``).
    Chat tasks only:
      options: the dataset's own config for ``reasoning_gym:<dataset>``, e.g.
        ``{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}`` (not ``seed``/``size``).
      mixture: the datasets of ``mixture``, each with a weight and options.
      system_prompt: the system turn of every prompt (empty: none).
      example: ``worked`` (one solved example turn showing its working before the tags, where the
        dataset states an expression; else as ``bare``), ``bare`` (the answer in tags only) or
        ``none``.
      format_weight: the reward's format part for a well-formed answer (one tag pair, at the end,
        an answer of the gold answer's shape); the answer part is the dataset's own score, in [0, 1].
        Keep it small: under group-normalised advantages a format-only difference inside a group
        becomes a full-size signal.
    """

    name: str = "reversal"
    min_digits: int = 4
    max_digits: int = 4
    reward: RewardKind = RewardKind.PER_POSITION
    eval_size: int = 400
    options: dict[str, Any] = field(default_factory=dict)
    mixture: list[MixtureEntry] = field(default_factory=list)  # a list: asdict must equal its JSON
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    example: str = "worked"
    format_weight: float = 0.05

    def __hash__(self) -> int:  # options is a dict: hash its canonical JSON (configs are used as defaults)
        return hash((self.name, self.min_digits, self.max_digits, self.reward, self.eval_size,
                     _canonical(self.options), tuple(self.mixture), self.system_prompt, self.example,
                     self.format_weight))

    def __post_init__(self) -> None:
        object.__setattr__(self, "reward", RewardKind(self.reward))
        if not 1 <= self.min_digits <= self.max_digits <= 32:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 32, got {self.min_digits}, {self.max_digits}")
        if not 1 <= self.eval_size <= 100_000:
            raise ValueError(f"eval_size must be in [1, 100000], got {self.eval_size}")
        object.__setattr__(self, "options", _check_options(self.options, "options"))
        mixture = self.mixture if isinstance(self.mixture, (list, tuple)) else None
        if mixture is None or len(mixture) > _MAX_MIXTURE:
            raise ValueError(f"mixture must be a list of at most {_MAX_MIXTURE} datasets")
        object.__setattr__(self, "mixture", [
            e if isinstance(e, MixtureEntry) else MixtureEntry(**e) if isinstance(e, Mapping)
            else MixtureEntry(*e) for e in mixture])
        if not isinstance(self.system_prompt, str) or len(self.system_prompt) > _MAX_TEXT:
            raise ValueError(f"system_prompt must be a string of at most {_MAX_TEXT} characters")
        if self.example not in EXAMPLE_STYLES:
            raise ValueError(f"example must be one of {EXAMPLE_STYLES}, got {self.example!r}")
        if isinstance(self.format_weight, bool) or not isinstance(self.format_weight, (int, float)) \
                or not 0.0 <= float(self.format_weight) <= 1.0:
            raise ValueError(f"format_weight must be in [0, 1], got {self.format_weight!r}")
        object.__setattr__(self, "format_weight", float(self.format_weight))
        self._check_family()

    def _check_family(self) -> None:
        if self.name == MIXTURE_NAME:
            if not self.mixture:
                raise ValueError("a mixture needs at least one dataset: mixture=[{dataset, weight, options}]")
            if self.options:
                raise ValueError("a mixture takes options per dataset (mixture[i].options), not options")
            names = [e.dataset for e in self.mixture]
            if len(set(names)) != len(names):
                raise ValueError(f"each dataset at most once in a mixture, got {names}")
        elif self.name.startswith(REASONING_GYM_PREFIX):
            if not self.name[len(REASONING_GYM_PREFIX):].isidentifier():
                raise ValueError(f"{self.name!r}: expected reasoning_gym:<dataset>, e.g. reasoning_gym:chain_sum")
            if self.mixture:
                raise ValueError(f"{self.name} is one dataset; use name='mixture' for a mixture")
        elif self.options or self.mixture:
            raise ValueError(f"{self.name!r} is a digit task: options and mixture apply to chat tasks only")
        if is_chat_task_name(self.name):
            changed = [k for k, v in _DIGIT_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(f"{', '.join(changed)} apply to digit tasks only; "
                                 f"set the dataset's own options for {self.name}")

    @property
    def dataset(self) -> str:
        """The reasoning-gym dataset of a ``reasoning_gym:<dataset>`` task ('' otherwise)."""
        return self.name[len(REASONING_GYM_PREFIX):] if self.name.startswith(REASONING_GYM_PREFIX) else ""
