"""The transport measurements behind ``polis bench transport`` run and report sane figures."""

import asyncio
import statistics

import pytest

from engine.net.measure import framed_throughput_in_process, raw_channel_throughput, transport_summary

pytestmark = pytest.mark.network


def test_raw_and_framed_in_process_throughput_are_measured_on_the_same_bytes():
    async def body():
        raw = await raw_channel_throughput(1024 * 1024, 64 * 1024)
        framed = await framed_throughput_in_process(1024 * 1024)
        return raw, framed
    raw, framed = asyncio.run(asyncio.wait_for(body(), 120))
    assert raw["bytes"] == framed["bytes"] == 1024 * 1024
    assert raw["mb_s"] > 0 and framed["mb_s"] > 0 and framed["intact"]


def test_transport_summary_reports_goodput_ratio_of_medians_over_alternating_rounds():
    summary = asyncio.run(asyncio.wait_for(transport_summary(total_mb=2.0, rtt_count=20, rounds=3), 180))
    assert summary["intact"]
    rounds = summary["rounds"]
    assert len(rounds["raw_aiortc_mb_s"]) == len(rounds["framed_goodput_mb_s"]) == 3
    assert summary["raw_aiortc_mb_s"] == statistics.median(rounds["raw_aiortc_mb_s"])
    assert summary["framed_goodput_mb_s"] == statistics.median(rounds["framed_goodput_mb_s"])
    assert summary["goodput_ratio"] == pytest.approx(summary["framed_goodput_mb_s"] / summary["raw_aiortc_mb_s"])
    assert summary["rtt_ms"] > 0 and summary["rtt_p90_ms"] >= summary["rtt_ms"]
    assert summary["frame_bytes"] <= 256 * 1024
