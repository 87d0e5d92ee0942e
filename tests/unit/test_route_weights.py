"""Slow routes get work in proportion to their measured speed (issue 15 point 5), with fake timings.

The clock of :class:`RouteWeights` is a test variable, so every figure below is exact.
"""

from __future__ import annotations

import pytest

from engine.swarm.route_weights import FLOOR, HEDGE_FACTOR, HEDGE_MIN_S, MAX_ROUTES, RouteWeights

FAST, SLOW = ("a0", "b0"), ("a1", "b1")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _measured(fast_job_s: float = 1.0, slow_job_s: float = 4.0) -> tuple[RouteWeights, Clock]:
    """One job each, with one job in flight on each route while it ran."""
    clock = Clock()
    weights = RouteWeights(clock=clock)
    weights.gen_started("f", FAST, load=1)
    weights.gen_started("s", SLOW, load=1)
    clock.now += fast_job_s
    weights.gen_finished("f", row_tokens=64)
    clock.now += slow_job_s - fast_job_s
    weights.gen_finished("s", row_tokens=64)
    return weights, clock


def test_a_route_through_a_4x_slower_node_gets_a_quarter_of_the_jobs_the_buffer_allows():
    weights, _ = _measured()
    assert weights.gen_rate(FAST) == pytest.approx(1.0) and weights.gen_rate(SLOW) == pytest.approx(0.25)
    load = {FAST: 0, SLOW: 0}
    limits = {FAST: 100, SLOW: 100}
    for k in range(10):  # ten jobs to place at once (the replay buffer's room), as the scheduler does
        route = tuple(weights.pick_gen_route([list(FAST), list(SLOW)], load, limits))
        load[route] += 1
        weights.gen_started(f"j{k}", route, load[route])
    assert load == {FAST: 8, SLOW: 2}
    limits[FAST] = 8  # the fast route is at its in-flight limit: the rest go to the slow one
    assert weights.pick_gen_route([list(FAST), list(SLOW)], load, limits) == list(SLOW)
    limits[SLOW] = 2
    assert weights.pick_gen_route([list(FAST), list(SLOW)], load, limits) is None


def test_jobs_placed_one_at_a_time_still_go_a_quarter_to_the_4x_slower_route_and_some_to_a_new_one():
    """The replay buffer often lets one job out at a time: every pick then sees no load anywhere, and
    "where one job finishes soonest" gave the fastest route every job (a second trainer or an inference
    replica never generated, so its rows were never audited either)."""
    weights, _ = _measured()
    routes, given = [list(FAST), list(SLOW)], {FAST: 0, SLOW: 0}
    for k in range(40):
        route = tuple(weights.pick_gen_route(routes, {}, {FAST: 1, SLOW: 1}))
        weights.gen_started(f"j{k}", route, 1)
        weights.gen_abandoned(f"j{k}")  # done before the next is placed (its timing is not the point here)
        given[route] += 1
    assert given == {FAST: 32, SLOW: 8}
    new = ("n0", "n1")  # never measured: as fast as the fastest, from the virtual time (no backlog of credit)
    routes.append(list(new))
    for k in range(20):
        route = tuple(weights.pick_gen_route(routes, {}, {FAST: 1, SLOW: 1, new: 1}))
        weights.gen_started(f"k{k}", route, 1)
        weights.gen_abandoned(f"k{k}")
        given[route] = given.get(route, 0) + 1
    assert given[new] - 0 in (8, 9) and given[FAST] - 32 in (8, 9) and given[SLOW] - 8 in (2, 3), given


def test_a_full_route_saves_no_credit_for_when_it_has_room_again():
    weights, _ = _measured(slow_job_s=1.0)  # two routes alike
    routes = [list(FAST), list(SLOW)]
    for k in range(10):  # the slow route is full: the fast one takes all ten
        assert weights.pick_gen_route(routes, {SLOW: 4}, {FAST: 4, SLOW: 4}) == list(FAST)
        weights.gen_started(f"j{k}", FAST, 1)
    given = {FAST: 0, SLOW: 0}
    for k in range(10):  # room again: they take turns (the one that was full starts one job ahead, from
        route = tuple(weights.pick_gen_route(routes, {}, {FAST: 4, SLOW: 4}))  # the last job's start), no
        weights.gen_started(f"k{k}", route, 1)  # burst of ten to make up for the time it was full
        given[route] += 1
    assert given == {FAST: 4, SLOW: 6}


def test_throughput_is_littles_law_over_the_load_each_job_saw_and_decays():
    weights, clock = _measured()
    weights.gen_started("s2", SLOW, load=4)  # four jobs in flight on the slow route, 4 s each: 1 job/s
    clock.now += 4.0
    weights.gen_finished("s2", row_tokens=64)
    est = weights.gen_estimate(SLOW)
    assert est.jobs_per_s == pytest.approx(0.7 * 0.25 + 0.3 * 1.0)
    assert est.job_s == pytest.approx(4.0) and est.row_tokens_per_s == pytest.approx(0.7 * 16 + 0.3 * 64)
    weights.gen_abandoned("never-started")
    weights.gen_finished("never-started", 1)  # a result nobody dispatched says nothing
    assert weights.gen_estimate(SLOW) == est


def test_a_route_never_measured_counts_as_the_fastest_and_a_slow_one_never_below_the_floor():
    weights, clock = _measured(fast_job_s=1.0, slow_job_s=1000.0)
    assert weights.gen_rate(("new", "route")) == pytest.approx(1.0)  # probed at once
    assert weights.gen_rate(SLOW) == pytest.approx(FLOOR * 1.0)  # still gets a job now and then
    assert RouteWeights().gen_rate(FAST) == 1.0  # nothing measured: every route alike


def test_a_job_far_past_its_routes_time_is_a_straggler_and_its_hedge_avoids_its_nodes():
    weights, _ = _measured(fast_job_s=2.0, slow_job_s=8.0)
    assert not weights.is_straggler(FAST, HEDGE_MIN_S - 0.1)  # 3 x 2 s = 6 s: not yet
    assert not weights.is_straggler(FAST, HEDGE_FACTOR * 2.0 - 0.1)
    assert weights.is_straggler(FAST, HEDGE_FACTOR * 2.0 + 0.1)
    assert not weights.is_straggler(SLOW, 20.0) and weights.is_straggler(SLOW, 24.5)  # its own estimate
    assert weights.is_straggler(("new", "route"), 6.5)  # judged by the fastest measured route
    assert not RouteWeights().is_straggler(FAST, 1e6)  # nothing measured: no idea what late is
    crossed = ("a0", "b1")
    assert weights.hedge_route(SLOW, [list(SLOW), list(crossed), list(FAST)]) == list(FAST)  # no shared node
    assert weights.hedge_route(SLOW, [list(SLOW)]) is None


def test_a_pass_splits_its_rows_by_each_routes_rows_per_second_in_capped_micro_batches():
    weights = RouteWeights()
    routes = [list(FAST), list(SLOW)]
    even = weights.split_rows(routes, 16, 4)  # nothing measured: equal shares
    assert [(a, b) for a, b, _ in even] == [(0, 4), (8, 12), (4, 8), (12, 16)]
    assert [r for _, _, r in even] == [list(FAST), list(SLOW)] * 2  # each route's first micro-batch first
    weights.train_done(FAST, 8, seconds=1.0)
    weights.train_done(SLOW, 8, seconds=4.0)
    plan = weights.split_rows(routes, 20, 8)
    rows = {tuple(r): 0 for r in routes}
    for start, stop, route in plan:
        assert 0 < stop - start <= 8
        rows[tuple(route)] += stop - start
    assert rows == {FAST: 16, SLOW: 4}
    covered = sorted((a, b) for a, b, _ in plan)  # every row once, contiguous
    assert covered[0][0] == 0 and covered[-1][1] == 20 and all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
    assert sum(b - a for a, b, _ in weights.split_rows(routes, 1, 8)) == 1  # fewer rows than routes
    for _ in range(30):
        weights.train_done(SLOW, 1, seconds=1000.0)
    starved = weights.split_rows(routes, 20, 8)
    assert sum(b - a for a, b, r in starved if tuple(r) == SLOW) == 1  # the floor keeps it probed


def test_state_is_bounded():
    weights = RouteWeights()
    for i in range(MAX_ROUTES + 10):
        weights.train_done((f"a{i}", "b"), 1, 1.0)
        weights.gen_started(f"j{i}", (f"a{i}", "b"), 1)
        weights.gen_finished(f"j{i}", 1)
    snap = weights.snapshot(limit=10_000)
    assert len(snap["training"]) == MAX_ROUTES and len(snap["generation"]) == MAX_ROUTES
    with pytest.raises(ValueError):
        RouteWeights(floor=0)
