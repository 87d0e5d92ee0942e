"""The in-process trainer on a chat task: the swarm's RunTask samples and scores for it.

On the tiny tied Llama with a BPE tokenizer and a ChatML template: the trainer's prompts are
the coordinator's prompt keys for the same seed (the chat template, the worked example), its
completions end at the model's stop ids, its rewards are the task's ``score_tokens`` of the
decoded ids, and its evals record strict and content-only scores on the swarm's held-out keys.
``polis train``'s config is the coordinator's RunConfig, field by field.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.rl.codec import load_codec
from engine.rl.pipeline import LocalPipeline
from engine.rl.rollout import SamplingConfig
from engine.rl.run_task import ChatRunTask, make_run_task
from engine.rl.tasks import TaskConfig
from engine.rl.trainer import Trainer, TrainerConfig
from tests.support.tiny_tied_llama import write_tiny_tied_llama

pytest.importorskip("reasoning_gym")
pytest.importorskip("torch")

CHAIN_SUM = TaskConfig(name="reasoning_gym:chain_sum", eval_size=4,
                       options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_tied_llama(tmp_path_factory.mktemp("tiny-tied"))


def _trainer(model_dir, **overrides):
    config = TrainerConfig(task=CHAIN_SUM, sampling=SamplingConfig(temperature=1.0, max_new_tokens=12),
                           prompts_per_step=2, group_size=4, micro_batch_rows=4, eval_every_steps=0, seed=3,
                           **overrides)
    pipeline = LocalPipeline.from_checkpoint(model_dir, 2, "torch", "cpu")
    return Trainer(pipeline, load_codec(model_dir), config), pipeline


def test_the_trainer_samples_the_coordinators_prompts_and_scores_them_with_its_task(model_dir):
    trainer, pipeline = _trainer(model_dir)
    try:
        swarm_task = make_run_task(CHAIN_SUM, model_dir)
        assert isinstance(swarm_task, ChatRunTask)
        expected = list(itertools.islice(swarm_task.train_prompts(3), 4))
        groups = trainer.generate()
        assert [g.prompt for g in groups] == expected[:2]  # the same seeded stream as the coordinator's
        assert trainer.next_prompts() == expected[2:]
        assert all(p.startswith("<|im_start|>system\n") and p.endswith("<|im_start|>assistant\n") for p in expected)
        stops = set(swarm_task.stop_ids)
        for g in groups:
            assert g.prompt_ids.tolist() == swarm_task.prompt_ids(g.prompt)
            for s in g.samples:
                ids = [int(t) for t in s.completion_ids]
                assert not set(ids[:-1]) & stops and s.finished == (ids[-1] in stops)
                assert s.reward == pytest.approx(swarm_task.reward(g.prompt, ids))
    finally:
        pipeline.close()


def test_a_chat_eval_records_strict_and_content_on_the_swarms_held_out_keys(model_dir):
    trainer, pipeline = _trainer(model_dir)
    try:
        swarm_task = make_run_task(CHAIN_SUM, model_dir)
        assert trainer._eval_prompts == swarm_task.eval_prompts()
        result = trainer.evaluate()
        assert result.content is not None and 0.0 <= result.exact_match <= result.content <= 1.0
        assert trainer.evals == [result]
    finally:
        pipeline.close()


def test_a_chat_step_trains_when_rewards_differ_and_moves_the_weights(model_dir, monkeypatch):
    trainer, pipeline = _trainer(model_dir)
    try:
        before = [{k: v.copy() for k, v in sd.items()} for sd in pipeline.state_dicts()]
        rewards = itertools.cycle([0.0, 1.0])  # variance in every group, whatever the random model says
        monkeypatch.setattr(trainer.run_task, "reward", lambda prompt, ids: next(rewards))
        log = trainer.step()
        assert log.trained and log.trained_samples == 8 and log.zero_variance_fraction == 0.0
        after = pipeline.state_dicts()
        assert any(not np.array_equal(before[i][k], after[i][k]) for i in range(2) for k in before[i])
    finally:
        pipeline.close()


def test_polis_train_runs_the_coordinators_run_config():
    import argparse

    from engine.swarm.train_command import optimizer_config, run_config, trainer_config

    args = argparse.Namespace(model="smollm2-135m", task=None, set=["lr=1e-05", "seed=7"])
    run = run_config(args)
    # the demo recipe, then --set
    assert run.activation_encoding == "predcoded_s40_gs64_b4" and run.lora.enabled and run.lr == 1e-05
    config = trainer_config(run, lag_versions=1)
    for name in ("task", "objective", "sampling", "prompts_per_step", "group_size", "max_staleness",
                 "max_grad_norm", "micro_batch_rows", "updates_per_batch", "seed"):
        assert getattr(config, name) == getattr(run, name), name
    assert config.lag_versions == run.updates_per_batch
    optimizer = optimizer_config(run)
    assert optimizer.lr == run.lr and optimizer.lora == run.lora.backend_config() and optimizer.trainable
