"""``polis bench transport``: WebRTC goodput, latency, codecs and an emulated WAN, in one run.

Everything is measured here and now, on loopback: raw aiortc data-channel
throughput (one process, no framing) against Polis framed tensor goodput
between two processes (and framed links in one process, which isolates the cost
of framing), on warmed-up links in alternating rounds; small-message round trips; each codec's compression
ratio and error on realistic activation and update tensors, and the
fp32-equivalent throughput it buys (measured goodput x measured ratio); and a
tensor sent across the user-space WAN emulator at 50 ms delay, 20 Mbit/s, 1 %
loss; and ``message_validation_ms``: decode + validate time of the largest wire
messages with the typed structs against the old hand-written path
(:mod:`engine.bench.message_validation`; ``--only validation`` runs just that, in
seconds, without opening a link); and the WAN goodput table (:mod:`engine.bench.wan_table`):
loss (0-2 %) x RTT (20-200 ms), one stock aiortc channel against Polis links
(``--only wan-table`` runs just that, about three minutes). The last stdout line
is the JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--mb", type=float, default=16.0, help="megabytes per throughput measurement")
    parser.add_argument("--wan-mb", type=float, default=2.0, help="megabytes sent across the emulated WAN")
    parser.add_argument("--quick", action="store_true", help="smaller transfers (about a third of the time)")
    parser.add_argument("--only", choices=("all", "validation", "wan-table"), default="all",
                        help="'validation': only the message decode + validate timings (no links, a few seconds); "
                             "'wan-table': only the loss x RTT goodput table (about three minutes)")
    parser.add_argument("--cell-s", type=float, default=3.0,
                        help="seconds counted per WAN table cell and kind (at least 20 round trips)")
    parser.add_argument("--line-mbps", type=float, default=20.0, help="emulated line rate of the WAN table, Mbit/s")


def _validation(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench.message_validation import message_validation

    return message_validation(budget_s=0.5 if args.quick else 1.5)


async def _wan_table(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench.wan_table import wan_table

    return await wan_table(bandwidth_mbps=args.line_mbps, cell_s=args.cell_s / (2 if args.quick else 1))


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    from engine.net.codec_report import codec_report
    from engine.net.measure import transport_summary
    from engine.net.wan_measure import wan_transfer

    total_mb = 4.0 if args.quick else args.mb
    started = time.monotonic()
    summary = await transport_summary(total_mb=total_mb)
    codecs = codec_report(update_numel=250_000 if args.quick else 1_000_000)
    for row in codecs.values():
        row["fp32_equivalent_mb_s"] = summary["framed_goodput_mb_s"] * row["ratio_vs_fp32"]
    wan_bytes = int((0.5 if args.quick else args.wan_mb) * 1024 * 1024)
    wan = await wan_transfer(wan_bytes, encoding="fp32")
    wan_int8 = await wan_transfer(wan_bytes, encoding="int8_rowwise")
    return {**summary, "codecs": codecs,
            "wan": {**wan, "profile": "50 ms one way, 20 Mbit/s, 1% loss", "int8": wan_int8},
            "message_validation_ms": _validation(args), "wan_table": await _wan_table(args),
            "seconds": round(time.monotonic() - started, 1)}


def _table(result: dict[str, Any]) -> str:
    from engine.bench.message_validation import format_table
    from engine.bench.wan_table import format_wan_table
    from engine.net.codec_report import format_codec_table

    if "message_validation_ms" not in result:
        return format_wan_table(result["wan_table"])
    validation = format_table(result["message_validation_ms"])
    if "wan" not in result:
        return f"{validation}\n({result['seconds']} s)"

    wan = result["wan"]
    return "\n".join([
        f"raw aiortc data channel (1 process)    {result['raw_aiortc_mb_s']:8.2f} MB/s",
        f"Polis framed links (1 process)         {result['framed_in_process_mb_s']:8.2f} MB/s "
        f"({result['in_process_ratio']:.2f}x raw)",
        f"Polis framed goodput (2 processes)     {result['framed_goodput_mb_s']:8.2f} MB/s "
        f"({result['goodput_ratio']:.2f}x raw; rounds "
        + ", ".join(f"{r:.2f}x" for r in result["rounds"]["goodput_ratio"]) + ")",
        f"small-message round trip               p50 {result['rtt_ms']:.2f} ms, p90 {result['rtt_p90_ms']:.2f} ms",
        "", format_codec_table(result["codecs"]), "",
        f"emulated WAN ({wan['profile']}): {'intact' if wan['intact'] else 'CORRUPTED'}, "
        f"{wan['goodput_mb_s']:.2f} MB/s fp32; int8 {wan['int8'].get('fp32_equivalent_mb_s', 0):.2f} MB/s "
        "fp32-equivalent", "", validation, "", format_wan_table(result["wan_table"]),
        f"({result['seconds']} s)"])


def run(args: argparse.Namespace) -> int:
    if args.only == "validation":
        started = time.monotonic()
        figures = _validation(args)
        result: dict[str, Any] = {"message_validation_ms": figures, "seconds": round(time.monotonic() - started, 1)}
        _print(result, args.json)
        return 0
    if args.only == "wan-table":
        result = {"wan_table": asyncio.run(_wan_table(args))}
        _print(result, args.json)
        return 0
    result = asyncio.run(_measure(args))
    _print(result, args.json)
    ok = result["intact"] and result["wan"]["intact"] and result["wan"]["int8"]["intact"]
    return 0 if ok else 1


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(_table(result), file=sys.stderr)
        print(json.dumps(result, default=float))
    else:
        print(_table(result))
