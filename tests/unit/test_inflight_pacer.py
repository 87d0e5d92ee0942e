"""Jobs in flight per route follow Little's law over measured link RTTs and compute per step."""

from __future__ import annotations

import asyncio

import pytest

from engine.swarm.inflight import DEFAULT_RTT_S, HEADROOM, InFlightPacer

ROUTE = ["stage0aa", "stage1bb"]


def _pacer(compute_s=(0.005, 0.005), rtt_ms=80.0) -> InFlightPacer:
    pacer = InFlightPacer()
    pacer.observe(ROUTE[0], 100 * compute_s[0], 100, {ROUTE[1]: rtt_ms})
    pacer.observe(ROUTE[1], 100 * compute_s[1], 100, {ROUTE[0]: rtt_ms})
    return pacer


def test_a_route_over_an_80_ms_link_needs_its_cycle_over_its_slowest_step_in_jobs():
    pacer = _pacer(rtt_ms=80.0)
    est = pacer.estimate(ROUTE)
    assert est["network_s"] == pytest.approx(0.080)  # two one-way hops = one round trip
    assert est["cycle_s"] == pytest.approx(0.090) and est["c_max_s"] == pytest.approx(0.005)
    assert pacer.limit(ROUTE, ceiling=64) == round(HEADROOM * 0.090 / 0.005)  # 36
    assert pacer.limit(ROUTE, ceiling=8) == 8  # never above the run's setting


def test_on_loopback_a_route_gets_fewer_jobs_than_the_ceiling():
    pacer = _pacer(rtt_ms=1.0)
    assert pacer.limit(ROUTE, ceiling=32) == 5  # 2 x (10 ms + 1 ms) / 5 ms
    assert _pacer(compute_s=(0.002, 0.010), rtt_ms=1.0).limit(ROUTE, 32) == 3  # the slow stage sets the pace


def test_until_every_node_of_a_route_reported_its_compute_the_route_gets_the_ceiling():
    pacer = InFlightPacer()
    assert pacer.limit(ROUTE, 8) == 8
    pacer.observe(ROUTE[0], 0.5, 100, {})
    pacer.observe(ROUTE[1], 0.01, 2, {})  # too few steps to count
    assert pacer.limit(ROUTE, 8) == 8 and pacer.estimate(ROUTE) is None
    pacer.observe(ROUTE[1], 0.5, 100, {})
    assert pacer.estimate(ROUTE)["network_s"] == pytest.approx(DEFAULT_RTT_S)  # no RTT measured yet
    pacer.forget(ROUTE[1])
    assert pacer.limit(ROUTE, 8) == 8


def test_a_hop_nobody_measured_counts_as_the_slowest_hop_measured_in_the_swarm():
    pacer = _pacer(rtt_ms=80.0)  # ROUTE's hops measured at 80 ms
    other = ["c", "d"]
    for peer in other:
        pacer.observe(peer, 100 * 0.005, 100, {})
    assert pacer.estimate(other)["network_s"] == pytest.approx(0.080)  # not a loopback guess
    assert pacer.limit(other, 32) == pacer.limit(ROUTE, 32) > 6


def test_reports_are_averaged_and_each_hop_takes_both_ends_figures():
    pacer = _pacer(rtt_ms=80.0)
    pacer.observe(ROUTE[0], 100 * 0.015, 100, {ROUTE[1]: 120.0})
    assert pacer.hop_rtt_s(*ROUTE) == pytest.approx(0.100)
    assert pacer.estimate(ROUTE)["c_max_s"] == pytest.approx(0.7 * 0.005 + 0.3 * 0.015)
    snap = pacer.snapshot([ROUTE], 8)[0]
    assert snap["limit"] == 8 and snap["route"] == ["stage0aa", "stage1bb"] and snap["network_ms"] == 100.0


def test_the_scheduler_dispatches_up_to_the_pacers_limit(tmp_path):
    from dataclasses import replace

    from engine.paths import base_checkpoint_dir
    from engine.rl.codec import TaskCodec
    from engine.rl.objective import ObjectiveConfig
    from engine.rl.recipe import BASE_TASK
    from engine.rl.run_task import DigitRunTask
    from engine.rl.tasks import make_task
    from engine.rl.update import UpdateRules
    from engine.swarm.eval_scheduler import EvalScheduler
    from engine.swarm.run_book import RunBook
    from engine.swarm.run_config import RunConfig
    from engine.swarm.scheduler import GenerationScheduler
    from engine.swarm.store import Store
    from tests.support.recording_links import RecordingLinks

    codec = TaskCodec.from_dir(base_checkpoint_dir())
    run = RunConfig(task=replace(BASE_TASK, eval_size=8), group_size=4, prompts_per_step=64, prompts_per_job=1,
                    generations_in_flight=32)
    store, links = Store(tmp_path / "c.db"), RecordingLinks(ROUTE)
    evals = EvalScheduler(DigitRunTask(make_task(run.task), codec), store)
    store.record_eval(0, 0.1, 8)
    evals.wanted = None
    generation = GenerationScheduler(run, UpdateRules(objective=ObjectiveConfig()), DigitRunTask(make_task(run.task),
                                     codec), store, RunBook(store), evals, links, vocab_size=codec.vocab_size)
    generation.pacer = _pacer(rtt_ms=1.0)  # loopback: 5 jobs keep the route busy
    asyncio.run(generation.fill())
    assert len(links.sent) == 5
    generation.pacer = _pacer(rtt_ms=80.0)  # continental: 36 would, the ceiling allows 32
    asyncio.run(generation.fill())
    assert len(links.sent) == 32
    store.close()
