"""A real ``polis coordinator`` that places nodes by compute alone: the baseline of bandwidth placement.

``python -m tests.support.no_bandwidth_placement polis-args...`` (:func:`coordinator_argv` builds it)
runs the real coordinator with ``engine.swarm.bandwidth_placement`` switched off in this process only:
joins keep the compute rules' stage, no node is moved for its uplink, routes pair replicas by id.
Slow-uplink tests measure what the placement buys against it.

What it does not know: anything else about the coordinator.
"""

from __future__ import annotations

import sys


def coordinator_argv(*polis_args: str) -> list[str]:
    """argv of a real ``polis coordinator`` process (``polis_args``) without bandwidth placement."""
    return [sys.executable, "-m", "tests.support.no_bandwidth_placement", *polis_args]


def main(argv: list[str]) -> int:
    from engine.swarm.bandwidth_placement import BandwidthPlacement

    BandwidthPlacement.propose_move = lambda self, stages, fits, version_s: None  # type: ignore[method-assign]
    BandwidthPlacement.join_stage = lambda self, peer, choice, *rest: choice  # type: ignore[method-assign]
    BandwidthPlacement.route_key = lambda self, *args: False  # type: ignore[method-assign]
    from engine.cli import main as polis_main

    return polis_main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
