"""A LoRA run's export: merged weights by default, PEFT's adapter format with --adapter; both give the
pipeline's logits (merged: plain transformers; adapter: peft.PeftModel on the transformers base)."""

import json

import numpy as np
import pytest

from tests.support.stage_run import make_run
from tests.support.tiny_tied_llama import write_tiny_tied_llama

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
lora_module = pytest.importorskip("backends.lora")


def _lora_optimizer():
    from backends.base import LoraConfig, OptimizerConfig

    return OptimizerConfig(lr=1e-2, lora=LoraConfig(enabled=True, rank=4, alpha=8.0,
                                                    target_modules=("q_proj", "v_proj", "down_proj")))


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


@pytest.fixture
def lora_run(tmp_path):
    base = write_tiny_tied_llama(tmp_path / "tied", num_layers=3)
    run = make_run(tmp_path / "run", base, num_stages=2, steps=3, optimizer=_lora_optimizer(),
                   vocab_low=3, vocab_high=300)
    yield base, run
    run.close()


def test_a_lora_run_exports_merged_weights_with_the_pipelines_logits(tmp_path, lora_run):
    from engine.model.export.hf_export import export_version

    base, run = lora_run
    result = export_version(run.run_dir, tmp_path / "merged")
    assert result.lora["rank"] == 4 and not result.adapter_only
    ids = np.random.default_rng(3).integers(3, 300, size=(2, 8))
    served = run.logits(ids)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    assert np.max(np.abs(_logits(merged, ids) - served)) <= 1e-5
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    assert np.max(np.abs(_logits(plain, ids) - served)) > 1e-4  # the adapters were trained


def test_a_lora_run_exports_peft_adapters_that_peft_loads_on_the_base_with_equal_logits(tmp_path, lora_run):
    peft = pytest.importorskip("peft")
    from engine.model.export.hf_export import export_version

    base, run = lora_run
    export_version(run.run_dir, tmp_path / "adapter", adapter=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), str(tmp_path / "adapter"))
    ids = np.random.default_rng(4).integers(3, 300, size=(2, 8))
    assert np.max(np.abs(_logits(model, ids) - run.logits(ids))) <= 1e-5
