"""`polis export`: a run's version as an HF checkpoint that plain transformers loads with the pipeline's logits."""

import json

import numpy as np
import pytest

from engine.model.errors import CheckpointError
from engine.model.export.hf_export import export_version
from engine.model.export.stage_files import StageMissing
from engine.paths import base_checkpoint_dir
from tests.support.stage_run import make_run
from tests.support.tiny_tied_llama import write_tiny_tied_llama

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _hf_logits(directory, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


def test_an_exported_version_loads_in_transformers_with_the_pipelines_logits(tmp_path):
    run = make_run(tmp_path / "run", base_checkpoint_dir(), num_stages=2, steps=3)
    try:
        result = export_version(run.run_dir, tmp_path / "out")
        assert result.version == 3
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                              "model-00002-of-00002.safetensors"]
        assert index["weight_map"]["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
        assert index["weight_map"]["lm_head.weight"] == "model-00002-of-00002.safetensors"
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (tmp_path / "out" / name).exists(), name
        ids = np.random.default_rng(1).integers(3, 12, size=(3, 7))
        exported, served = _hf_logits(tmp_path / "out", ids), run.logits(ids)
        assert np.max(np.abs(exported - served)) <= 1e-5
        base = _hf_logits(base_checkpoint_dir(), ids)
        assert np.max(np.abs(base - served)) > 1e-3  # the training steps really changed the model
    finally:
        run.close()


def test_a_tied_model_is_exported_with_one_embedding_matrix(tmp_path):
    base = write_tiny_tied_llama(tmp_path / "tied", num_layers=3)
    run = make_run(tmp_path / "run", base, num_stages=2, steps=2, vocab_low=3, vocab_high=300)
    try:
        result = export_version(run.run_dir, tmp_path / "out")
        assert result.tied and result.tied_max_abs_diff == 0.0
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert "lm_head.weight" not in index["weight_map"]
        assert index["weight_map"]["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
        ids = np.random.default_rng(2).integers(3, 300, size=(2, 9))
        assert np.max(np.abs(_hf_logits(tmp_path / "out", ids) - run.logits(ids))) <= 1e-5
    finally:
        run.close()


def test_a_stage_without_the_version_asked_for_is_an_error_naming_the_stage(tmp_path):
    run = make_run(tmp_path / "run", base_checkpoint_dir(), num_stages=2, steps=2)
    run.close()
    with pytest.raises(StageMissing, match=r"stage 0 of 2 has no checkpoint of version 1 .*holds versions \[2\]"):
        export_version(run.run_dir, tmp_path / "out", version=1)
    (run.run_dir / "node1" / "stages" / "testrun" / "stage1.safetensors").unlink()
    with pytest.raises(StageMissing, match="stage 1 has no checkpoint at all"):
        export_version(run.run_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written, no base copy


def test_a_stage_file_whose_tensors_do_not_match_their_recorded_hash_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    from engine.model.safetensors_reader import SafetensorsFile

    run = make_run(tmp_path / "run", base_checkpoint_dir(), num_stages=2, steps=1)
    run.close()
    path = run.run_dir / "node0" / "stages" / "testrun" / "stage0.safetensors"
    metadata = SafetensorsFile(path).metadata
    tensors = load_file(str(path))
    tensors["model.embed_tokens.weight"][0, 0] += 1e-3
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match="hash"):
        export_version(run.run_dir, tmp_path / "out")


def test_polis_eval_of_the_export_equals_the_pipelines_greedy_eval_at_that_version(tmp_path):
    from engine.rl.checkpoint_eval import evaluate_checkpoint
    from engine.rl.codec import TaskCodec
    from engine.rl.evaluation import evaluate_greedy
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.tasks import TaskConfig, make_task

    run = make_run(tmp_path / "run", base_checkpoint_dir(), num_stages=2, steps=2, lr=3e-3)
    try:
        export_version(run.run_dir, tmp_path / "out")
        config = TaskConfig()
        task = make_task(config)
        served = evaluate_greedy(LocalPipeline([rt.backend for rt in run.runtimes]),
                                 TaskCodec.from_dir(base_checkpoint_dir()), task, 8, task.eval_split()[:100])
        exported = evaluate_checkpoint(tmp_path / "out", config, n=100, max_new_tokens=8, backend="torch")
        assert exported.items == 100
        assert exported.strict == served.exact_match and exported.reward == pytest.approx(served.mean_reward)
    finally:
        run.close()


def test_an_existing_output_folder_is_kept_unless_forced(tmp_path):
    run = make_run(tmp_path / "run", base_checkpoint_dir(), num_stages=2, steps=1)
    run.close()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="--force"):
        export_version(run.run_dir, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").exists()
    export_version(run.run_dir, tmp_path / "out", overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists()


def test_adapter_export_of_a_full_fine_tuning_run_is_refused(tmp_path):
    run = make_run(tmp_path / "run", base_checkpoint_dir(), num_stages=2, steps=1)
    run.close()
    with pytest.raises(CheckpointError, match="without --adapter"):
        export_version(run.run_dir, tmp_path / "a", adapter=True)
