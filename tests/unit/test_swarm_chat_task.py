"""The coordinator's side of a chat task on a real-model layout (the tiny tied Llama with a BPE tokenizer).

Prompts go out rendered through the model's chat template with the model's stop set in the gen
params; rewards come from the sampled ids through the task's ``score_tokens``; an eval records the
strict and the content-only score; a task that does not fit the model's tokenizer is refused.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.rl.codec import CodecError
from engine.rl.objective import ObjectiveConfig
from engine.rl.recipe import BASE_TASK
from engine.rl.rollout import SamplingConfig
from engine.rl.run_task import ChatRunTask, make_run_task
from engine.rl.tasks import TaskConfig
from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.scheduler import GenerationScheduler
from engine.swarm.store import Store
from tests.support.recording_links import RecordingLinks
from tests.support.tiny_tied_llama import IM_END, write_tiny_tied_llama
from tests.unit.test_generation_and_evals import ROUTE

pytest.importorskip("reasoning_gym")

CHAIN_SUM = TaskConfig(name="reasoning_gym:chain_sum", eval_size=6,
                       options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_tied_llama(tmp_path_factory.mktemp("tiny-tied"))


@pytest.fixture()
def chat(tmp_path, model_dir):
    task = make_run_task(CHAIN_SUM, model_dir)
    assert isinstance(task, ChatRunTask)
    run = RunConfig(task=CHAIN_SUM, group_size=2, prompts_per_step=2, prompts_per_job=1, generations_in_flight=2,
                    sampling=SamplingConfig(temperature=0.7, max_new_tokens=48))  # room for a worked answer
    store, links = Store(tmp_path / "c.db"), RecordingLinks(ROUTE)
    book, evals = RunBook(store), EvalScheduler(task, store)
    generation = GenerationScheduler(run, UpdateRules(objective=ObjectiveConfig()), task, store, book, evals, links,
                                     vocab_size=task.codec.vocab_size)
    yield task, generation, evals, store, links
    store.close()


def _ids(task: ChatRunTask, text: str, *, stop: bool = True) -> list[int]:
    return task.codec.encode(text) + ([task.codec.tokenizer.token_to_id(IM_END)] if stop else [])


def test_prompts_go_out_through_the_chat_template_with_the_models_stop_set(chat):
    task, generation, _, _, links = chat
    asyncio.run(generation.fill())
    job = links.sent[0][1]
    assert isinstance(job, messages.Gen) and job.job.startswith("e")  # the "before" eval first
    prompts = generation.jobs[job.job].prompts
    assert all(p.startswith("<|im_start|>system\n") and p.endswith("<|im_start|>assistant\n") for p in prompts)
    assert "<answer>" in prompts[0]  # the system turn / worked example ask for the tags
    assert job.prompt_ids == [task.codec.encode(p) for p in prompts]
    assert job.params.stop_ids == [2, 0]  # <|im_end|> (the canonical EOS) first, then <|endoftext|>
    assert job.params.temperature == 0.0


def test_an_eval_records_the_strict_and_the_content_only_score(chat):
    task, generation, _, store, links = chat
    items = {p: task._prompts.item(p) for p in task.eval_prompts()}
    answered = 0
    for _ in range(len(items)):  # eval jobs are one token length each: a few rounds
        asyncio.run(generation.fill())
        for _, job in links.sent:
            prompts = generation.jobs[job.job].prompts
            # every other item answered in tags, the rest state the right answer without them
            tokens = [_ids(task, f"So it is {items[p].answer}. <answer>{items[p].answer}</answer>")
                      if (answered + k) % 2 == 0 else _ids(task, f"So it is {items[p].answer}.")
                      for k, p in enumerate(prompts)]
            answered += len(prompts)
            generation.on_gen_done(ROUTE[1], messages.GenDone(job=job.job, tokens=tokens, versions=[0, 0],
                                                              logprobs=[[-0.5] * len(t) for t in tokens]))
        links.sent.clear()
        if store.evals():
            break
    (record,) = store.evals()
    n = len(items)
    assert answered == n and record["n"] == n and record["accuracy"] == pytest.approx(((n + 1) // 2) / n)
    assert record["content"] == pytest.approx(1.0)


def test_rewards_are_the_tasks_scores_of_the_sampled_ids(chat):
    task, generation, evals, store, links = chat
    store.record_eval(0, 0.0, 1)
    evals.wanted = None
    asyncio.run(generation.fill())
    job = next(m for _, m in links.sent if m.job.startswith("t"))
    (prompt,) = generation.jobs[job.job].prompts
    item = task._prompts.item(prompt)
    answer = item.answer
    right, unfinished = _ids(task, f"<answer>{answer}</answer>"), _ids(task, f"<answer>{answer}</answer>", stop=False)
    generation.on_gen_done(ROUTE[1], messages.GenDone(job=job.job, tokens=[right, unfinished],
                                                      logprobs=[[-0.5] * len(right), [-0.5] * len(unfinished)],
                                                      versions=[0, 0]))
    rewards = [r.reward for r in store.ready_rollouts(10)]
    # a finished well-formed answer earns the small format part on top; one that never ended does not
    assert rewards == pytest.approx([1.0 + CHAIN_SUM.format_weight, 1.0])
    # a person reads the question (not the template) and the answer text (without the stop token)
    assert list(generation.samples) == [{"prompt": item.question, "answer": f"<answer>{answer}</answer>",
                                         "reward": pytest.approx(1.0 + CHAIN_SUM.format_weight), "version": 0,
                                         "turns": [{"role": "assistant", "text": f"<answer>{answer}</answer>"}],
                                         "tool_calls": 0, "cuts": []}]


def test_a_task_that_does_not_fit_the_models_tokenizer_is_refused_with_what_to_do(model_dir):
    from engine.paths import base_checkpoint_dir

    with pytest.raises(CodecError, match="choose a chat task"):
        make_run_task(BASE_TASK, model_dir)
    with pytest.raises(CodecError, match="set model"):
        make_run_task(CHAIN_SUM, base_checkpoint_dir())


def test_a_named_model_is_the_base_imported_in_this_machines_data_dir_or_says_how_to_import_it(
        monkeypatch, tmp_path, model_dir):
    from engine.swarm.stage_loading import base_dir

    monkeypatch.setenv("POLIS_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"polis import tiny-tied --out .*models/tiny-tied"):
        base_dir("/the/flag/default", "tiny-tied")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny-tied").symlink_to(model_dir)
    assert base_dir("/the/flag/default", "tiny-tied") == tmp_path / "models" / "tiny-tied"
    assert base_dir("/the/flag/default", str(model_dir)) == model_dir  # a path is taken as it is
    assert base_dir("/the/flag/default", "") == Path("/the/flag/default")  # no model named: the flag's
    with pytest.raises(ValueError, match="model"):
        RunConfig(model="bad\x01name")
