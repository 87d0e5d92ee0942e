"""The tool-use warm-up: transcripts come from the environment and score as solved, the loss mask
is exactly the assistant tokens, a few SFT steps lower the transcripts' loss, and the warmed
checkpoint (adapters merged) computes what the trained pipeline computed and is reused from cache."""

from __future__ import annotations

import numpy as np
import pytest

from backends.base import LoraConfig, OptimizerConfig
from engine.envs.settings import EnvSettings
from engine.envs.transcripts import arithmetic_expression, tool_transcript, tool_transcripts
from engine.rl.pipeline import LocalPipeline
from engine.rl.run_task import make_run_task
from engine.rl.sft import sft_nll, sft_token_arrays
from engine.rl.tasks import TaskConfig
from engine.rl.tool_warmup import (
    WarmupSettings,
    cached_warm_up,
    evaluate_tool_use,
    transcript_trajectories,
    warm_up,
)
from tests.support.tiny_tied_llama import IM_END, write_tiny_tied_llama

TASK = TaskConfig(name="reasoning_gym:chain_sum", eval_size=8,
                  options={"min_terms": 2, "max_terms": 3, "min_digits": 3, "max_digits": 4})
ENV = EnvSettings(name="calculator", max_turns=4, max_context_tokens=1024)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_tied_llama(tmp_path_factory.mktemp("tiny") / "model", num_layers=2)


@pytest.fixture(scope="module")
def run_task(tiny):
    return make_run_task(TASK, tiny, ENV)


def test_the_expression_of_an_arithmetic_question_is_what_follows_its_colon():
    assert arithmetic_expression("State the final answer to the following arithmetic problem: 12 + 34 - 5 =") \
        == "12 + 34 - 5"


def test_transcripts_are_the_environments_own_solved_episodes_of_training_items(run_task):
    env = run_task.env
    made, skipped = tool_transcripts(env, seed=3, count=6)
    assert len(made) == 6 and skipped == 0
    eval_ids = {i.item_id for i in env.eval_items()}
    for item, result in made:
        assert not item.held_out and item.item_id not in eval_ids
        assert result.messages[:len(item.messages)] == item.messages  # the env's own opening
        call, observation, answer = result.messages[len(item.messages):]
        assert (call.role, observation.role, answer.role) == ("assistant", "tool", "assistant")
        assert observation.content == item.answer  # the env's calculator computed the gold answer
        assert answer.content == f"<answer>{item.answer}</answer>"
        assert result.parts["answer"] == 1.0 and result.parts["tool_use"] > 0 and result.tool_calls == 1
        assert not result.cuts and result.reward == pytest.approx(sum(result.parts.values()))


def test_a_held_out_item_never_becomes_a_transcript(run_task):
    with pytest.raises(ValueError, match="held-out"):
        tool_transcript(run_task.env, run_task.env.eval_items()[0])


def test_a_question_without_an_expression_is_skipped_not_trained(run_task):
    import dataclasses

    item = next(iter(run_task.env.train_items(0)))
    broken = dataclasses.replace(item, messages=(*item.messages[:-1],
                                                 dataclasses.replace(item.messages[-1], content="What now?")))
    assert tool_transcript(run_task.env, broken) is None


def test_the_loss_mask_covers_exactly_the_assistant_turns_of_the_transcript(run_task):
    codec = run_task.codec
    (item, result) = tool_transcripts(run_task.env, seed=1, count=1)[0][0]
    rows, _ = transcript_trajectories(run_task, 1, seed=1)
    traj = rows[0]
    # the whole trajectory is the rendered transcript, and it opens with the rollouts' own prompt ids
    assert codec.decode(traj.ids, skip_special=False) == codec.render(
        [m.as_dict() for m in result.messages], add_generation_prompt=False)
    prompt = run_task.prompt_ids(run_task.key(item))
    assert list(traj.ids[:len(prompt)]) == prompt and not any(traj.mask[:len(prompt)])
    model_turns = [m.content + IM_END for m in result.messages[len(item.messages):] if m.role == "assistant"]
    spans = [codec.decode(traj.ids[a:b], skip_special=False) for a, b in traj.model_spans()]
    assert spans == model_turns
    # the worked example's assistant turns sit in the opening: context, never trained
    assert sum(1 for m in item.messages if m.role == "assistant") == 2


def test_token_rows_train_target_t_where_the_mask_of_id_t_plus_1_is_set():
    inputs, targets, mask = sft_token_arrays([((5, 6, 7, 8), (0, 0, 1, 1)), ((9, 10), (0, 1))], pad_id=0)
    assert inputs.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert targets.tolist() == [[6, 7, 8], [10, 0, 0]]
    assert mask.tolist() == [[False, True, True], [True, False, False]]
    with pytest.raises(ValueError):
        sft_token_arrays([((1, 2), (1, 1))], pad_id=0)  # the first id has no context to be trained on


def test_a_few_warm_up_steps_lower_the_transcripts_loss(tiny, run_task):
    from engine.rl.tool_warmup import _train

    rows, _ = transcript_trajectories(run_task, 8, seed=0)
    held = sft_token_arrays([(t.ids, t.mask) for t in rows[:4]], run_task.pad_id)
    lora = LoraConfig(enabled=True, rank=8, alpha=16.0)
    pipeline = LocalPipeline.from_checkpoint(tiny, 1, "torch", optimizer=OptimizerConfig(lr=3e-3, lora=lora))
    try:
        before = sft_nll(pipeline, *held)
        losses = _train(pipeline, rows, WarmupSettings(steps=4, batch_size=2, micro_batch_rows=1, lr=3e-3),
                        run_task.pad_id, lambda _: None)
        after = sft_nll(pipeline, *held)
    finally:
        pipeline.close()
    assert losses[0] == pytest.approx(sft_nll_of_base(tiny, rows[:2], run_task.pad_id), rel=1e-4)
    assert after < before - 0.1, (before, after, losses)


def sft_nll_of_base(model_dir, rows, pad_id):
    pipeline = LocalPipeline.from_checkpoint(model_dir, 1, "torch")
    try:
        return sft_nll(pipeline, *sft_token_arrays([(t.ids, t.mask) for t in rows], pad_id))
    finally:
        pipeline.close()


def test_the_warmed_checkpoint_is_the_trained_model_and_a_second_run_reuses_it(tiny, run_task, tmp_path):
    settings = WarmupSettings(steps=2, batch_size=2, lr=3e-3, lora_rank=4, lora_alpha=8.0, eval_items=2,
                              max_new_tokens=6)
    out, report = cached_warm_up(tiny, TASK, ENV, settings, tmp_path / "cache")
    assert not report.reused and report.transcripts == 4 and len(report.losses) == 2
    assert report.before is not None and report.before.episodes == 2 and report.after is not None
    rows, _ = transcript_trajectories(run_task, 2, seed=5)
    arrays = sft_token_arrays([(t.ids, t.mask) for t in rows], run_task.pad_id)
    warmed = sft_nll_of_base(out, rows, run_task.pad_id)
    assert warmed != pytest.approx(sft_nll_of_base(tiny, rows, run_task.pad_id), abs=1e-4)  # it trained
    # the same weights as the trained pipeline: retrain in process and compare the loss
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0)
    pipeline = LocalPipeline.from_checkpoint(tiny, 1, "torch", optimizer=OptimizerConfig(lr=3e-3, lora=lora))
    try:
        from engine.rl.tool_warmup import _train

        train_rows, _ = transcript_trajectories(run_task, 4, seed=0)
        _train(pipeline, train_rows, settings, run_task.pad_id, lambda _: None)
        assert sft_nll(pipeline, *arrays) == pytest.approx(warmed, abs=1e-4)
    finally:
        pipeline.close()
    again, second = cached_warm_up(tiny, TASK, ENV, settings, tmp_path / "cache")
    assert again == out and second.reused and second.key == report.key
    other, third = cached_warm_up(tiny, TASK, ENV, WarmupSettings(steps=1, batch_size=2, eval_items=0),
                                  tmp_path / "cache")
    assert other != out and not third.reused and third.before is None


def test_tool_use_figures_count_calls_and_turns_of_greedy_episodes(tiny, run_task):
    pipeline = LocalPipeline.from_checkpoint(tiny, 1, "torch")
    try:
        figures = evaluate_tool_use(pipeline, run_task, 3, max_new_tokens=4)
    finally:
        pipeline.close()
    assert figures.episodes == 3 and 0.0 <= figures.strict <= 1.0
    assert figures.turns_per_episode >= 1.0 and 0.0 <= figures.calling_share <= 1.0


def test_warm_up_refuses_a_run_without_an_environment(tiny, tmp_path):
    with pytest.raises(ValueError, match="environment"):
        warm_up(tiny, TASK, EnvSettings(), WarmupSettings(steps=1, eval_items=0), tmp_path / "out")


def test_the_merge_keeps_every_base_tensor_name(tiny, tmp_path):
    from engine.model.checkpoint import Checkpoint

    out = tmp_path / "w"
    warm_up(tiny, TASK, ENV, WarmupSettings(steps=1, batch_size=1, eval_items=0), out)
    assert sorted(Checkpoint(out).tensor_names) == sorted(Checkpoint(tiny).tensor_names)
    assert np.isfinite(sft_nll_of_base(out, transcript_trajectories(make_run_task(TASK, out, ENV), 1, 2)[0],
                                       2))
