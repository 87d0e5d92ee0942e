"""A straggling generation job is hedged on the fastest other route; the first result wins once.

Real scheduler, store and route weights; the swarm is a recording outbox (2 stages x 2 replicas)
and the test answers as last stages would. Route timings are set on the scheduler's weights.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from engine.paths import base_checkpoint_dir
from engine.rl.codec import TaskCodec
from engine.rl.objective import ObjectiveConfig
from engine.rl.recipe import BASE_TASK
from engine.rl.run_task import DigitRunTask
from engine.rl.tasks import make_task
from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.scheduler import GenerationScheduler
from engine.swarm.store import Store
from tests.support.recording_links import RecordingLinks

GRID = [["a0", "a1"], ["b0", "b1"]]
FAST, SLOW = ["a0", "b0"], ["a1", "b1"]


@pytest.fixture()
def parts(tmp_path):
    codec = TaskCodec.from_dir(base_checkpoint_dir())
    run = RunConfig(task=replace(BASE_TASK, eval_size=8), group_size=4, prompts_per_step=2, prompts_per_job=1,
                    generations_in_flight=1)
    store, links = Store(tmp_path / "c.db"), RecordingLinks.grid(GRID)
    evals = EvalScheduler(DigitRunTask(make_task(run.task), codec), store)
    store.record_eval(0, 0.1, 8)
    evals.wanted = None  # no evals: training jobs only
    generation = GenerationScheduler(run, UpdateRules(objective=ObjectiveConfig()),
                                     DigitRunTask(make_task(run.task), codec), store, RunBook(store), evals, links,
                                     vocab_size=codec.vocab_size)
    clock = [0.0]
    generation.weights._clock = lambda: clock[0]
    for route, seconds in ((FAST, 1.0), (SLOW, 1.0)):  # both routes measured at 1 s a job
        generation.weights.gen_started(f"m{route[0]}", route, 1)
        clock[0] += seconds
        generation.weights.gen_finished(f"m{route[0]}", 16)
    yield generation, links, codec, store
    store.close()


def _answer(codec, gen: messages.Gen) -> messages.GenDone:
    tokens = [[5, codec.eos_id] for _ in gen.prompt_ids]
    return messages.GenDone(job=gen.job, tokens=tokens, logprobs=[[-0.5, -0.5] for _ in tokens], versions=[0, 0])


def _gens(links) -> list[messages.Gen]:
    return [m for _, m in links.sent if isinstance(m, messages.Gen)]


def _straggle(generation, job_id: str, seconds: float = 30.0) -> None:
    generation.jobs[job_id].dispatched -= seconds


def _hedged(generation, links) -> tuple[messages.Gen, messages.Gen]:
    """Fill, let the slow route's job straggle, fill again: ``(the slow job, its twin)``."""
    asyncio.run(generation.fill())
    slow_job = next(g for g in _gens(links) if g.route == SLOW)
    _straggle(generation, slow_job.job)
    asyncio.run(generation.fill())
    return slow_job, _gens(links)[-1]


def test_the_first_result_of_a_hedged_job_wins_and_the_other_is_cancelled_not_scored_twice(parts):
    generation, links, codec, store = parts
    asyncio.run(generation.fill())
    first = {tuple(g.route): g for g in _gens(links)}
    assert set(first) == {tuple(FAST), tuple(SLOW)}  # one job per route (limit 1)
    slow_job = first[tuple(SLOW)]
    _straggle(generation, slow_job.job)

    async def hedge_then_answer():
        await generation.fill()
        twin = _gens(links)[-1]
        assert twin.route == FAST and twin.prompt_ids == slow_job.prompt_ids
        assert twin.params.seed == slow_job.params.seed  # the same rollout where numerics agree
        generation.on_gen_done(FAST[-1], _answer(codec, twin))  # the hedge answers first
        await asyncio.sleep(0)  # the cancel leaves
        generation.on_gen_done(SLOW[-1], _answer(codec, slow_job))  # the straggler's late result
        return twin
    twin = asyncio.run(hedge_then_answer())
    counters = generation.book.counters
    assert counters["hedged_jobs"] == 1 and counters["hedges_cancelled"] == 1
    assert counters["unexpected_results"] == 1  # the loser's result is dropped, not scored
    cancels = [(p, m) for p, m in links.sent if isinstance(m, messages.GenRelease)]
    assert cancels == [(SLOW[0], messages.GenRelease(job=slow_job.job, route=SLOW, cancel=True))]
    assert twin.job not in generation.jobs and slow_job.job not in generation.jobs
    assert generation.received_rollouts == 4 and store.ready_group_count() == 1  # one group of G=4, once
    assert generation._twins == {}


def test_a_hedged_job_that_fails_leaves_its_twin_to_carry_the_rows(parts):
    generation, links, codec, store = parts
    slow_job, twin = _hedged(generation, links)
    generation.on_job_failed(SLOW[0], slow_job.job, "out of memory")
    assert generation.book.counters["failed_jobs"] == 1
    assert not generation._retry_prompts  # its prompt is not queued again: the twin still runs
    generation.on_gen_done(FAST[-1], _answer(codec, twin))
    assert generation.received_rollouts == 4 and store.ready_group_count() == 1


def test_a_job_within_its_routes_expected_time_is_not_hedged(parts):
    generation, links, _, _ = parts
    asyncio.run(generation.fill())
    sent = len(links.sent)
    for job in generation.jobs.values():
        job.dispatched -= 2.0  # past 1 s, but within 3 x 1 s and the 5 s minimum
    asyncio.run(generation.fill())
    assert len(links.sent) == sent and generation.book.counters["hedged_jobs"] == 0


def test_a_job_whose_twin_failed_is_not_hedged_again_every_tick(parts):
    """The twin was refused at once (a real run: 46 twins of one job in a second, one per tick, on
    the same route); the job carries its rows alone and is not hedged a second time."""
    generation, links, codec, store = parts
    slow_job, twin = _hedged(generation, links)
    generation.on_job_failed(FAST[0], twin.job, "refused")
    for _ in range(3):
        asyncio.run(generation.fill())
    assert generation.book.counters["hedged_jobs"] == 1
    assert [g.job for g in _gens(links) if g.prompt_ids == slow_job.prompt_ids] == [slow_job.job, twin.job]
    generation.on_gen_done(SLOW[-1], _answer(codec, slow_job))
    assert generation.received_rollouts == 4
