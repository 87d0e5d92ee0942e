"""A real ``polis coordinator`` that trains only once a given number of trainers are ready.

``python -m tests.support.gated_coordinator TRAINERS polis-args...`` (:func:`coordinator_argv`
builds it; ``Swarm(coordinator_command=...)`` takes it) runs the real coordinator with one change
in this process only: ``StepRunner.maybe_train`` takes no batch until ``TRAINERS`` trainers are
ready at once; from then on it is the real one (a trainer that leaves later does not stop it).
Generation and the "before" eval run meanwhile.

Why: a trainer that joins a stage that has already stepped gets its siblings' weights but not
their AdamW moments, so its next step differs from theirs and the weight votes resync it, then
evict it after three votes. A test whose replicas must all be in the stage from its first update
(to see what they do to each other's steps, not to a latecomer) starts them together behind this gate.

What it does not know: anything else about the coordinator; which trainers a test waits for.
"""

from __future__ import annotations

import sys
from functools import partial


def coordinator_argv(trainers: int, *polis_args: str) -> list[str]:
    """argv of a real ``polis coordinator`` process (``polis_args``) that trains once ``trainers`` are ready."""
    return [sys.executable, "-m", "tests.support.gated_coordinator", str(int(trainers)), *polis_args]


def gate(trainers: int) -> partial:
    """``Swarm(coordinator_command=gate(n))``: the command line of a coordinator gated at ``n`` trainers."""
    return partial(coordinator_argv, trainers)


def main(argv: list[str]) -> int:
    trainers, polis_args = int(argv[0]), argv[1:]
    from engine.swarm.step_runner import StepRunner

    honest_maybe_train, opened = StepRunner.maybe_train, [False]

    async def maybe_train(self) -> bool:
        if not opened[0]:
            opened[0] = sum(len(ids) for ids in self.links.stage_replicas()) >= trainers
            if not opened[0]:
                return False
        return await honest_maybe_train(self)
    StepRunner.maybe_train = maybe_train  # type: ignore[method-assign]
    from engine.cli import main as polis_main

    return polis_main(polis_args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
