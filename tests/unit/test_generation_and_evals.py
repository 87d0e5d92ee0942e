"""The coordinator's generation scheduler and eval scheduler together, over a real store.

Eval jobs go out before training rollouts, training rollouts of version 0 wait for the
"before" eval, a lost eval job's prompts go out again, and scored rollouts land in the
replay buffer with the planner's advantages.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from engine.paths import base_checkpoint_dir
from engine.rl.codec import TaskCodec
from engine.rl.objective import ObjectiveConfig
from engine.rl.recipe import BASE_TASK
from engine.rl.run_task import DigitRunTask
from engine.rl.tasks import make_task
from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm.eval_scheduler import EVAL_ROWS, EvalScheduler
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.scheduler import GenerationScheduler
from engine.swarm.store import Store
from tests.support.recording_links import RecordingLinks

ROUTE = ["peer0000", "peer1111"]


@pytest.fixture()
def parts(tmp_path):
    codec = TaskCodec.from_dir(base_checkpoint_dir())
    task_config = replace(BASE_TASK, eval_size=EVAL_ROWS + 8)  # two eval jobs
    run = RunConfig(task=task_config, group_size=4, prompts_per_step=2, prompts_per_job=1, generations_in_flight=3)
    task, store, links = make_task(task_config), Store(tmp_path / "c.db"), RecordingLinks(ROUTE)
    run_task = DigitRunTask(task, codec)
    book, evals = RunBook(store), EvalScheduler(run_task, store)
    rules = UpdateRules(objective=ObjectiveConfig(scale_by_std=True, std_eps=0.5))
    generation = GenerationScheduler(run, rules, run_task, store, book, evals, links, vocab_size=codec.vocab_size)
    yield generation, evals, store, links, codec, task
    store.close()


def _answer(codec, job: messages.Gen, tokens_per_row) -> messages.GenDone:
    rows = len(job.prompt_ids)
    tokens = [tokens_per_row(r) + [codec.eos_id] for r in range(rows)]
    return messages.GenDone(job=job.job, tokens=tokens, logprobs=[[-0.5] * len(t) for t in tokens],
                            versions=[0, 0])


def test_the_before_eval_goes_first_and_training_waits_for_it(parts):
    generation, evals, store, links, codec, task = parts
    asyncio.run(generation.fill())
    jobs = [m for _, m in links.sent]
    assert [j.job[0] for j in jobs] == ["e", "e"]  # both eval jobs, and no training rollouts of version 0 yet
    assert all(j.params.temperature == 0.0 for j in jobs) and all(peer == ROUTE[0] for peer, _ in links.sent)
    assert all(j.params.exact_activations for j in jobs)  # an eval scores the weights, not the wire's rounding
    generation.on_node_lost(ROUTE[1])  # the first eval job's route breaks: its prompts go out again
    assert not generation.jobs and generation.book.counters["failed_jobs"] == 2
    links.sent.clear()
    asyncio.run(generation.fill())
    again = [m for _, m in links.sent]
    assert sorted(len(j.prompt_ids) for j in again) == [8, EVAL_ROWS]
    for job in again:
        generation.on_gen_done(ROUTE[1], _answer(codec, job, lambda r: codec.encode("0000")))
    assert store.evals() and store.evals()[0]["version"] == 0 and store.evals()[0]["n"] == EVAL_ROWS + 8
    assert not evals.running
    links.sent.clear()
    asyncio.run(generation.fill())
    assert [m.job[0] for _, m in links.sent] == ["t"] * 3 and all(len(m.prompt_ids) == 4 for _, m in links.sent)
    assert not any(m.params.exact_activations for _, m in links.sent)  # rollouts use the run's encoding


def test_scored_rollouts_enter_the_buffer_with_the_planners_advantages(parts):
    generation, evals, store, links, codec, task = parts
    store.record_eval(0, 0.1, 10)
    evals.wanted = None
    asyncio.run(generation.fill())
    job = links.sent[0][1]
    prompt = generation.jobs[job.job].prompts[0]
    right = [codec.char_to_id[c] for c in task.solve(prompt)]
    generation.on_gen_done(ROUTE[0], _answer(codec, job, lambda r: right))  # not from the last stage
    assert generation.book.counters["unexpected_results"] == 1 and store.ready_group_count() == 0
    generation.on_gen_done(ROUTE[1], _answer(codec, job, lambda r: right if r == 0 else right[::-1][:1]))
    rows = store.ready_rollouts(10)
    rewards = np.array([[r.reward for r in rows]])
    expected, _ = UpdateRules(objective=ObjectiveConfig(scale_by_std=True, std_eps=0.5)).advantages(rewards)
    np.testing.assert_allclose([r.advantage for r in rows], expected[0], rtol=1e-6)
    assert rewards[0, 0] > rewards[0, 1] and generation.scored_by_peer[ROUTE[0]] == 4



def test_eval_jobs_cross_stage_boundaries_exact_while_rollouts_use_the_runs_encoding():
    import msgspec

    from engine.swarm.generation import _wire_encoding

    base = messages.GenParams(max_new_tokens=4, temperature=1.0, top_p=1.0, seed=1, stop_ids=[2])
    job = messages.Gen(job="e1", route=ROUTE, prompt_ids=[[1]],
                       params=msgspec.structs.replace(base, exact_activations=True))
    received = messages.decode_from_coordinator(messages.encode(job))
    assert _wire_encoding(received.params, "bf16") == "fp32"  # survives the wire and wins over the run's
    assert _wire_encoding(base, "bf16") == "bf16" and _wire_encoding(None, "int8_rowwise") == "int8_rowwise"


def test_a_final_eval_asked_for_while_an_eval_runs_starts_when_that_one_ends(parts):
    from engine.rl.episode_outcome import EvalScore

    _, evals, store, _, _, _ = parts
    store.record_eval(0, 0.1, 10)
    evals.wanted = None
    evals.request(16)
    jobs = []
    while (prompts := evals.next_batch()) is not None:  # round 16 goes out
        jobs.append((f"e-{len(jobs)}", prompts))
        evals.dispatched(*jobs[-1])
    evals.request(24)  # a periodic request while a round runs is dropped: evals must not crowd out training
    assert evals.wanted is None
    evals.request(17, final=True)  # the run reaches max_versions (or is finished) while round 16 runs
    evals.request(16, final=True)  # asking again for the running round changes nothing
    assert evals.running and evals.round.version == 16 and evals.wanted == 17
    for job_id, prompts in jobs:
        evals.on_scores(job_id, [EvalScore(strict=1.0, content=1.0)] * len(prompts), [16, 16])
    assert [e["version"] for e in store.evals()] == [0, 16] and store.get_meta("eval_wanted") == 17
    assert evals.next_batch() is not None and evals.round.version == 17  # the final eval is not lost
