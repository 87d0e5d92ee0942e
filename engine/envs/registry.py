"""The environments a run can name (``RunConfig.env.name``), each built over the run's chat task.

A run names its environment; the coordinator builds it here over the run's chat task (the
question source: items with a question and a gold answer, and the task's own score) and wraps it
for the swarm (``engine.rl.env_run_task``). Adding an environment to the swarm is one entry
in :data:`ENVIRONMENTS` and its name in ``engine.swarm.run_config.EnvSettings.name``.

What it does not know: tokens, models, the swarm.
"""

from __future__ import annotations

from typing import Callable

from engine.envs.contract import Environment
from engine.envs.tool_env import QuestionSource, calculator_environment

#: name -> (the run's chat task as a question source, the tool-use reward weight) -> the environment
ENVIRONMENTS: dict[str, Callable[[QuestionSource, float], Environment]] = {
    "calculator": lambda source, tool_use_weight: calculator_environment(source, worked_example=True,
                                                                         tool_use_weight=tool_use_weight),
}


def make_environment(name: str, source: QuestionSource, *, tool_use_weight: float = 0.05) -> Environment:
    """The environment ``name`` over ``source`` (raises ``ValueError`` for an unknown name)."""
    build = ENVIRONMENTS.get(name)
    if build is None:
        raise ValueError(f"unknown environment {name!r}; the environments are {', '.join(sorted(ENVIRONMENTS))}")
    return build(source, tool_use_weight)
