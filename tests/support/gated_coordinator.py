"""A real ``polis coordinator`` that trains only once a given number of trainers are ready and settled.

``python -m tests.support.gated_coordinator TRAINERS SETTLE_S polis-args...`` (:func:`coordinator_argv`
builds it; ``Swarm(coordinator_command=gate(...))`` takes it) runs the real coordinator with one
change in this process only: ``StepRunner.maybe_train`` takes no batch until ``TRAINERS`` trainers
have been ready together for ``SETTLE_S`` seconds; from then on it is the real one (a trainer that
leaves later does not stop it). Generation and the "before" eval run meanwhile.

Why: a trainer that joins a stage that has already stepped first catches up (a replica's weights
and AdamW moments, ``engine.swarm.adamw_transfer``), so it takes no part in the steps before. And
replicas that became ready together dial each other at once: a link replaced in its first second
can drop the first gradient share sent on it (the step waits out the share deadline and the
replicas diverge once). A test whose replicas must all be in the
stage from its first update, exchanging every share (to see what they do to each other's steps,
not to a latecomer or a lost message), starts them together behind this gate.

What it does not know: anything else about the coordinator; which trainers a test waits for.
"""

from __future__ import annotations

import sys
import time
from functools import partial


def coordinator_argv(trainers: int, settle_s: float, *polis_args: str) -> list[str]:
    """argv of a real ``polis coordinator`` process (``polis_args``) that trains once ``trainers`` have
    been ready for ``settle_s``."""
    return [sys.executable, "-m", "tests.support.gated_coordinator", str(int(trainers)), str(float(settle_s)),
            *polis_args]


def gate(trainers: int, settle_s: float = 5.0) -> partial:
    """``Swarm(coordinator_command=gate(n))``: the command line of a coordinator gated at ``n`` trainers."""
    return partial(coordinator_argv, trainers, settle_s)


def main(argv: list[str]) -> int:
    trainers, settle_s, polis_args = int(argv[0]), float(argv[1]), argv[2:]
    from engine.swarm.step_runner import StepRunner

    honest_maybe_train = StepRunner.maybe_train
    since: list[float | None] = [None]  #: when ``trainers`` were first ready together (None: not now)
    opened = [False]

    async def maybe_train(self) -> bool:
        if not opened[0]:
            if sum(len(ids) for ids in self.links.stage_replicas()) < trainers:
                since[0] = None
                return False
            since[0] = since[0] or time.monotonic()
            opened[0] = time.monotonic() - since[0] >= settle_s
            if not opened[0]:
                return False
        return await honest_maybe_train(self)
    StepRunner.maybe_train = maybe_train  # type: ignore[method-assign]
    from engine.cli import main as polis_main

    return polis_main(polis_args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
