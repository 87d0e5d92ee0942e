"""The bytes model: which stage uploads what per policy version."""

import dataclasses

import pytest

from engine.model.config import ModelConfig
from engine.paths import base_checkpoint_dir
from engine.swarm.run_config import LoraSettings, ReplicaSyncSettings, RunConfig
from engine.swarm.stage_traffic import TOKEN_BYTES, mean_prompt_tokens, row_bytes, stage_traffic, trainable_parameters

TINY = ModelConfig.from_file(base_checkpoint_dir() / "config.json")  # hidden 64, 2 layers


def test_activations_go_forward_from_every_stage_but_the_last_and_gradients_back_from_every_but_the_first():
    t = stage_traffic(RunConfig(), TINY, [1, 1], prompt_tokens=10)
    assert t.activations_forward[0] > 0 and t.activations_forward[1] == 0
    assert t.gradients_back[0] == 0 and t.gradients_back[1] > 0
    assert t.tokens_back == (0, RunConfig().prompts_per_step * RunConfig().group_size / 4 * 8 * TOKEN_BYTES)
    # generation's decoding and two training passes forward against one pass of gradients back
    assert t.boundary_bytes(0) > 2 * t.boundary_bytes(1)


def test_the_default_run_on_the_tiny_base_has_the_figures_the_readme_gives():
    run = RunConfig()
    t = stage_traffic(run, TINY, [1, 1], prompt_tokens=10)
    rows = run.prompts_per_step * run.group_size / run.updates_per_batch  # 128 rows a version
    vector = TINY.hidden_size + 4  # int8 rows with a scale
    forward = vector * (8 * 10 + rows * 7 + 2 * rows * 18)
    assert t.activations_forward[0] == pytest.approx(forward)
    assert t.gradients_back[1] == pytest.approx(vector * rows * 18)
    assert 0.3e6 < t.boundary_bytes(0) < 0.45e6 and 0.12e6 < t.boundary_bytes(1) < 0.2e6


def test_a_trainer_uploads_its_share_of_the_boundary_and_its_update_to_every_other_trainer():
    t = stage_traffic(RunConfig(), TINY, [1, 1], prompt_tokens=10)
    assert t.upload_bytes(0, 1) == pytest.approx(t.boundary_bytes(0))
    assert t.upload_bytes(0, 2) == pytest.approx(t.boundary_bytes(0) / 2 + t.replica_update[0])
    assert t.upload_bytes(1, 3, share=0.2) == pytest.approx(0.2 * t.boundary_bytes(1) + 2 * t.replica_update[1])


def test_replica_updates_follow_the_update_encoding_and_diloco_sends_every_h_steps():
    dense = stage_traffic(RunConfig(update_encoding="fp32"), TINY, [1, 1], prompt_tokens=10).replica_update[0]
    int8 = stage_traffic(RunConfig(), TINY, [1, 1], prompt_tokens=10).replica_update[0]
    topk = stage_traffic(RunConfig(update_encoding="topk"), TINY, [1, 1], prompt_tokens=10).replica_update[0]
    diloco = stage_traffic(RunConfig(replica_sync=ReplicaSyncSettings(mode="diloco")), TINY, [1, 1],
                           prompt_tokens=10).replica_update[0]
    assert dense == pytest.approx(4 * int8) and topk < int8 / 5 and diloco < topk
    params = trainable_parameters(TINY, RunConfig(), 0, [1, 1])
    assert int8 == pytest.approx(params)

    def sync(**settings) -> float:
        run = RunConfig(replica_sync=ReplicaSyncSettings(mode="diloco", **settings))
        return stage_traffic(run, TINY, [1, 1], prompt_tokens=10).replica_update[0]

    # every entry at 2 bits, no index section; int8 every entry; top 2 % with one-byte varint gaps
    assert sync(inner_steps=16, topk_fraction=1.0, value_bits=2) == pytest.approx(params * 0.25 / 16)
    assert sync(inner_steps=8, encoding="int8") == pytest.approx(params / 8)
    assert sync(inner_steps=8, topk_fraction=0.02, value_bits=2) == pytest.approx(params * 0.02 * 1.25 / 8)


def test_lora_stages_exchange_only_their_adapters():
    run = RunConfig(lora=LoraSettings(enabled=True, rank=4, target_modules=["q_proj", "v_proj"]))
    h = TINY.hidden_size
    kv = TINY.num_key_value_heads * TINY.head_dim
    assert trainable_parameters(TINY, run, 1, [1, 1]) == 4 * (h + TINY.num_attention_heads * TINY.head_dim) + \
        4 * (h + kv)


def test_row_bytes_of_each_encoding_family():
    assert row_bytes("fp32", 64) == (256, 256)
    assert row_bytes("int8_rowwise", 64) == (68, 68)
    assert row_bytes("basis_r128_gs64", 576) == (132, 68)
    assert row_bytes("basis_r96_g8", 576) == (100, 580)  # int8 gradient rows
    assert row_bytes("subspace_r128", 64) == (68, 68)  # a rank over the width is the width
    assert row_bytes("basis_r128_gs64_b4", 576) == (132, 36)  # 4-bit gradient codes
    assert row_bytes("basis_r32_b4", 64) == (20, 20)  # 4-bit codes both ways
    coded, _ = row_bytes("coded_s20_gs64_b4", 576)  # range-coded: what its step costs, not its rank
    assert coded == pytest.approx(2.0 * 97.2, abs=0.1) and row_bytes("coded_s20_gs64_b4", 576)[1] == 36
    assert row_bytes("coded_s40_gs64_b4", 576)[0] < coded < row_bytes("coded_s10_gs64_b4", 576)[0]
    assert row_bytes("predcoded_s20_gs64_b4", 576)[0] == pytest.approx(0.75 * coded + 2)
    assert row_bytes("predcoded_s40_gs64_b4", 576)[0] == pytest.approx(110, abs=3)  # a 64-version RL run: 110


def test_the_mean_prompt_length_falls_back_without_prompts():
    assert mean_prompt_tokens([8, 12]) == 10 and mean_prompt_tokens([]) == 16
    assert dataclasses.is_dataclass(stage_traffic(RunConfig(), TINY, [1, 1], prompt_tokens=10))
