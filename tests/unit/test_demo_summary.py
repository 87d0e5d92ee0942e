"""``polis demo --json``'s summary: the step-time split, seconds per version and samples trained
come from the coordinator's step log and version records (its admin stats); the real-model recipe is what the demo
sends (bf16 activations, 4-prompt steps, checkpoints with every eval)."""

from __future__ import annotations

import argparse

from engine.swarm.demo import REAL_MODEL_SETTINGS, VersionTimes, _summary, real_model_settings


def _stats(**changes):
    stats = {
        "evals": [{"version": 0, "accuracy": 0.25, "content": 0.3, "n": 4},
                  {"version": 8, "accuracy": 0.5, "content": 0.55, "n": 4}],
        "rollouts": {"consumed": 64}, "received_rollouts": 64, "version": 9, "model": "m", "lora_rank": 16,
        "steps": [{"version": 1, "seconds": 10.0, "train_s": 9.0, "apply_s": 1.0},
                  {"version": 2, "seconds": 20.0, "train_s": 17.0, "apply_s": 3.0}],
        "counters": {"train_jobs_done": 2, "train_job_seconds": 50.0}, "self_reported": {"bytes_sent": 1e6},
        "credit_totals": {"tokens_generated": 1000}, "samples_trained": 56,
        "update_bytes": 0, "dense_update_bytes": 0, "staleness_histogram": {"0": 3},
        "task": "reasoning_gym:chain_sum", "versions": [{"version": 1, "samples": 32}, {"version": 2, "samples": 24}],
    }
    stats.update(changes)
    return stats


def test_the_summary_splits_a_step_and_counts_samples_and_seconds_per_version():
    times = VersionTimes()
    for version, t in ((0, 0.0), (1, 100.0), (1, 150.0), (2, 160.0), (5, 400.0)):
        times.see(version, t)
    summary = _summary(_stats(), 500.0, argparse.Namespace(stages=2, replicas=1), times)
    assert summary["step_seconds_mean"] == 15.0
    assert summary["step_train_seconds_mean"] == 13.0 and summary["step_apply_seconds_mean"] == 2.0
    assert summary["seconds_per_version"] == 75.0  # version 1 first seen at 100 s, version 5 at 400 s
    assert summary["samples_trained"] == 56
    assert summary["eval_before_content"] == 0.3 and summary["eval_after_content"] == 0.55
    assert summary["train_job_seconds_mean"] == 25.0


def test_seconds_per_version_needs_two_trained_versions():
    times = VersionTimes()
    times.see(0, 0.0)
    times.see(1, 5.0)
    assert times.seconds_per_version() is None


def test_the_real_model_recipe_comes_first_and_the_users_settings_win():
    args = argparse.Namespace(model="smollm2-135m", task=None, set=["lr=1e-04"])
    settings = real_model_settings(args)
    assert settings[0] == "model=smollm2-135m" and "activation_encoding=predcoded_s40_gs64_b4" in settings
    assert settings[-1] == "lr=1e-04" and settings.index("lr=5e-05") < settings.index("lr=1e-04")
    assert any(s.startswith("task.options=") and '"max_digits": 2' in s for s in settings)
    assert "prompts_per_step=4" in REAL_MODEL_SETTINGS
    every = {s.split("=")[0]: s.split("=")[1] for s in REAL_MODEL_SETTINGS}
    assert every["eval_every_versions"] == every["checkpoint_every_versions"]  # every evaluated version exports


def test_the_real_model_recipe_syncs_replicas_with_diloco_unless_the_user_turns_lora_off():
    from engine.swarm.run_config import RunConfig, apply_overrides

    args = argparse.Namespace(model="smollm2-135m", task=None, set=[])
    run = apply_overrides(RunConfig(), real_model_settings(args))
    sync = run.replica_sync
    assert (sync.mode, sync.inner_steps, sync.encoding, sync.topk_fraction, sync.value_bits, sync.value_scale) == \
        ("diloco", 32, "topk", 1.0, 1, "mse") and run.lora.enabled
    args.set = ["lora.enabled=false"]  # full fine-tuning of a tied model cannot run DiLoCo: every step then
    assert apply_overrides(RunConfig(), real_model_settings(args)).replica_sync.mode == "every_step"
    args.set = ["replica_sync.mode=every_step"]  # and the user's choice wins
    assert apply_overrides(RunConfig(), real_model_settings(args)).replica_sync.mode == "every_step"
    assert "replica_sync.mode=diloco" not in real_model_settings(argparse.Namespace(model=None, task=None, set=[]))


def test_the_progress_line_shows_the_reward_over_the_last_eight_steps_weighted_by_their_samples():
    from engine.swarm.demo import _progress_line

    steps = [{"reward": 1.0, "samples": 8, "staleness_mean": 1.0}] * 2 + [{"reward": 0.0, "samples": 24}] * 8
    stats = {"evals": [], "steps": steps, "nodes": [], "version": 10, "self_reported": {"bytes_sent": 0}}
    assert "reward(8) 0.000" in _progress_line(stats, 1.0, 0.0)  # the two old steps fell out of the window
    stats["steps"] = [{"reward": 1.0, "samples": 8}, {"reward": 0.0, "samples": 24}]
    assert "reward(8) 0.250" in _progress_line(stats, 1.0, 0.0)  # 8 of 32 samples, not the mean of the means


def test_scoring_the_trained_policy_without_the_tool_says_why_not_when_no_version_was_checkpointed(tmp_path):
    import io

    from engine.paths import base_checkpoint_dir
    from engine.swarm.demo import _without_tool
    from engine.swarm.run_config import RunConfig, _plain
    from engine.swarm.store import Store

    store = Store(tmp_path / "coordinator.db")
    store.set_meta("run", _plain(RunConfig()))
    store.set_meta("base_checkpoint", str(base_checkpoint_dir()))
    store.close()
    out = io.StringIO()
    assert _without_tool(tmp_path, out, trained=True) is None
    assert "No trained checkpoint to score without the tool" in out.getvalue()
    assert not (tmp_path / "export-without-tool").exists()
