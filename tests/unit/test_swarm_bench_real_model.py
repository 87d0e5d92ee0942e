"""`polis bench swarm --only generation --model M` measures M with `polis demo --model M`'s run.

The in-process side samples jobs shaped as the coordinator's (prompts of one token length x G
rows, the recipe's sampling) through the in-process trainer; the swarm side is the demo swarm of
that recipe. Checked here without a real model: the wiring (which run, which model, which
settings reach which side), the argument handling, and the jobs' shape on a tiny chat model.
"""

from __future__ import annotations

import argparse
import io

import pytest

import engine.bench.swarm as bench
from engine.swarm.demo import real_model_settings


def _args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_the_default_window_is_longer_for_a_real_model_and_window_s_wins():
    assert bench.window_seconds(_args()) == bench.WINDOW_S
    assert bench.window_seconds(_args(model="smollm2-135m")) == bench.REAL_MODEL_WINDOW_S > bench.WINDOW_S
    assert bench.window_seconds(_args(model="smollm2-135m", window_s=90.0)) == 90.0


def test_model_without_only_generation_is_refused_before_anything_runs(monkeypatch):
    def started(*a, **k):
        raise AssertionError("nothing may run")

    monkeypatch.setattr(bench, "_in_process_generation", started)
    monkeypatch.setattr(bench, "_swarm_window", started)
    assert bench.run(_args(model="smollm2-135m")) == 2


def test_the_real_model_run_is_polis_demo_models_recipe():
    run, settings = bench.real_model_run("smollm2-135m")
    assert settings == real_model_settings(bench.demo_run_args("smollm2-135m"))
    assert run.model == "smollm2-135m" and run.task.name == "reasoning_gym:chain_sum"
    assert (run.prompts_per_job, run.group_size, run.sampling.max_new_tokens) == (8, 8, 48)
    assert run.activation_encoding == "predcoded_s40_gs64_b4" and run.lora.enabled and run.generations_in_flight == 2


def test_generation_with_a_model_dir_measures_that_model_with_the_recipe_on_both_sides(monkeypatch, tmp_path):
    model = str(tmp_path / "imported")  # a directory: nothing to import, the demo loads it as it is
    seen: dict = {}

    def in_process(base, run, seconds):
        seen["in_process"] = (base, run, seconds)
        return 100.0

    def window(checkpoint, tmp, settings, replicas, seconds, wan=(None, None), model=None, start_s=0.0):
        seen["swarm"] = (checkpoint, settings, replicas, seconds, model)
        return {"tok_s": 60.0, "in_flight": {}, "jobs_in_flight": 2, "cpu_cores": None, "tokens": 6000,
                "seconds": seconds}

    monkeypatch.setattr(bench, "_in_process_real_model_generation", in_process)
    monkeypatch.setattr(bench, "_in_process_generation", lambda *a: pytest.fail("the tiny base's path ran"))
    monkeypatch.setattr(bench, "_swarm_window", window)
    args = _args(model=model, only="generation", window_s=None)
    result = bench._generation_only(args, 90.0, tmp_path / "run", io.StringIO())

    base, run, seconds = seen["in_process"]
    assert base == model and seconds == 90.0
    assert run.model == model and run.prompts_per_job == 8 and run.sampling.max_new_tokens == 48
    checkpoint, settings, replicas, seconds, swarm_model = seen["swarm"]
    assert checkpoint is None and swarm_model == model and replicas == 1 and seconds == 90.0
    assert settings == real_model_settings(bench.demo_run_args(model))
    assert result["generation_ratio"] == pytest.approx(0.6) and result["loopback_jobs_in_flight"] == 2
    assert result["job"]["prompts_per_job"] == 8 and result["job"]["activation_encoding"] == "predcoded_s40_gs64_b4"


def test_real_model_jobs_are_one_token_length_times_group_size_rows_of_chat_prompts(tmp_path):
    pytest.importorskip("reasoning_gym")
    pytest.importorskip("torch")
    from engine.rl.run_task import make_run_task
    from engine.swarm.run_config import RunConfig, apply_overrides
    from tests.support.tiny_tied_llama import write_tiny_tied_llama

    model_dir = write_tiny_tied_llama(tmp_path)
    run = apply_overrides(RunConfig(), [
        f"model={model_dir}", "task.name=reasoning_gym:chain_sum", "task.eval_size=4",
        'task.options={"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 3}',
        "prompts_per_job=3", "group_size=2", "sampling.max_new_tokens=4"])
    jobs, pipe = bench.real_model_jobs(str(model_dir), run)
    try:
        task = make_run_task(run.task, model_dir)
        for _ in range(3):
            groups = next(jobs)
            assert len(groups) == 3 and all(len(g.samples) == 2 for g in groups)
            assert len({len(g.prompt_ids) for g in groups}) == 1  # one KV cache, as a swarm job
            for g in groups:
                assert g.prompt.endswith("<|im_start|>assistant\n")  # the chat template's prompt
                assert g.prompt_ids.tolist() == task.prompt_ids(g.prompt)
                assert all(1 <= len(s.completion_ids) <= 4 for s in g.samples)
    finally:
        pipe.close()
