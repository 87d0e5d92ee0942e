"""Exact sparse weight deltas: only changed entries travel, the replica equals its shadow bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from engine.net import codec_sparse_exact
from engine.net.errors import WireFormatError
from engine.net.shadow_delta import DeltaReceiver, DeltaSender, WeightDelta
from engine.swarm.tensor_bundle import checksum
from engine.swarm.weight_stream import StreamFollower, StreamLeader, WeightStreamConfig


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.standard_normal((64, 32)).astype(np.float32),
            "b.bias": rng.standard_normal(32).astype(np.float32)}


def _touch(weights: dict[str, np.ndarray], fraction: float, seed: int) -> dict[str, np.ndarray]:
    """A copy with ``fraction`` of the entries moved a little (the rest bit-identical)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, w in weights.items():
        w = w.copy().reshape(-1)
        idx = rng.choice(w.size, max(1, int(fraction * w.size)), replace=False)
        w[idx] += np.float32(0.05)
        out[name] = w.reshape(weights[name].shape)
    return out


def test_fp32_exact_deltas_leave_the_receiver_bit_identical_to_the_sender_and_cost_at_most_six_bytes_per_change():
    start = _weights(0)
    sender, receiver = DeltaSender(start, "sparse_exact", value_dtype="float32"), DeltaReceiver(start)
    current = start
    for round_ in range(4):
        current = _touch(current, 0.01, round_)
        delta = sender.encode(current)
        header, payload = delta.to_wire()
        held = receiver.apply(WeightDelta.from_wire(header, payload))
        for name in current:  # exact: no residual at all
            assert np.array_equal(held[name].view(np.uint32), current[name].view(np.uint32))
            assert np.array_equal(sender.shadow[name], held[name])
        changed = sum(max(1, int(0.01 * w.size)) for w in start.values())
        assert len(payload) <= changed * 6  # a 4-byte value and a 1- or 2-byte gap each


def test_bf16_exact_deltas_send_only_entries_whose_bf16_rounding_changed():
    start = {n: codec_sparse_exact.round_to(w, "bfloat16") for n, w in _weights(1).items()}
    tiny = {n: w * np.float32(1 + 1e-4) for n, w in start.items()}  # below bf16's resolution almost everywhere
    encoded, updated = codec_sparse_exact.encode(start["a.weight"], tiny["a.weight"], "bfloat16")
    assert encoded.header["k"] < 0.05 * start["a.weight"].size
    assert np.array_equal(updated, codec_sparse_exact.round_to(tiny["a.weight"], "bfloat16"))
    applied = codec_sparse_exact.apply(start["a.weight"], encoded.header, encoded.payload)
    assert np.array_equal(applied, updated)


@pytest.mark.parametrize("breakage", ["shape", "index", "trailing", "nan", "k"])
def test_a_malformed_exact_delta_is_refused(breakage):
    shadow = _weights(2)["a.weight"]
    encoded, _ = codec_sparse_exact.encode(shadow, _touch({"a": shadow}, 0.02, 0)["a"])
    header, payload = dict(encoded.header), encoded.payload
    if breakage == "shape":
        header["shape"] = [32, 64]
    elif breakage == "index":  # one huge gap: past the end of the tensor
        header = dict(header, index_bytes=header["index_bytes"] + 2, k=header["k"])
        payload = b"\xff\xff\x7f" + payload[1:]
    elif breakage == "trailing":
        payload = payload + b"\x00"
    elif breakage == "nan":
        payload = payload[:-4] + np.float32(np.nan).tobytes()
    elif breakage == "k":
        header["k"] = shadow.size + 1
    with pytest.raises(WireFormatError):
        codec_sparse_exact.apply(shadow, header, payload)


def test_an_inference_replica_on_an_exact_stream_holds_the_leaders_weights_bit_for_bit():
    config = WeightStreamConfig(encoding="sparse_exact")
    start = _weights(3)
    leader, follower = StreamLeader(config), StreamFollower(config)
    stream = leader.start("r1", start, 0)
    follower.reset("lead", stream, start, 0)
    current = start
    for version in range(1, 4):
        current = _touch(current, 0.02, version)
        frame = leader.encode("r1", current, version)
        follower.apply(frame.header["delta"], frame.payload, version)
        assert frame.report["residual_max_abs"] == 0.0
        assert checksum(follower.shadow()) == frame.report["checksum"] == checksum(current)
    with pytest.raises(ValueError):
        WeightStreamConfig(encoding="topk")
