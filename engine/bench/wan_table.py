"""The WAN goodput table of ``polis bench transport``: loss x RTT, stock aiortc against Polis links.

For every (RTT, loss) cell of the grid, one stock aiortc data channel and one
pair of Polis links (default :class:`~engine.net.link_config.LinkConfig`, its
SCTP tuning included) each send across a fresh emulated link, counted over a
window of ``cell_s`` seconds (at least 20 round trips) after a warm-up of about
15 round trips (:mod:`engine.net.wan_goodput`); the table shows goodput in MB/s,
as a share of the emulated line rate, and the Polis / stock ratio. Cells run
one after another in this process, stock then Polis, so load from elsewhere
hits both alike; compare within one run.

What this module does not know: how a cell is measured, or the rest of the
transport bench.
"""

from __future__ import annotations

import time
from typing import Any

#: the grid of the issue: loss (percent, each direction) and round trip (ms)
LOSSES_PERCENT = (0.0, 0.1, 0.5, 1.0, 2.0)
RTTS_MS = (20.0, 80.0, 200.0)


async def wan_table(*, rtts_ms: tuple[float, ...] = RTTS_MS, losses_percent: tuple[float, ...] = LOSSES_PERCENT,
                    bandwidth_mbps: float = 20.0, cell_s: float = 3.0, config=None) -> dict[str, Any]:
    """Measure every cell; returns ``{"cells": [...], ...}`` with both kinds per cell."""
    from engine.net.link_config import LinkConfig
    from engine.net.wan_goodput import Cell, polis_cell, stock_cell

    config = config or LinkConfig()
    started = time.monotonic()
    cells = []
    for rtt in rtts_ms:
        for loss in losses_percent:
            cell = Cell(rtt_ms=rtt, loss_percent=loss, bandwidth_mbps=bandwidth_mbps)
            window_s = max(cell_s, 20 * rtt / 1e3)
            stock = await stock_cell(cell, window_s=window_s)
            polis = await polis_cell(cell, window_s=window_s, config=config)
            cells.append({"rtt_ms": rtt, "loss_percent": loss, "stock": stock, "polis": polis,
                          "ratio": polis["goodput_mb_s"] / max(stock["goodput_mb_s"], 1e-9)})
    return {"bandwidth_mbps": bandwidth_mbps, "cell_s": cell_s,
            "sctp": config.sctp.as_dict(), "cells": cells, "seconds": round(time.monotonic() - started, 1)}


def format_wan_table(result: dict[str, Any]) -> str:
    line = result["bandwidth_mbps"]
    lines = [f"framed goodput across the emulated WAN ({line:g} Mbit/s each way = {line / 8:.2f} MB/s; "
             f"counted over >= {result['cell_s']:g} s and 20 RTTs per cell after ~15 RTTs warm-up; Polis SCTP "
             f"{_controller(result['sctp'])}, RTO margin {result['sctp']['rto_margin_s']} s)",
             f"{'RTT ms':>6} {'loss %':>6} | {'stock MB/s':>10} {'of line':>7} | {'Polis MB/s':>10} {'of line':>7}"
             f" | {'Polis/stock':>11} | {'CPU s/MB stock':>14} {'Polis':>5}"]
    for c in result["cells"]:
        s, p = c["stock"], c["polis"]
        lines.append(f"{c['rtt_ms']:6g} {c['loss_percent']:6g} | {s['goodput_mb_s']:10.3f} {s['link_share']:7.0%} | "
                     f"{p['goodput_mb_s']:10.3f} {p['link_share']:7.0%} | {c['ratio']:10.1f}x | "
                     f"{s['cpu_s_per_mb']:14.2f} {p['cpu_s_per_mb']:5.2f}")
    lines.append(f"({result['seconds']} s)")
    return "\n".join(lines)


def _controller(sctp: dict[str, Any]) -> str:
    if sctp.get("controller") == "bottleneck":
        return f"window {sctp['cruise_gain']:g} x measured rate x min RTT"
    return "stock Reno window"
