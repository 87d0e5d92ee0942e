"""Measured throughput of every route, and the shares of work it implies (slow nodes get less).

Generation: each finished job is a sample of its route's throughput by Little's law, jobs per
second = jobs the route held while it ran / the job's seconds (``gen_started`` records the load at
dispatch, ``gen_finished`` the end), kept as a decayed average next to the route's seconds per job
and row-tokens per second. :meth:`RouteWeights.pick_gen_route` shares jobs in proportion to those
rates by stride scheduling (start-time fair queueing): each route has a virtual *pass* that a job
sent to it advances by ``1 / jobs_per_s``, and the next job goes to the route under its in-flight
limit whose pass after one more job is smallest (fewest jobs in flight on a tie). A route through
a node 4x slower takes about a quarter of the jobs whether they are placed together or one at a
time: the replay buffer often lets only one or two jobs out at once, and "the route that would
finish one job soonest" then gave every job to the fastest route, never to a second trainer or an
inference replica (their work, credit and the log-prob audit of what they generate all need
jobs). A route at its limit, or new, starts from the virtual time of the last job sent (it saves
no credit while it cannot take work), so every route fills to its limit when the buffer does not
bound the jobs. A straggler —
a job past ``HEDGE_FACTOR`` times its route's seconds per job and ``HEDGE_MIN_S`` — is worth a
duplicate on the fastest other route (:meth:`RouteWeights.hedge_route`; the scheduler keeps the
first result).

Training: each pass is a sample of each route's rows per second (its rows over the time from its
first micro-batch's dispatch to its last one done; a route that only answered retries is timed from
the retry). :meth:`RouteWeights.split_rows` shares a pass's rows
over the routes in proportion, cut into micro-batches of at most the run's micro-batch rows.

A route not measured yet counts as fast as the fastest known (so it is probed at once), and no
route's rate counts below ``FLOOR`` times the fastest (a slow node still gets work, so it is
measured again and recovers its share when it speeds up). State is bounded (``MAX_ROUTES``, the
least recently updated forgotten first; ``MAX_OPEN_JOBS``).

Rows per generation job stay the run's (``prompts_per_job x group_size``): a slow route gets fewer
jobs, not smaller ones (its rows share the prompts' length buckets and groups).

What it does not know: jobs' contents, messages, nodes' reports, the replica aggregation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

#: weight of a new sample in the decayed averages
EWMA_WEIGHT = 0.3
#: the lowest rate a route counts at, as a fraction of the fastest route's (slow nodes stay probed)
FLOOR = 0.05
#: a generation job past this many times its route's seconds per job is hedged ...
HEDGE_FACTOR = 3.0
#: ... and past this many seconds
HEDGE_MIN_S = 5.0
#: most routes remembered (generation and training, each)
MAX_ROUTES = 256
#: most generation jobs whose dispatch is remembered (the oldest is forgotten first)
MAX_OPEN_JOBS = 4096

Route = tuple[str, ...]


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * sample


@dataclass
class GenEstimate:
    """Decayed figures of one generation route."""

    jobs_per_s: float  #: jobs finished per second (Little's law over each job's load and seconds)
    job_s: float  #: seconds from dispatch to result of one job
    row_tokens_per_s: float  #: generated tokens (all rows) per second
    updated: float = field(default_factory=time.monotonic)


@dataclass
class _Open:
    route: Route
    load: int  #: jobs on the route when this one was sent (itself included)
    started: float


class RouteWeights:
    """Throughput estimates of generation and training routes (see the module docstring)."""

    def __init__(self, *, floor: float = FLOOR, clock=time.monotonic) -> None:
        if not 0 < floor <= 1:
            raise ValueError("floor must be in (0, 1]")
        self.floor, self._clock = floor, clock
        self._gen: dict[Route, GenEstimate] = {}
        self._train: dict[Route, float] = {}  #: route -> rows per second
        self._open: dict[str, _Open] = {}  #: generation job id -> its dispatch
        self._pass: dict[Route, float] = {}  #: route -> its virtual pass (jobs sent / its rate, see the module)
        self._virtual_s = 0.0  #: the pass at which the last job sent started

    # ------------------------------------------------------------------ generation
    def gen_started(self, job: str, route: Sequence[str], load: int) -> None:
        """``job`` left for ``route``, which then held ``load`` jobs (this one included)."""
        key = tuple(route)
        self._open.pop(job, None)
        self._open[job] = _Open(key, max(1, int(load)), self._clock())
        while len(self._open) > MAX_OPEN_JOBS:
            del self._open[next(iter(self._open))]
        start = self._pass.pop(key, self._virtual_s)
        self._virtual_s = max(self._virtual_s, start)
        self._pass[key] = start + 1.0 / self.gen_rate(key)
        _bound(self._pass)

    def gen_finished(self, job: str, row_tokens: int) -> None:
        """``job``'s result came back with ``row_tokens`` generated tokens over all its rows."""
        opened = self._open.pop(job, None)
        if opened is None:
            return
        seconds = max(self._clock() - opened.started, 1e-3)
        old = self._gen.pop(opened.route, None)
        self._gen[opened.route] = GenEstimate(
            jobs_per_s=_ewma(old.jobs_per_s if old else None, opened.load / seconds),
            job_s=_ewma(old.job_s if old else None, seconds),
            row_tokens_per_s=_ewma(old.row_tokens_per_s if old else None, row_tokens * opened.load / seconds),
            updated=self._clock())
        _bound(self._gen)

    def gen_abandoned(self, job: str) -> None:
        """``job`` failed or lost its hedge race: it says nothing about its route's speed."""
        self._open.pop(job, None)

    def gen_estimate(self, route: Sequence[str]) -> GenEstimate | None:
        return self._gen.get(tuple(route))

    def gen_rate(self, route: Sequence[str]) -> float:
        """Jobs per second ``route`` is credited with: measured, floored; unmeasured = the fastest."""
        best = max((e.jobs_per_s for e in self._gen.values()), default=1.0)
        est = self._gen.get(tuple(route))
        return best if est is None else max(est.jobs_per_s, self.floor * best)

    def pick_gen_route(self, routes: Iterable[Sequence[str]], load: dict[Route, int],
                       limits: dict[Route, int]) -> list[str] | None:
        """The route under its limit whose pass after one more job is smallest (None: all are full).
        A full route's pass is lifted to the virtual time: it saves no credit while it takes no work."""
        open_routes = []
        for r in routes:
            key = tuple(r)
            if load.get(key, 0) < limits.get(key, 0):
                open_routes.append(list(r))
            elif key in self._pass:
                self._pass[key] = max(self._pass[key], self._virtual_s)
        if not open_routes:
            return None
        return min(open_routes, key=lambda r: (self._pass.get(tuple(r), self._virtual_s) + 1.0 / self.gen_rate(r),
                                               load.get(tuple(r), 0)))

    def is_straggler(self, route: Sequence[str], elapsed_s: float) -> bool:
        """A job on ``route`` running ``elapsed_s`` is far past its expected time (see the module).
        A route never measured is judged by the fastest measured route's seconds per job."""
        est = self._gen.get(tuple(route))
        expected = est.job_s if est is not None else min((e.job_s for e in self._gen.values()), default=None)
        return expected is not None and elapsed_s > max(HEDGE_MIN_S, HEDGE_FACTOR * expected)

    def hedge_route(self, route: Sequence[str], routes: Iterable[Sequence[str]]) -> list[str] | None:
        """The fastest other route for a duplicate of a straggler on ``route``: fewest nodes shared
        with it, then the highest measured rate (None: no other route)."""
        here = set(route)
        others = [list(r) for r in routes if tuple(r) != tuple(route)]
        if not others:
            return None
        return min(others, key=lambda r: (len(here & set(r)), -self.gen_rate(r)))

    # ------------------------------------------------------------------ training
    def train_done(self, route: Sequence[str], rows: int, seconds: float) -> None:
        """``route`` finished ``rows`` rows of a pass in ``seconds`` (its first dispatch to its last done)."""
        if rows <= 0:
            return
        old = self._train.pop(tuple(route), None)
        self._train[tuple(route)] = _ewma(old, rows / max(seconds, 1e-3))
        _bound(self._train)

    def train_rate(self, route: Sequence[str]) -> float:
        """Rows per second ``route`` is credited with: measured, floored; unmeasured = the fastest."""
        best = max(self._train.values(), default=1.0)
        rate = self._train.get(tuple(route))
        return best if rate is None else max(rate, self.floor * best)

    def split_rows(self, routes: Sequence[Sequence[str]], rows: int,
                   max_rows: int) -> list[tuple[int, int, list[str]]]:
        """A pass's ``rows`` as micro-batches ``(start, stop, route)``: each route's share in proportion
        to its rate (largest remainders; at least one row each while there are enough rows), cut into
        micro-batches of at most ``max_rows``; the first micro-batch of every route comes first."""
        if not routes or rows <= 0:
            return []
        rates = [self.train_rate(r) for r in routes]
        total = sum(rates)
        ideal = [rows * r / total for r in rates]
        shares = [int(x) for x in ideal]
        if rows >= len(routes):
            shares = [max(1, s) for s in shares]
        while sum(shares) > rows:  # the floor of one row overshot: take from the largest
            shares[max(range(len(shares)), key=lambda i: shares[i])] -= 1
        for i in sorted(range(len(routes)), key=lambda i: shares[i] - ideal[i])[:rows - sum(shares)]:
            shares[i] += 1
        per_route: list[list[tuple[int, int, list[str]]]] = []
        start = 0
        for route, share in zip(routes, shares):
            cuts = []
            pieces = -(-share // max(1, max_rows))  # ceil: as few micro-batches as the cap allows
            for k in range(pieces):
                size = share // pieces + (1 if k < share % pieces else 0)
                cuts.append((start, start + size, list(route)))
                start += size
            per_route.append(cuts)
        depth = max((len(c) for c in per_route), default=0)
        return [c[k] for k in range(depth) for c in per_route if k < len(c)]

    # ------------------------------------------------------------------ stats
    def snapshot(self, limit: int = 32) -> dict[str, list[dict]]:
        """Figures per route for the stats API (peer ids cut to 8 characters)."""
        return {
            "generation": [{"route": [p[:8] for p in r], "jobs_per_s": round(e.jobs_per_s, 3),
                            "job_s": round(e.job_s, 3), "row_tokens_per_s": round(e.row_tokens_per_s, 1)}
                           for r, e in list(self._gen.items())[-limit:]],
            "training": [{"route": [p[:8] for p in r], "rows_per_s": round(v, 2)}
                         for r, v in list(self._train.items())[-limit:]],
        }


def _bound(book: dict) -> None:
    while len(book) > MAX_ROUTES:
        del book[next(iter(book))]
