"""Polis links keep their goodput under random loss where one stock aiortc channel collapses."""

import asyncio

import pytest

from engine.bench.wan_table import format_wan_table, wan_table
from engine.net.wan_goodput import Cell, polis_cell, stock_cell

pytestmark = [pytest.mark.network, pytest.mark.slow]


def test_tuned_links_beat_one_stock_aiortc_channel_several_fold_at_80_ms_and_half_a_percent_loss():
    cell = Cell(rtt_ms=80, loss_percent=0.5, bandwidth_mbps=20)

    async def both():
        return await stock_cell(cell, window_s=3.0), await polis_cell(cell, window_s=3.0)

    stock, polis = asyncio.run(both())
    assert polis["relay"]["dropped_loss"] > 0 and stock["relay"]["dropped_loss"] > 0  # loss happened to both
    assert polis["goodput_mb_s"] > 2.5 * stock["goodput_mb_s"], (stock, polis)
    assert polis["goodput_mb_s"] <= cell.line_mb_s * 1.05  # never faster than the line


def test_the_wan_table_measures_every_cell_of_its_grid_for_both_kinds():
    # 3 s windows: one stock retransmission timeout (aiortc's 1 s floor) at 1 % loss cannot empty a window
    result = asyncio.run(wan_table(rtts_ms=(20.0,), losses_percent=(0.0, 1.0), cell_s=3.0))
    assert [(c["rtt_ms"], c["loss_percent"]) for c in result["cells"]] == [(20.0, 0.0), (20.0, 1.0)]
    for c in result["cells"]:
        assert c["stock"]["goodput_mb_s"] > 0 and c["polis"]["goodput_mb_s"] > 0
        assert c["ratio"] == pytest.approx(c["polis"]["goodput_mb_s"] / c["stock"]["goodput_mb_s"])
    table = format_wan_table(result)
    assert "Polis/stock" in table and len(table.splitlines()) == 2 + 2 + 1


def test_at_200_ms_polis_links_keep_pace_with_stock_on_a_clean_line_and_fill_most_of_a_lossy_one():
    clean, lossy = Cell(rtt_ms=200, loss_percent=0.0, bandwidth_mbps=20), Cell(rtt_ms=200, loss_percent=0.1,
                                                                               bandwidth_mbps=20)

    async def cells():
        return (await stock_cell(clean, window_s=4.0), await polis_cell(clean, window_s=4.0),
                await polis_cell(lossy, window_s=4.0))

    stock, polis, polis_lossy = asyncio.run(cells())
    # the measured window: no overshoot of the relay's one-round-trip queue, no Reno halving on random loss
    assert polis["goodput_mb_s"] >= 0.85 * stock["goodput_mb_s"], (stock, polis)
    assert polis["relay"]["dropped_queue"] == 0
    assert polis_lossy["link_share"] >= 0.5, polis_lossy
