"""``polis bench weights``: the stream to an inference replica stays bit-exact, full or LoRA.

Real torch stages of the shipped tiny base, real AdamW steps, the real stream; a LoRA run
streams adapter deltas only, a small fraction of what full fine-tuning streams.
"""

from __future__ import annotations

import argparse

import pytest

from engine.bench.weight_stream import format_table, measure

pytest.importorskip("torch")


def _measure(lora_rank: int) -> dict:
    return measure(argparse.Namespace(checkpoint=None, stages=2, versions=3, seed=0, lr=None, lora_rank=lora_rank))


def test_a_lora_runs_weight_stream_is_adapter_deltas_far_smaller_than_full_fine_tunings_and_bit_exact():
    full, lora = _measure(0), _measure(2)
    for f, a in zip(full["stages"], lora["stages"]):
        assert f["replica_equals_shadow_bitwise"] and a["replica_equals_shadow_bitwise"]
        assert f["dense_fp32_bytes"] == a["dense_fp32_bytes"]  # both against the whole stage
        assert a["bytes_per_delta"] < 0.2 * f["bytes_per_delta"]
        assert all(e["replica_exact"] for e in a["sparse_exact"].values())
    assert "LoRA rank 2" in format_table(lora) and "full fine-tuning" in format_table(full)
