"""Checkpoint directories: lazy per-stage reads, and errors that name the broken file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from backends.base import StageSpec
from engine.model.checkpoint import INDEX_FILE, Checkpoint
from engine.model.errors import CheckpointError
from engine.model.random_checkpoint import small_config, write_random_checkpoint
from engine.model.shard_plan import plan_stages


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """4 layers over many small shards (each tensor whole, ~40 KB per file)."""
    config = small_config(vocab_size=50, hidden_size=64, num_layers=4, model_type="qwen2", tie_word_embeddings=True)
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", config, seed=3, max_shard_bytes=40_000)


@pytest.fixture
def copy_of(sharded, tmp_path) -> Path:
    return Path(shutil.copytree(sharded, tmp_path / "copy"))


def _all_tensors(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def test_stage_reads_match_the_safetensors_library(sharded):
    expected = _all_tensors(sharded)
    checkpoint = Checkpoint(sharded)
    assert checkpoint.tensor_names == sorted(expected)
    for spec in plan_stages(4, 3):
        for name, array in checkpoint.read_stage(spec).items():
            np.testing.assert_array_equal(array, expected[name])


def test_a_stage_reads_only_its_own_tensors_and_shards(sharded):
    full = Checkpoint(sharded)
    total_files = len(set(json.loads((sharded / INDEX_FILE).read_text())["weight_map"].values()))
    for spec in plan_stages(4, 4):
        checkpoint = Checkpoint(sharded)
        weights = checkpoint.read_stage(spec)
        assert checkpoint.bytes_read == sum(a.nbytes for a in weights.values()) == checkpoint.stage_nbytes(spec)
        assert set(checkpoint.files_opened) == {checkpoint.file_of(n).name for n in weights}
        assert len(checkpoint.files_opened) < total_files
    middle = StageSpec(1, 4, 1, 2)
    names = full.stage_tensor_names(middle)
    assert "model.embed_tokens.weight" not in names and all(n.startswith("model.layers.1.") for n in names)


def test_tied_last_stage_gets_the_embedding_as_its_head(sharded):
    checkpoint = Checkpoint(sharded)
    last = plan_stages(4, 2)[1]
    names = checkpoint.stage_tensor_names(last)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_lazy_stage_weights_read_each_tensor_on_lookup(sharded):
    checkpoint = Checkpoint(sharded)
    spec = plan_stages(4, 2)[0]
    lazy = checkpoint.stage_weights(spec)
    assert checkpoint.bytes_read == 0 and "model.embed_tokens.weight" in lazy and len(lazy) > 1
    embed = lazy["model.embed_tokens.weight"]
    assert checkpoint.bytes_read == embed.nbytes
    with pytest.raises(KeyError):
        lazy["model.norm.weight"]


def test_missing_shard_fails_only_for_stages_that_need_it(copy_of):
    checkpoint = Checkpoint(copy_of)
    first, last = plan_stages(4, 2)
    victim = checkpoint.file_of("model.layers.3.mlp.up_proj.weight")
    victim.unlink()
    with pytest.raises(CheckpointError, match="not found") as info:
        Checkpoint(copy_of).read_stage(last)
    assert victim.name in str(info.value)
    assert victim.name not in {checkpoint.file_of(n).name for n in checkpoint.stage_tensor_names(first)}
    assert Checkpoint(copy_of).read_stage(first)  # the other stage never needs that file


def test_truncated_shard_names_the_file(copy_of):
    checkpoint = Checkpoint(copy_of)
    victim = checkpoint.file_of("model.norm.weight")
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated") as info:
        Checkpoint(copy_of).read_stage(plan_stages(4, 1)[0])
    assert victim.name in str(info.value)


def test_corrupt_shard_header_names_the_file(copy_of):
    victim = Checkpoint(copy_of).file_of("model.layers.0.input_layernorm.weight")
    raw = bytearray(victim.read_bytes())
    raw[8:16] = b"garbage!"
    victim.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupt header") as info:
        Checkpoint(copy_of).read_stage(plan_stages(4, 2)[0])
    assert victim.name in str(info.value)


def test_single_file_checkpoint_and_missing_single_file(tmp_path):
    config = small_config(vocab_size=20, hidden_size=32, num_layers=2)
    directory = write_random_checkpoint(tmp_path / "one", config)
    assert not (directory / INDEX_FILE).exists()
    assert len(Checkpoint(directory).read_stage(plan_stages(2, 1)[0])) == len(Checkpoint(directory).tensor_names)
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors: file not found"):
        Checkpoint(directory)


def test_missing_or_broken_config_and_directory_are_named(copy_of, tmp_path):
    with pytest.raises(CheckpointError, match="directory not found"):
        Checkpoint(tmp_path / "absent")
    (copy_of / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        Checkpoint(copy_of)
    (copy_of / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: file not found"):
        Checkpoint(copy_of)


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "weights.bin", 7])
def test_index_pointing_outside_the_directory_is_refused(copy_of, target):
    index = json.loads((copy_of / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = target
    (copy_of / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=INDEX_FILE.replace(".", r"\.")):
        Checkpoint(copy_of)


def test_missing_tensor_and_wrong_shape_are_named(copy_of):
    index = json.loads((copy_of / INDEX_FILE).read_text())
    del index["weight_map"]["model.layers.2.self_attn.q_proj.bias"]
    (copy_of / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="q_proj.bias"):
        Checkpoint(copy_of).read_stage(plan_stages(4, 2)[1])
    config = json.loads((copy_of / "config.json").read_text())
    config["intermediate_size"] += 16
    (copy_of / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json implies") as info:
        Checkpoint(copy_of).read_stage(plan_stages(4, 2)[0])
    assert ".safetensors" in str(info.value)


def test_stage_that_does_not_fit_the_model_is_refused(sharded):
    with pytest.raises(CheckpointError, match="does not fit"):
        Checkpoint(sharded).stage_tensor_names(StageSpec(1, 2, 2, 6))
    with pytest.raises(CheckpointError, match="does not fit"):
        Checkpoint(sharded).stage_tensor_names(StageSpec(1, 2, 2, 3))  # last stage must end at layer 4
