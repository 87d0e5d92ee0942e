"""The model-layer check (``polis check-model``) and ``polis bench shard`` run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.model import sharded_check as demo  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_demo_generates_through_stages_and_matches_transformers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POLIS_RESOURCES", str(tmp_path))  # no shipped checkpoint: the demo builds a random one
    assert demo.main(["--max-new-tokens", "6", "--prompt", "rev:123="]) == 0
    out = capsys.readouterr().out
    assert "stage 2/2" in out and "same as transformers generate" in out and "-> OK" in out


def test_check_model_on_a_tied_chat_model_sends_prompts_through_its_chat_template(tmp_path, capsys):
    from tests.support.tiny_tied_llama import write_tiny_tied_llama

    model = write_tiny_tied_llama(tmp_path / "tiny")
    assert demo.main(["--checkpoint", str(model), "--max-new-tokens", "5", "--backends", "torch,mlx"]) == 0
    out = capsys.readouterr().out
    assert "'What is 3 + 4?' ->" in out and "same as transformers generate" in out and "-> OK" in out


@pytest.mark.slow
def test_bench_shard_reports_accuracy_and_one_stage_load_memory_near_one_over_s(tmp_path):
    num_stages = 2  # each load is measured in its own process: S + 1 of them
    env = {**os.environ, "POLIS_RESOURCES": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "engine.cli", "bench", "shard", "--json", "--stages",
                             str(num_stages), "--layers", "4", "--hidden", "512", "--min-time-s", "0.1",
                             "--threads", "1"],
                            capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    (run,) = report["runs"]
    assert run["stages"] == num_stages and report["ok"] and report["split_ok"]
    for backend, diff in run["max_abs_diff"].items():
        assert diff is not None or backend in run["skipped"]
        assert diff is None or diff <= report["max_abs_diff_target"]
        split = run["max_abs_diff_vs_unsplit"][backend]  # the cut alone, on the same backend
        assert (split is None) == (diff is None) and (split is None or split <= report["max_abs_diff_target"])
    assert run["forward_tokens_per_s"]["torch"] > 0
    full, stage = report["full_load_peak_mb"], run["stage_load_peak_mb"]
    assert full >= 0.9 * report["full_fp32_mb"]  # the probe sees the whole load
    assert stage <= full / num_stages + 12  # 1/S of the model plus a small constant (MB)
