"""A real ``polis coordinator`` with the route weights switched off: the equal-shares baseline.

``python -m tests.support.equal_shares polis-args...`` (:func:`coordinator_argv` builds it) runs
the real coordinator with every route credited the same speed in this process only
(``engine.swarm.route_weights.RouteWeights``): generation jobs go to every route in turn and
each training route gets an equal share of a pass's rows, as before routes were weighted. Hedging
stays on. Slow-node tests measure what the weighting buys against it.

What it does not know: anything else about the coordinator.
"""

from __future__ import annotations

import sys


def coordinator_argv(*polis_args: str) -> list[str]:
    """argv of a real ``polis coordinator`` process (``polis_args``) that shares work equally."""
    return [sys.executable, "-m", "tests.support.equal_shares", *polis_args]


def main(argv: list[str]) -> int:
    from engine.swarm.route_weights import RouteWeights

    RouteWeights.gen_rate = lambda self, route: 1.0  # type: ignore[method-assign]
    RouteWeights.train_rate = lambda self, route: 1.0  # type: ignore[method-assign]
    from engine.cli import main as polis_main

    return polis_main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
