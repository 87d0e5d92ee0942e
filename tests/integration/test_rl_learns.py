"""RL through real torch stages: a tiny task's reward rises within a bounded number of steps."""

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")

from engine.rl.codec import TaskCodec  # noqa: E402
from engine.rl.make_base import MakeBaseConfig, make_base  # noqa: E402
from engine.rl.pipeline import LocalPipeline  # noqa: E402
from engine.rl.recipe import RL_OPTIMIZER, trainer_config  # noqa: E402
from engine.rl.run_state import RunStateError  # noqa: E402
from engine.rl.tasks import TaskConfig  # noqa: E402
from engine.rl.trainer import Trainer  # noqa: E402

TINY_TASK = TaskConfig(name="reversal", min_digits=3, max_digits=3, eval_size=200)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("POLIS_TORCH_THREADS", "1")
    out = tmp_path_factory.mktemp("base")
    report = make_base(MakeBaseConfig(task=TINY_TASK, target_exact=0.1, max_steps=400), out)
    assert 0.1 <= report.eval_exact < 0.6
    return out, report


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _trainer(base_dir, stages=2, **overrides):
    pipeline = LocalPipeline.from_checkpoint(base_dir, stages, "torch", "cpu", RL_OPTIMIZER)
    config = trainer_config(task=TINY_TASK, prompts_per_step=16, group_size=16, eval_every_steps=0, **overrides)
    return Trainer(pipeline, TaskCodec.from_dir(base_dir), config)


def test_reward_and_held_out_accuracy_rise_through_a_two_stage_pipeline(tiny_base):
    base_dir, report = tiny_base
    trainer = _trainer(base_dir, stages=2)
    start = trainer.evaluate()
    assert start.exact_match == pytest.approx(report.eval_exact)  # same weights, split and decoding
    logs = [trainer.step() for _ in range(40)]
    end = trainer.evaluate()
    first, last = np.mean([s.reward_mean for s in logs[:5]]), np.mean([s.reward_mean for s in logs[-5:]])
    assert last > first + 0.05, (first, last)
    assert end.exact_match >= start.exact_match + 0.15, (start, end)
    assert trainer.pipeline.versions() == (160, 160)  # 4 updates per step on both stages
    assert all(s.masked_fraction == 0.0 for s in logs)  # on-policy: nothing outside the band
    trainer.pipeline.close()


def test_stale_rollouts_are_trained_at_the_configured_lag_and_reported(tiny_base):
    base_dir, _ = tiny_base
    trainer = _trainer(base_dir, stages=1, lag_versions=4, max_staleness=4)
    logs = [trainer.step() for _ in range(4)]
    assert [s.trained for s in logs] == [False, True, True, True]
    assert logs[1].staleness_histogram == {0: 16}
    assert logs[2].staleness_histogram == {4: 16} and logs[3].staleness_histogram == {4: 16}
    assert 0.0 < logs[3].ess <= 1.0
    trainer.pipeline.close()


def test_rollouts_staler_than_the_bound_are_dropped(tiny_base):
    base_dir, _ = tiny_base
    trainer = _trainer(base_dir, stages=1, lag_versions=8, max_staleness=4)
    logs = [trainer.step() for _ in range(5)]
    assert [s.trained for s in logs[:4]] == [False, False, True, True]
    assert logs[3].staleness_histogram == {4: 16} and logs[3].dropped_stale == 0
    assert logs[4].staleness_histogram == {8: 16} and logs[4].dropped_stale == 16 and not logs[4].trained
    trainer.pipeline.close()


def test_learning_state_resumes_from_a_run_directory(tiny_base, tmp_path):
    base_dir, _ = tiny_base
    first = _trainer(base_dir, stages=2, lag_versions=4)
    for _ in range(3):
        first.step()
    first.save(tmp_path / "run")
    second = _trainer(base_dir, stages=2, lag_versions=4)
    second.restore(tmp_path / "run")
    assert second.step_count == 3 and second.pipeline.versions() == first.pipeline.versions()
    for a, b in zip(first.pipeline.state_dicts(), second.pipeline.state_dicts()):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert second.next_prompts() == first.next_prompts()  # RNG streams continue where they were
    assert len(second.queue) == len(first.queue) == 1
    assert [g.prompt for g in second.queue.pending()[0]] == [g.prompt for g in first.queue.pending()[0]]
    assert [s.step for s in second.steps] == [1, 2, 3]
    assert json.loads((tmp_path / "run" / "state.json").read_text())["optimizer_state_saved_for_stages"] == [0, 1]
    for _ in range(2):  # 3 + 2 steps uninterrupted == 3 steps, save, restore, 2 steps: moments included
        first.step()
        second.step()
    for a, b in zip(first.pipeline.state_dicts(), second.pipeline.state_dicts()):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    for a, b in zip(first.pipeline.backends, second.pipeline.backends):
        sa, sb = a.optimizer_state(), b.optimizer_state()
        assert sa.keys() == sb.keys() and all(np.array_equal(sa[k], sb[k]) for k in sa)
    other = _trainer(base_dir, stages=2, lag_versions=0)
    with pytest.raises(RunStateError, match="different trainer configuration"):
        other.restore(tmp_path / "run")
    with pytest.raises(RunStateError, match="missing"):
        other.restore(tmp_path / "nothing")
    for t in (first, second, other):
        t.pipeline.close()


def test_old_run_states_resume_with_fresh_moments_and_corrupt_optimizer_files_are_refused(tiny_base, tmp_path, caplog):
    base_dir, _ = tiny_base
    first = _trainer(base_dir, stages=2, lag_versions=4)
    first.step()
    first.save(tmp_path / "run")
    old = tmp_path / "old"  # as written before backends exported their optimiser state
    shutil.copytree(tmp_path / "run", old)
    state = json.loads((old / "state.json").read_text())
    del state["optimizer_state_saved_for_stages"]
    (old / "state.json").write_text(json.dumps(state))
    for i in range(2):
        (old / f"stage{i}.optimizer.safetensors").unlink()
    second = _trainer(base_dir, stages=2, lag_versions=4)
    with caplog.at_level("WARNING", logger="engine.rl.run_state"):
        second.restore(old)
    assert "moments restart" in caplog.text and second.step_count == 1
    (tmp_path / "run" / "stage1.optimizer.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(RunStateError, match="stage1.optimizer.safetensors: unreadable"):
        _trainer(base_dir, stages=2, lag_versions=4).restore(tmp_path / "run")
    from safetensors.numpy import save_file

    save_file({"model.norm.weight.exp_avg": np.zeros(3, np.float32)},
              str(tmp_path / "run" / "stage1.optimizer.safetensors"))
    third = _trainer(base_dir, stages=2, lag_versions=4)
    with pytest.raises(RunStateError, match="refused by the backend.*missing"):
        third.restore(tmp_path / "run")
    for t in (first, second, third):
        t.pipeline.close()


def test_shuffled_rewards_carry_no_signal(tiny_base):
    base_dir, _ = tiny_base
    trainer = _trainer(base_dir, stages=1, shuffle_rewards=True)
    start = trainer.evaluate()
    for _ in range(15):
        trainer.step()
    assert trainer.evaluate().exact_match <= start.exact_match + 0.05
    trainer.pipeline.close()


def test_kl_to_a_frozen_reference_starts_at_zero_and_grows(tiny_base):
    from engine.rl.objective import ObjectiveConfig

    base_dir, _ = tiny_base
    reference = LocalPipeline.from_checkpoint(base_dir, 1, "torch", "cpu")
    pipeline = LocalPipeline.from_checkpoint(base_dir, 1, "torch", "cpu", RL_OPTIMIZER)
    config = trainer_config(task=TINY_TASK, prompts_per_step=8, group_size=16, eval_every_steps=0,
                            updates_per_batch=1, objective=ObjectiveConfig(scale_by_std=True, kl_coef=0.05))
    trainer = Trainer(pipeline, TaskCodec.from_dir(base_dir), config, reference=reference)
    logs = [trainer.step() for _ in range(3)]
    assert logs[0].kl < 1e-9 < logs[2].kl  # identical weights at first, then the policy moves away
    with pytest.raises(ValueError, match="reference"):
        Trainer(pipeline, TaskCodec.from_dir(base_dir), config)
    pipeline.close()
    reference.close()


def test_pipeline_gradients_can_be_read_replaced_and_stepped(tiny_base):
    base_dir, _ = tiny_base
    pipeline = LocalPipeline.from_checkpoint(base_dir, 2, "torch", "cpu", RL_OPTIMIZER)
    codec = TaskCodec.from_dir(base_dir)
    ids = np.array([codec.encode_prompt("rev:123=") + codec.encode("321") + [codec.eos_id]])
    logp = pipeline.token_logprobs(ids[:, :-1], ids[:, 1:], key="k")
    pipeline.backward("k", np.full_like(logp, -1.0 / logp.size))
    grads = pipeline.grads()
    norms = pipeline.grad_sq_norms()
    assert len(grads) == 2 and all(n > 0 for n in norms)
    pipeline.set_grads([{k: 2 * v for k, v in g.items()} for g in grads])
    assert pipeline.grad_sq_norms() == pytest.approx([4 * n for n in norms], rel=1e-5)
    before = pipeline.state_dicts()
    pipeline.step()
    assert pipeline.versions() == (1, 1) and pipeline.grad_sq_norms() == [0.0, 0.0]
    after = pipeline.state_dicts()
    assert any(not np.array_equal(before[0][k], after[0][k]) for k in before[0])
    pipeline.close()


def test_each_stage_steps_with_its_own_gradient_scale(tiny_base):
    base_dir, _ = tiny_base
    pipeline = LocalPipeline.from_checkpoint(base_dir, 2, "torch", "cpu", RL_OPTIMIZER)
    codec = TaskCodec.from_dir(base_dir)
    ids = np.array([codec.encode_prompt("rev:123=") + codec.encode("321") + [codec.eos_id]])
    logp = pipeline.token_logprobs(ids[:, :-1], ids[:, 1:], key="k")
    pipeline.backward("k", np.full_like(logp, -1.0 / logp.size))
    before = pipeline.state_dicts()
    with pytest.raises(ValueError):
        pipeline.step([1.0])  # one scale per stage
    pipeline.step([0.0, 1.0])  # AdamW on a zero gradient moves nothing (no weight decay in the recipe)
    after = pipeline.state_dicts()
    assert pipeline.versions() == (1, 1)
    assert all(np.array_equal(before[0][k], after[0][k]) for k in before[0])
    assert any(not np.array_equal(before[1][k], after[1][k]) for k in before[1])
    pipeline.close()
