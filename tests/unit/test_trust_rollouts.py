"""Finding 4 of issue 14: rollouts are checked at ingestion and a poisoned batch cannot stall training.

Real generation scheduler, step runner, store and codec; the swarm is a recording outbox.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.swarm import messages
from engine.swarm.rollout_checks import RefusedResult, RolloutLimits, check_result
from tests.support.recording_links import RecordingLinks
from tests.support.scheduling_parts import scheduling_parts

ROUTE = ["peer-s0", "peer-s1"]
LIMITS = RolloutLimits(vocab_size=40, stop_ids=frozenset({2}), max_new_tokens=8)


def test_check_result_refuses_what_no_honest_sampler_sends_and_cuts_at_the_stop_id():
    ok = check_result([[5, 6, 2, 7, 7]], [[-0.5, -0.2, 0.0, -1.0, -1.0]], [3, 3], LIMITS, current_version=3)
    assert ok.tokens == [[5, 6, 2]] and ok.logprobs == [[-0.5, -0.2, 0.0]] and ok.versions == [3, 3]
    assert check_result([[5]], [[5e-5]], [0, 0], LIMITS, 0).logprobs == [[0.0]]  # rounding of log-softmax
    for tokens, logprobs, versions, why in (
            ([[5, 2, 40]], [[-1.0, -1.0, -1.0]], [0, 0], "vocabulary"),  # out of vocabulary after EOS
            ([[5, 2]], [[-1.0, -1.0]], [2**40, 0], "version"),
            ([[5, 2]], [[0.5, -1.0]], [0, 0], "positive"),
            ([[5] * 9], [[-1.0] * 9], [0, 0], "budget")):
        with pytest.raises(RefusedResult, match=why):
            check_result(tokens, logprobs, versions, LIMITS, current_version=0)


def test_the_hostile_nodes_forged_results_break_an_ingestion_rule_or_only_the_log_probs():
    """What ``tests.support.hostile_node``'s ``forges_rollouts`` sends: the first two forgeries are
    refused at ingestion, the third passes it (only the log-prob audit can catch it)."""
    from tests.support.hostile_node import FORGED_LOGPROB, ROLLOUT_FORGERIES, forged_result

    honest = messages.GenDone(job="t3", tokens=[[5, 6, 2], [7, 7, 7]], logprobs=[[-0.5, -0.2, 0.0], [-1.0] * 3],
                              versions=[3, 3])
    forged = {f: forged_result(honest, f, vocab_size=LIMITS.vocab_size, stop_id=2) for f in ROLLOUT_FORGERIES}
    for forgery, why in (("ids_after_stop", "vocabulary"), ("future_version", "version")):
        m = forged[forgery]
        with pytest.raises(RefusedResult, match=why):
            check_result(m.tokens, m.logprobs, m.versions, LIMITS, current_version=3)
    assert forged["ids_after_stop"].tokens == [[5, 6, 2, 40, 41], [7, 7, 7, 2, 40, 41]]
    m = forged["forged_logprobs"]
    passed = check_result(m.tokens, m.logprobs, m.versions, LIMITS, current_version=3)
    assert passed.tokens == [[5, 6, 2], [7, 7, 7]] and {lp for row in passed.logprobs for lp in row} == {FORGED_LOGPROB}


@pytest.fixture()
def parts(tmp_path):
    p = scheduling_parts(tmp_path / "c.db", RecordingLinks(ROUTE))
    yield p.generation, p.steps, p.store, p.links, p.codec, p.task
    p.store.close()


def test_a_last_stage_that_appends_out_of_vocabulary_ids_and_a_future_version_is_refused_and_flagged(parts):
    generation, steps, store, links, codec, task = parts
    asyncio.run(generation.fill())
    job = links.sent[0][1]
    rows, prompts = len(job.prompt_ids), generation.jobs[job.job].prompts
    tokens = [codec.encode("12") + [codec.eos_id, codec.vocab_size + 7] for _ in range(rows)]
    forged = messages.GenDone(job=job.job, tokens=tokens, logprobs=[[-0.1] * 4] * rows, versions=[2**40, 2**40])
    generation.on_gen_done(ROUTE[1], forged)
    assert store.ready_group_count() == 0 and not generation.jobs
    assert generation.flagged[ROUTE[1]] == 1 and generation.book.counters["refused_results"] == 1
    assert generation.book.version == 0
    links.sent.clear()
    asyncio.run(generation.fill())  # the prompts go out again
    assert [j.prompts for j in generation.jobs.values()] == [prompts]


def _add_group(store, codec, rewards):
    store.add_rollouts([dict(group_id="g0:0", prompt="1+1", tokens=codec.encode("2") + [codec.eos_id],
                             behaviour_logprobs=[-0.3, -0.1], versions=[0, 0], min_version=0, reward=r,
                             advantage=0.0) for r in rewards])


def test_a_batch_that_nodes_refuse_is_quarantined_after_one_attempt_and_never_retaken(parts):
    generation, steps, store, links, codec, task = parts
    _add_group(store, codec, [1.0, 0.0, 0.0, 1.0])

    def refuse(peer, message):
        if isinstance(message, messages.TrainIn):
            steps.microbatches.on_mb_failed(peer, messages.MbFailed(step=message.step, mb=message.mb,
                                                                    reason="token id outside the embedding"))
    links.on_send = refuse
    assert asyncio.run(steps.maybe_train()) is False
    assert store.rollout_counts() == {"quarantined": 4}
    assert steps.book.counters["quarantined_rollouts"] == 4 and steps.book.counters["aborted_steps"] == 1
    assert asyncio.run(steps.maybe_train()) is False and steps.book.counters["aborted_steps"] == 1  # not retaken


def test_a_batch_that_failed_for_a_lost_node_gets_one_more_try_then_is_quarantined(parts):
    generation, steps, store, links, codec, task = parts
    _add_group(store, codec, [1.0, 0.0, 0.0, 1.0])

    def lose(peer, message):
        if isinstance(message, messages.TrainIn):
            steps.microbatches.on_node_lost(peer)
    links.on_send = lose
    assert asyncio.run(steps.maybe_train()) is False
    assert store.rollout_counts() == {"ready": 4}  # an honest failure: the rollouts stay
    assert asyncio.run(steps.maybe_train()) is False
    assert store.rollout_counts() == {"quarantined": 4} and steps.book.counters["aborted_steps"] == 2


def test_a_result_of_the_version_being_applied_is_taken_while_stepped_is_on_its_way(parts):
    """Trainers step before the coordinator records the version: a job one of them sampled at
    that version in between is honest (it was refused as "newer than the run's", 45 in one run);
    one version further is still refused."""
    generation, steps, store, links, codec, task = parts
    asyncio.run(generation.fill())
    jobs = [m for _, m in links.sent if isinstance(m, messages.Gen)]
    generation.book.begin_apply(1)  # told to step to 1; no 'stepped' yet, the book still says 0
    rows = len(jobs[0].prompt_ids)
    done = messages.GenDone(job=jobs[0].job, tokens=[codec.encode("2") + [codec.eos_id]] * rows,
                            logprobs=[[-0.1, -0.1]] * rows, versions=[1, 1])
    generation.on_gen_done(ROUTE[1], done)
    assert generation.book.counters["refused_results"] == 0 and generation.received_rollouts == rows
    assert generation.book.version == 0
    links.sent.clear()
    asyncio.run(generation.fill())
    job = next(m for _, m in links.sent if isinstance(m, messages.Gen))
    ahead = messages.GenDone(job=job.job, tokens=[codec.encode("2") + [codec.eos_id]] * len(job.prompt_ids),
                             logprobs=[[-0.1, -0.1]] * len(job.prompt_ids), versions=[2, 2])
    generation.on_gen_done(ROUTE[1], ahead)
    assert generation.book.counters["refused_results"] == 1
