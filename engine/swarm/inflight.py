"""How many generation jobs to keep in flight on a route: Little's law over measured hops and compute.

A job decodes one token per *cycle*: stage 0 computes and sends activations to
stage 1, ..., the last stage samples and sends the tokens back to stage 0. With
nothing queued a cycle takes

    cycle_s = sum of each stage's compute per step (c_i) + sum over the S hops of one-way delay (rtt / 2)

and the route's slowest stage serves one job-step every ``c_max`` seconds. By
Little's law (jobs in flight = throughput x latency), keeping that stage busy
takes ``cycle_s / c_max`` jobs. :class:`InFlightPacer` keeps

    limit = clamp(ceil(HEADROOM * cycle_s / c_max), 1, ceiling)

jobs on each route, ``ceiling`` being the run's ``generations_in_flight``. Its
inputs come in every node's report: ``gen_compute_s / gen_steps`` (compute-thread
seconds per decoding step, averaged per node) and ``link_rtt_ms`` (SCTP's smoothed
round trip of each link). A hop whose RTT neither end has reported yet counts as the
slowest hop measured in the swarm (``DEFAULT_RTT_S`` before any): a new route on
far links then starts with the jobs they need rather than a loopback guess that
starves it until its nodes report (measured: 6 jobs on an 80 ms route in a demo
that ended before the report); a route with a node that has not reported its
compute gets the ceiling (what the scheduler did before the pacer).

What bounds jobs in flight, in order: this limit; the ceiling; the replay buffer
(the scheduler dispatches training jobs only while ready + in-flight groups stay
under two batches, which also bounds staleness); and, beyond ``cycle_s / c_max``,
the slowest stage (more jobs only queue there). Rows per job are the run's
(``prompts_per_job x group_size``): more rows amortise each hop over more tokens.
Training shares the compute thread, so a stage that also trains serves fewer
job-steps than ``1 / c_max``: the headroom errs towards too many jobs, never too few.

What it does not know: jobs, messages, sockets; it only turns numbers into a limit.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

#: jobs beyond the Little's-law figure, as a factor (measurement noise, training on the same thread)
HEADROOM = 2.0
#: assumed round trip of a hop nobody has measured yet (seconds)
DEFAULT_RTT_S = 0.005
#: weight of a new report in the per-node averages
EWMA_WEIGHT = 0.3
#: fewest job-steps a report must cover to count (a few steps give a noisy average)
MIN_STEPS_PER_REPORT = 4
#: most peers remembered (older ones are forgotten first)
MAX_PEERS = 4096
#: most routes the stats snapshot lists
MAX_SNAPSHOT_ROUTES = 32


class InFlightPacer:
    """Per-node compute and per-link RTT averages, and the in-flight limit of a route."""

    def __init__(self) -> None:
        self._compute_s: dict[str, float] = {}  #: peer -> seconds per decoding step
        self._rtt_s: dict[tuple[str, str], float] = {}  #: (reporter, peer) -> seconds

    def observe(self, peer: str, gen_compute_s: float, gen_steps: float, link_rtt_ms: Mapping[str, float]) -> None:
        """One node's report: compute seconds over ``gen_steps`` steps, and its links' round trips."""
        if gen_steps >= MIN_STEPS_PER_REPORT and gen_compute_s >= 0:
            sample = gen_compute_s / gen_steps
            old = self._compute_s.pop(peer, None)
            self._compute_s[peer] = sample if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * sample
        for other, rtt_ms in link_rtt_ms.items():
            self._rtt_s.pop((peer, other), None)
            self._rtt_s[(peer, other)] = rtt_ms / 1e3
        while len(self._compute_s) > MAX_PEERS:
            self._compute_s.pop(next(iter(self._compute_s)))
        while len(self._rtt_s) > MAX_PEERS:
            self._rtt_s.pop(next(iter(self._rtt_s)))

    def steps_per_s(self) -> dict[str, float]:
        """Each reporting node's decoding steps per second of its stage (stage assignment by capacity)."""
        return {peer: 1.0 / max(s, 1e-6) for peer, s in self._compute_s.items()}

    def forget(self, peer: str) -> None:
        self._compute_s.pop(peer, None)
        for key in [k for k in self._rtt_s if peer in k]:
            del self._rtt_s[key]

    def link_rtts_s(self) -> dict[tuple[str, str], float]:
        """Every link's round trip (seconds) as each end reported it: ``(reporter, other) -> seconds``."""
        return dict(self._rtt_s)

    def hop_rtt_s(self, a: str, b: str) -> float | None:
        """The measured round trip between ``a`` and ``b`` (the mean of both ends' figures), if any."""
        seen = [self._rtt_s[k] for k in ((a, b), (b, a)) if k in self._rtt_s]
        return sum(seen) / len(seen) if seen else None

    def estimate(self, route: list[str]) -> dict[str, float] | None:
        """``cycle_s``, ``c_max_s`` and ``network_s`` of ``route`` (None while a node's compute is unknown)."""
        if any(p not in self._compute_s for p in route):
            return None
        compute = [self._compute_s[p] for p in route]
        if len(route) == 1:
            network = 0.0
        else:
            hops = [(route[i], route[(i + 1) % len(route)]) for i in range(len(route))]
            measured = [self.hop_rtt_s(a, b) for a, b in hops]
            # the slowest hop measured (a scan of every link: only while one of the route's is unmeasured)
            unknown = max(self._rtt_s.values(), default=DEFAULT_RTT_S) if None in measured else 0.0
            network = sum(unknown if rtt is None else rtt for rtt in measured) / 2
        c_max = max(max(compute), 1e-6)
        return {"cycle_s": sum(compute) + network, "c_max_s": c_max, "network_s": network}

    def limit(self, route: list[str], ceiling: int) -> int:
        """Jobs to keep in flight on ``route``: the Little's-law figure with headroom, at most ``ceiling``."""
        est = self.estimate(route)
        if est is None:
            return ceiling
        return max(1, min(ceiling, math.ceil(HEADROOM * est["cycle_s"] / est["c_max_s"])))

    def snapshot(self, routes: list[list[str]], ceiling: int) -> list[dict[str, Any]]:
        """Per route (for the stats API): its limit and the figures behind it, in milliseconds."""
        out = []
        for route in routes[:MAX_SNAPSHOT_ROUTES]:
            est = self.estimate(route)
            out.append({"route": [p[:8] for p in route], "limit": self.limit(route, ceiling), "ceiling": ceiling,
                        **({} if est is None else {k.replace("_s", "_ms"): round(1e3 * v, 3)
                                                   for k, v in est.items()})})
        return out
