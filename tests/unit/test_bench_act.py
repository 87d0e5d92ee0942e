import numpy as np
import pytest

from engine.bench.act import format_table
from engine.bench.act_boundary import signed_micro_batches, totals, wrap_stages
from engine.bench.act_learning import tiny_learning
from engine.model.checkpoint import Checkpoint
from engine.model.loader import load_stage
from engine.model.shard_plan import plan_stages
from engine.paths import base_checkpoint_dir
from engine.rl.pipeline import LocalPipeline


def _two_stages():
    ck = Checkpoint(base_checkpoint_dir())
    return [load_stage(ck, spec, "torch", "cpu") for spec in plan_stages(ck.config.num_hidden_layers, 2)]


def test_an_encoded_boundary_meters_what_crosses_both_ways_and_fp32_changes_nothing():
    stages = _two_stages()
    tokens = np.random.default_rng(0).integers(3, 20, size=(4, 9))
    exact = LocalPipeline(stages).token_logprobs(tokens, tokens)
    for name, ratio in (("fp32", 1.0), ("int8_rowwise", 3.9)):
        wrapped = wrap_stages(stages, name)
        pipeline = LocalPipeline(wrapped)
        logp = pipeline.token_logprobs(tokens, tokens, key="k")
        pipeline.backward("k", np.ones_like(logp))
        pipeline.zero_grad()
        acts, grads = totals(wrapped, "act"), totals(wrapped, "grad")
        assert acts["tensors"] == grads["tensors"] == 1 and acts["rows"] == 4 * 9
        assert acts["x_fewer_than_fp32"] >= ratio * 0.95 and grads["x_fewer_than_fp32"] >= ratio * 0.95
        if name == "fp32":
            assert np.array_equal(logp, exact) and acts["relative_error"] == 0.0
        else:
            assert 0 < acts["relative_error"] < 0.02 and np.abs(logp - exact).max() < 0.05


def test_training_micro_batches_are_padded_and_carry_signed_advantages_on_completions_only():
    sequences = [[1, 5, 6, 7, 2], [1, 5, 8, 2], [1, 9, 9, 9, 9, 2]]
    batches = list(signed_micro_batches(sequences, prompt_lens=[2, 2, 3], rows=2, pad_id=0))
    assert [b[0].shape for b in batches] == [(2, 4), (1, 5)]
    inputs, targets, grad = batches[0]
    assert inputs[1].tolist() == [1, 5, 8, 0] and targets[1].tolist() == [5, 8, 2, 0]
    assert (grad[0, :1] == 0).all() and (grad[0, 1:] > 0).all() and (grad[1, 1:3] < 0).all() and grad[1, 3] == 0


@pytest.mark.slow  # two held-out evals of 400 prompts per scheme: about a minute on 2 cores
def test_the_tiny_learning_bench_reports_bytes_and_accuracy_per_scheme():
    report = tiny_learning(base_checkpoint_dir(), ["fp32", "subspace_r8"], steps=1)
    fp32, sub = report["schemes"]["fp32"], report["schemes"]["subspace_r8"]
    assert fp32["x_fewer_than_fp32"] == 1.0 and sub["x_fewer_than_fp32"] > 16
    assert 0 <= sub["exact_end"] <= 1 and sub["gradients"]["tensors"] > 0
    assert "subspace_r8" in format_table({"tiny": report})


def test_a_learning_bench_counts_the_training_traffic_and_drops_the_evals_own():
    from types import SimpleNamespace

    from engine.bench.act_boundary import BoundaryMeter
    from engine.bench.real_recipe import eval_point

    chain = wrap_stages(_two_stages(), "int8_rowwise")
    pipeline = LocalPipeline(chain)
    tokens = np.random.default_rng(1).integers(3, 20, size=(2, 5))
    logp = pipeline.token_logprobs(tokens, tokens, key="train")  # a training pass: forward and backward
    pipeline.backward("train", np.ones_like(logp))
    pipeline.zero_grad()

    def evaluate():  # an eval decodes through the boundary too
        pipeline.token_logprobs(np.tile(tokens, (3, 1)), np.tile(tokens, (3, 1)))
        return SimpleNamespace(exact_match=0.5, content=None)

    trained = {"act": BoundaryMeter(), "grad": BoundaryMeter()}
    point = eval_point(chain, SimpleNamespace(evaluate=evaluate), 4, 10, trained)
    assert point == {"version": 4, "samples": 10, "strict": 0.5, "content": None}
    assert trained["act"].rows == 2 * 5 and trained["grad"].rows == 2 * 5  # the 6-row eval is not counted
    assert totals(chain, "act")["tensors"] == 0  # and nothing is left over for the next interval
