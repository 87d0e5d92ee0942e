"""A real ``polis node`` that computes ``FACTOR`` times slower than its machine (slow-node tests).

``python -m tests.support.throttled_node FACTOR polis-args...`` (:func:`node_argv` builds it)
runs the real node with one change in this process only: every call on its compute thread
(decoding steps, training forward/backward, optimiser steps) is followed by a sleep of
``FACTOR - 1`` times the call's own seconds, so the node serves at ``1 / FACTOR`` of its speed
while the sleep leaves the CPU to the other processes (on a shared 2-core machine a CPU-bound
throttle would slow every node). Its link and everything else are the real node's.

What it does not know: what the calls compute; why a test wants a slow node.
"""

from __future__ import annotations

import sys
import time


def node_argv(factor: float, *polis_args: str) -> list[str]:
    """argv of a real ``polis node`` process (``polis_args``, from ``node`` on) at ``1 / factor`` speed."""
    if not factor >= 1:
        raise ValueError("factor must be >= 1 (1: full speed)")
    return [sys.executable, "-m", "tests.support.throttled_node", str(factor), *polis_args]


def throttle(factor: float) -> None:
    """Make every compute-thread call of this process take ``factor`` times its own seconds."""
    from engine.swarm import generation
    from engine.swarm.compute_thread import ComputeThread

    honest_submit = ComputeThread._submit

    def slowed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                time.sleep((factor - 1) * (time.perf_counter() - start))
        return call

    def submit(self, priority, fn, args, kwargs):
        if fn is generation._timed:  # the decoding step it times (its report to the pacer) is the slow one
            return honest_submit(self, priority, fn, (slowed(args[0]), *args[1:]), kwargs)
        return honest_submit(self, priority, slowed(fn), args, kwargs)
    ComputeThread._submit = submit  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    factor, polis_args = float(argv[0]), argv[1:]
    throttle(factor)
    from engine.cli import main as polis_main

    return polis_main(polis_args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
