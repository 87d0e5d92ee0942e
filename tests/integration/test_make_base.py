"""`polis make-base`: an HF-loadable, deterministic base checkpoint with its tokenizer."""

import hashlib

import numpy as np
import pytest

pytest.importorskip("torch")

from engine.rl.codec import TaskCodec  # noqa: E402
from engine.rl.make_base import BaseModelShape, MakeBaseConfig, make_base, write_made_by  # noqa: E402
from engine.rl.pipeline import LocalPipeline  # noqa: E402
from engine.rl.tasks import TaskConfig  # noqa: E402

SMALL = MakeBaseConfig(task=TaskConfig(name="reversal", min_digits=3, max_digits=3, eval_size=50),
                       shape=BaseModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                            intermediate_size=64),
                       target_exact=0.99, max_steps=6, eval_every_steps=3)


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POLIS_TORCH_THREADS", "1")
        out = tmp_path_factory.mktemp("base")
        report = make_base(SMALL, out)
        write_made_by(out, SMALL, report, "polis make-base --test")
        again = tmp_path_factory.mktemp("again")
        make_base(SMALL, again)
    return out, again, report


def test_make_base_is_deterministic_given_the_seed(made):
    out, again, report = made
    assert report.steps == 6 and len(report.history) == 2
    assert _digest(out / "model.safetensors") == _digest(again / "model.safetensors")
    assert (out / "config.json").read_text() == (again / "config.json").read_text()


def test_base_loads_in_transformers_and_matches_the_stage_pipeline(made):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out, _, _ = made
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    codec = TaskCodec.from_dir(out)
    ids = codec.encode_prompt("rev:123=")
    assert tokenizer("rev:123=", add_special_tokens=False)["input_ids"] == ids[1:]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits.numpy()
    pipeline = LocalPipeline.from_checkpoint(out, 2, "torch", "cpu")
    try:
        ours = pipeline.backends[1].forward(pipeline.backends[0].forward(np.array([ids])))
    finally:
        pipeline.close()
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_made_by_records_command_seed_steps_and_accuracy(made):
    out, _, report = made
    text = (out / "MADE_BY.md").read_text()
    assert "polis make-base --test" in text and "seed: 0" in text
    assert f"{report.steps} steps" in text and f"{report.eval_exact:.3f}" in text
