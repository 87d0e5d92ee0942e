"""Registry of verifiable tasks: ``make_task`` (digit tasks) and ``make_chat_task`` (real models).

Digit tasks (character level, the shipped tiny base): ``reversal``, ``sorting``, ``addition``
(see ``digits``); rewards from tokens are in ``rewards``. ``ALPHABET`` is every character any
digit task uses; the base checkpoint's tokenizer covers it.

Chat tasks (a real model with a chat template): ``reasoning_gym:<dataset>`` and ``mixture``
(see ``chat`` for the items and scores they exchange, ``reasoning_gym_task`` and ``mixture``).
Building one imports reasoning-gym; importing this package does not.
"""

from __future__ import annotations

from engine.rl.tasks.base import Example, Task
from engine.rl.tasks.chat import ChatMessage, ChatPrompt, ChatTask, EvalSummary, Score, TaskItem, summarise
from engine.rl.tasks.config import MIXTURE_NAME, MixtureEntry, TaskConfig, is_chat_task_name
from engine.rl.tasks.digits import AdditionTask, ReversalTask, SortingTask
from engine.rl.tasks.scoring import RewardKind

_TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (ReversalTask, SortingTask, AdditionTask)}

#: every character that any task's prompts or answers use, in a stable order
ALPHABET = "".join(sorted(set("".join(cls.alphabet for cls in _TASKS.values()))))


def task_names() -> list[str]:
    """The digit tasks (chat tasks are ``reasoning_gym:<dataset>`` and ``mixture``)."""
    return list(_TASKS)


def make_task(config: TaskConfig) -> Task:
    """Build the digit task named by ``config.name``; unknown names raise ``ValueError``."""
    if is_chat_task_name(config.name):
        raise ValueError(f"{config.name!r} is a chat task for a model with a chat template: "
                         "build it with make_chat_task")
    try:
        cls = _TASKS[config.name]
    except KeyError:
        raise ValueError(f"unknown task {config.name!r} (choose from {', '.join(_TASKS)}, "
                         "reasoning_gym:<dataset> or mixture)") from None
    return cls(config)


def make_chat_task(config: TaskConfig) -> ChatTask:
    """Build a ``reasoning_gym:<dataset>`` or ``mixture`` task (imports reasoning-gym).

    Raises ``ValueError`` for a digit task, an unknown dataset or bad options, and
    ``TaskUnavailable`` (with the pip command) when reasoning-gym is not installed.
    """
    if not is_chat_task_name(config.name):
        raise ValueError(f"{config.name!r} is a digit task: build it with make_task")
    if config.name == MIXTURE_NAME:
        from engine.rl.tasks.mixture import MixtureTask

        return MixtureTask(config)
    from engine.rl.tasks.reasoning_gym_task import ReasoningGymTask

    return ReasoningGymTask(config)


__all__ = ["ALPHABET", "ChatMessage", "ChatPrompt", "ChatTask", "EvalSummary", "Example", "MixtureEntry",
           "RewardKind", "Score", "Task", "TaskConfig", "TaskItem", "is_chat_task_name", "make_chat_task",
           "make_task", "summarise", "task_names"]
