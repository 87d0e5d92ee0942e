"""Registry of verifiable tasks: ``make_task(TaskConfig(name=...))``.

Tasks: ``reversal``, ``sorting``, ``addition`` (see ``digits``). Rewards from tokens are in
``rewards``. ``ALPHABET`` is every character any task uses; the base checkpoint's
tokenizer covers it.
"""

from __future__ import annotations

from engine.rl.tasks.base import Example, Task, TaskConfig
from engine.rl.tasks.digits import AdditionTask, ReversalTask, SortingTask
from engine.rl.tasks.scoring import RewardKind

_TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (ReversalTask, SortingTask, AdditionTask)}

#: every character that any task's prompts or answers use, in a stable order
ALPHABET = "".join(sorted(set("".join(cls.alphabet for cls in _TASKS.values()))))


def task_names() -> list[str]:
    return list(_TASKS)


def make_task(config: TaskConfig) -> Task:
    """Build the task named by ``config.name``; unknown names raise ``ValueError``."""
    try:
        cls = _TASKS[config.name]
    except KeyError:
        raise ValueError(f"unknown task {config.name!r} (choose from {', '.join(_TASKS)})") from None
    return cls(config)


__all__ = ["ALPHABET", "Example", "RewardKind", "Task", "TaskConfig", "make_task", "task_names"]
