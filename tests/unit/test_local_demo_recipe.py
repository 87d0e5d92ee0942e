"""The desktop app's local demo (`polis node --demo`) starts the same swarm as `polis demo`:
the same coordinator and node command lines, 2 x 2 nodes in all (the app's node is the fourth)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from engine.swarm import demo, local_swarm


class _Proc:
    def poll(self):
        return None


def _record(monkeypatch) -> list[tuple[str, list[str], bool]]:
    spawned: list[tuple[str, list[str], bool]] = []

    def spawn(self, name, argv):
        spawned.append((name, list(argv), self.die_with_parent))
        self.procs.append(_Proc())
        return self.procs[-1]

    monkeypatch.setattr(demo.DemoProcesses, "spawn", spawn)
    monkeypatch.setattr(demo, "coordinator_alive", lambda url: True)
    return spawned


def _normalised(argv: list[str], run_dir: Path) -> list[str]:
    """Command lines with the run's own paths and port replaced, so two runs compare equal."""
    out, skip = [], False
    for word in argv:
        if skip:
            out.append("PORT")
            skip = False
            continue
        out.append(word.replace(str(run_dir), "RUN").rsplit(":", 1)[0] if "127.0.0.1:" in word
                   else word.replace(str(run_dir), "RUN"))
        skip = word == "--port"
    return out


def test_the_local_demo_runs_polis_demos_coordinator_and_the_other_three_nodes(tmp_path, monkeypatch):
    spawned = _record(monkeypatch)
    cli = argparse.Namespace(stages=demo.DEFAULT_STAGES, replicas=demo.DEFAULT_REPLICAS, checkpoint=None,
                             max_versions=0, set=[], backend="auto", model=None)
    (tmp_path / "cli").mkdir()
    demo.DemoSwarm(tmp_path / "cli", cli).start()
    terminal = [(name, _normalised(argv, tmp_path / "cli")) for name, argv, _ in spawned]
    spawned.clear()

    node_args = argparse.Namespace(data_dir=str(tmp_path / "app"), checkpoint=None, backend="auto")
    part, url = asyncio.run(local_swarm.host_local_coordinator(node_args, lan=False))
    helpers = local_swarm.spawn_helper_node(url, node_args)
    run_dir = local_swarm.demo_run_dir(node_args)
    app = [(name, _normalised(argv, run_dir)) for name, argv, _ in spawned]

    assert app == terminal[:-1]  # the same coordinator and nodes; the app's own node is the fourth
    assert len(terminal) == 1 + demo.DEFAULT_STAGES * demo.DEFAULT_REPLICAS
    assert all(die for _, _, die in spawned)  # they end with the node that started them
    assert isinstance(part, local_swarm.DemoPart) and isinstance(helpers, local_swarm.DemoPart)
    assert url.startswith("http://127.0.0.1:")



def test_the_real_model_demo_trains_lora_on_chain_sum_with_two_nodes_and_the_users_settings_win():
    from engine.swarm.run_config import RunConfig, apply_overrides

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--model", "smollm2-135m", "--set", "lora.rank=4"])
    run = apply_overrides(RunConfig(), demo.real_model_settings(args))
    assert run.model == "smollm2-135m" and run.task.name == demo.REAL_MODEL_TASK
    assert run.task.options == demo.REAL_MODEL_TASK_OPTIONS and run.lora.enabled and run.lora.rank == 4
    assert (run.group_size, run.prompts_per_step, run.sampling.max_new_tokens, run.micro_batch_rows) == (8, 4, 48, 8)
    assert run.activation_encoding == "predcoded_s40_gs64_b4"  # within 1.6 over the curve at 18-20x (3 seeds)
    argv = demo.coordinator_argv(Path("/run"), 1, real_model=True)
    assert argv[argv.index("--job-timeout-s") + 1] == str(demo.REAL_MODEL_TIMEOUT_S)
    plain = parser.parse_args(["--task", "sorting"])
    assert demo.real_model_settings(plain) == ["task.name=sorting"]  # the tiny base keeps its recipe


def test_the_calculator_demo_runs_multi_turn_episodes_on_three_to_four_digit_sums():
    from engine.swarm.run_config import RunConfig, apply_overrides

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    run = apply_overrides(RunConfig(), demo.real_model_settings(parser.parse_args(["--model", "smollm2-135m",
                                                                                  "--env", "calculator"])))
    assert run.env.name == "calculator" and run.env.max_turns == 4
    assert run.task.name == "reasoning_gym:chain_sum" and run.task.options["min_digits"] == 3
    assert run.sampling.max_new_tokens == 64 and run.lora.enabled  # the real model's recipe, with room for a call


def test_every_environment_a_run_can_name_is_registered():
    from typing import get_args, get_type_hints

    from engine.envs.registry import ENVIRONMENTS
    from engine.envs.settings import EnvSettings

    assert set(get_args(get_type_hints(EnvSettings)["name"])) - {""} == set(ENVIRONMENTS)


def test_the_calculator_demos_summary_has_turns_tool_calls_the_monitor_and_the_time_split_even_without_a_step():
    from engine.swarm.rollout_monitor import monitor_figures

    monitor = monitor_figures([], [], [])
    stats = {"evals": [{"version": 0, "accuracy": 0.0, "content": 0.0, "n": 16}], "rollouts": {"ready": 128},
             "steps": [], "received_rollouts": 128, "self_reported": {"bytes_sent": 10},
             "credit_totals": {"tokens_generated": 100}, "samples_trained": 0, "update_bytes": 0,
             "dense_update_bytes": 0, "staleness_histogram": {}, "task": "reasoning_gym:chain_sum", "version": 0,
             "model": "smollm2-135m", "lora_rank": 16, "env": "calculator", "monitor": monitor,
             "counters": {"train_job_seconds": 64.0, "train_jobs_done": 2, "reward_count": 128,
                          "episode_step_seconds": 1.28, "turns_from_cache": 3, "turns_recomputed": 5}}
    args = argparse.Namespace(stages=2, replicas=1)
    summary = demo._summary(stats, 100.0, args)
    assert summary["eval_after"] == summary["eval_before"] == 0.0 and summary["versions"] == 0  # no step: v0 is final
    assert summary["env"] == "calculator" and summary["mean_turns"] == monitor["mean_turns"]
    assert summary["episode_seconds"]["generation"] == 0.5 and summary["episode_seconds"]["stepping"] == 0.01
    assert (summary["turns_from_cache"], summary["turns_recomputed"]) == (3, 5)


def test_the_calculator_demo_warms_the_base_up_once_and_points_the_run_at_the_warmed_checkpoint(tmp_path, monkeypatch):
    import io

    from engine.swarm.run_config import RunConfig, apply_overrides
    from tests.support.tiny_tied_llama import write_tiny_tied_llama

    monkeypatch.setenv("POLIS_DATA_DIR", str(tmp_path / "data"))
    tiny = write_tiny_tied_llama(tmp_path / "tiny", num_layers=2)
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    argv = ["--model", str(tiny), "--env", "calculator", "--warmup-steps", "1", "--set", "task.eval_size=2"]
    args = parser.parse_args(argv)
    args.set = demo.real_model_settings(args)
    warm = demo.tool_warm_up(args, io.StringIO())
    assert Path(warm["dir"]).parent == tmp_path / "data" / "warmups" and (Path(warm["dir"]) / "WARMUP.json").exists()
    run = apply_overrides(RunConfig(), args.set)
    assert run.model == warm["dir"] and run.env.name == "calculator"  # the swarm starts from the warmed weights
    assert not warm["reused"] and warm["steps"] == 1 and warm["before"]["episodes"] == 2
    assert warm["settings"]["lora_rank"] == run.lora.rank and warm["settings"]["max_new_tokens"] == 64
    again = parser.parse_args(argv)
    again.set = demo.real_model_settings(again)
    assert demo.tool_warm_up(again, io.StringIO())["reused"]
