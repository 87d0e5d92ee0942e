"""The coordinator's turn driver when a continuation goes wrong: a cache miss or a lost node recomputes the
prefix; too many failures give the group up and queue its prompt again; kept caches are released.

A scripted swarm (``RecordingLinks``) answers the generation jobs; the run task is a real
``EnvRunTask`` over the tiny tied model's codec (no model computes here).
"""

from __future__ import annotations

import asyncio
from typing import Iterator, Mapping

import pytest

from engine.envs.contract import Environment, EpisodeItem, EpisodeLimits, EpisodeState, Message
from engine.rl.codec import ChatCodec
from engine.rl.env_run_task import EnvRunTask
from engine.rl.rollout import SamplingConfig
from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm.episodes import MAX_TURN_ATTEMPTS
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.scheduler import GenerationScheduler
from engine.swarm.store import Store
from tests.support.recording_links import RecordingLinks
from tests.support.tiny_tied_llama import write_tiny_tied_llama

ROUTE = ["peer0000", "peer1111"]
END = 2  # <|im_end|>


class TwoTurns(Environment):
    name = "two_turns"

    def train_items(self, seed: int) -> Iterator[EpisodeItem]:
        n = 0
        while True:
            n += 1
            yield EpisodeItem(f"q{n}", (Message("user", f"What is {n} + 1?"),), str(n + 1))

    def eval_items(self) -> list[EpisodeItem]:
        return [EpisodeItem("e", (Message("user", "What is 0 + 1?"),), "1", held_out=True)]

    def respond(self, state: EpisodeState, model_text: str) -> Message | None:
        return Message("tool", "ok") if state.turns == 1 else None

    def score(self, state: EpisodeState) -> Mapping[str, float]:
        return {"answer": 1.0 if state.turns == 2 else 0.0}


@pytest.fixture()
def parts(tmp_path):
    codec = ChatCodec.from_dir(write_tiny_tied_llama(tmp_path / "tiny"))
    task = EnvRunTask(TwoTurns(), codec, EpisodeLimits(max_turns=3, max_context_tokens=256))
    store = Store(tmp_path / "c.db")
    store.record_eval(0, 0.0, 1)  # the "before" eval is done: training may start
    run = RunConfig(group_size=2, prompts_per_step=1, prompts_per_job=1, generations_in_flight=1,
                    sampling=SamplingConfig(temperature=1.0, max_new_tokens=8))
    links = RecordingLinks(ROUTE)
    book = RunBook(store)
    scheduler = GenerationScheduler(run, UpdateRules(objective=run.objective), task, store, book,
                                    EvalScheduler(task, store), links, vocab_size=codec.vocab_size)
    yield scheduler, store, links, book
    store.close()


def _gens(links) -> list[messages.Gen]:
    out = [m for _, m in links.sent if isinstance(m, messages.Gen)]
    links.sent[:] = [(p, m) for p, m in links.sent if not isinstance(m, messages.Gen)]
    return out


def _done(gen: messages.Gen) -> messages.GenDone:
    rows = len(gen.prompt_ids)
    return messages.GenDone(job=gen.job, tokens=[[40, 41, END]] * rows, logprobs=[[-0.5, -0.4, -0.1]] * rows,
                            versions=[0, 0])


def test_a_cache_miss_and_a_lost_node_recompute_the_prefix_and_every_kept_cache_is_released(parts):
    scheduler, store, links, book = parts

    async def scenario():
        await scheduler.fill()
        (first,) = _gens(links)
        assert len(first.prompt_ids) == 2 and not first.params.keep_cache  # turn 1: the group's rows together
        scheduler.on_gen_done(ROUTE[1], _done(first))
        await asyncio.sleep(0.05)
        second = {g.job: g for g in _gens(links)}
        assert len(second) == 2
        for g in second.values():  # each episode goes on alone, its whole prefix recomputed, its caches kept
            assert g.params.turn == 1 and g.params.cached_tokens == 0 and g.params.keep_cache
            assert len(g.prompt_ids) == 1 and len(g.prompt_ids[0]) > len(first.prompt_ids[0])
        a, b = sorted(second)
        scheduler.on_job_failed(ROUTE[0], a, "cache miss: this stage holds 0 tokens of the job, the turn expects 9")
        await asyncio.sleep(0.05)
        (retry,) = _gens(links)
        assert retry.job == f"{a}.r1" and retry.params.cached_tokens == 0 and retry.prompt_ids == second[a].prompt_ids
        assert book.counters["cache_misses"] == 1
        scheduler.on_node_lost(ROUTE[1])  # b's turn was running there: b goes out again
        await asyncio.sleep(0.05)
        again = _gens(links)
        assert [g.params.cached_tokens for g in again] == [0, 0]  # both recomputed (the retry was on that route too)
        for g in again:
            scheduler.on_gen_done(ROUTE[1], _done(g))
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    rollouts = store.ready_rollouts(limit=10)
    assert len(rollouts) == 2 and all(r.reward == 1.0 for r in rollouts)
    for r in rollouts:  # model turn, the tool's answer (context), the model's last turn, the template's "\n"
        mask = r.loss_mask.astype(int).tolist()
        assert mask[:3] == [1, 1, 1] and mask[-4:] == [1, 1, 1, 0] and 0 in mask[3:-4]
    released = [m.job for _, m in links.sent if isinstance(m, messages.GenRelease)]
    assert len(released) == 2  # each episode's last job kept its caches until the episode ended


def test_a_group_whose_turns_keep_failing_is_given_up_and_its_prompt_goes_back_to_the_queue(parts):
    scheduler, store, links, book = parts

    async def scenario():
        await scheduler.fill()
        (first,) = _gens(links)
        scheduler.on_gen_done(ROUTE[1], _done(first))
        await asyncio.sleep(0.05)
        for _ in range(MAX_TURN_ATTEMPTS):
            gens = _gens(links)
            if not gens:
                break
            scheduler.on_job_failed(ROUTE[0], gens[0].job, "out of memory")
            await asyncio.sleep(0.05)
        assert book.counters["episode_batches_given_up"] == 1
        assert not scheduler.jobs
        assert len(scheduler._retry_prompts) == 1
        assert scheduler.task._prompts.item(scheduler._retry_prompts[0]) is not None
        assert book.counters["failed_turns"] == MAX_TURN_ATTEMPTS

    asyncio.run(scenario())
    assert store.ready_rollouts(limit=10) == []
