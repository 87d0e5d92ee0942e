import asyncio

import pytest

from engine.net.wan_emulator import ImpairmentProfile
from engine.net.wan_measure import wan_transfer

pytestmark = pytest.mark.network


def test_a_tensor_crosses_an_emulated_wan_with_delay_rate_limit_and_loss_intact():
    profile = ImpairmentProfile(delay_ms=50, bandwidth_mbps=20, loss_percent=1)
    result = asyncio.run(wan_transfer(1024 * 1024, profile=profile, seed=7))
    assert result["intact"]
    relay = result["relay"]
    assert relay["a_to_b"]["bytes_forwarded"] > result["wire_bytes"]  # the payload really crossed the relay
    assert relay["a_to_b"]["dropped_loss"] + relay["b_to_a"]["dropped_loss"] > 0  # loss happened, was repaired
    assert result["rtt_ms"] >= 2 * profile.delay_ms
    assert result["goodput_mb_s"] <= profile.bandwidth_mbps / 8  # never faster than the line


def test_compressed_tensors_cross_the_emulated_wan_faster_in_fp32_terms():
    profile = ImpairmentProfile(delay_ms=10, bandwidth_mbps=8)
    fp32 = asyncio.run(wan_transfer(512 * 1024, profile=profile, seed=1))
    int8 = asyncio.run(wan_transfer(512 * 1024, profile=profile, seed=1, encoding="int8_rowwise"))
    assert fp32["intact"] and int8["intact"]
    assert int8["wire_bytes"] * 3.9 < fp32["wire_bytes"]
    assert int8["fp32_equivalent_mb_s"] > 2 * fp32["fp32_equivalent_mb_s"]


def test_the_learning_relay_pair_carries_webrtc_with_static_sdp_filters():
    profile = ImpairmentProfile(delay_ms=20, bandwidth_mbps=20, loss_percent=0.5)
    result = asyncio.run(wan_transfer(512 * 1024, profile=profile, seed=3, relay="pair"))
    assert result["intact"] and result["relay_kind"] == "pair"
    assert result["relay"]["a_to_b"]["bytes_forwarded"] > result["wire_bytes"]
    assert result["rtt_ms"] >= 2 * profile.delay_ms
