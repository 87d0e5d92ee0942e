"""``polis bench wan``: the default demo swarm on loopback and over emulated internet links, in one run.

For each profile (default ``loopback,continental``; ``loopback`` means no relay,
anything else is a ``polis demo --wan`` profile or mix) it runs
``polis demo --json --quiet --minutes M`` as its own process, one after the
other, and reports per profile: held-out accuracy before and after, the rise in
points, policy versions per minute of the training budget (node start-up
included), rollouts lost, tokens generated per second of the whole run, the
mean training-job latency (dispatch to last token), the staleness histogram,
bytes on the wire and, over the relay, what it forwarded and dropped. Ratios
against the first profile (normally loopback) come with them.

The swarm's figures are the demo's own (its coordinator's stats API); this
module only starts the runs and puts their summaries side by side. The last
stdout line is the JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from engine.self_command import polis_command

#: seconds a demo run may take beyond its training budget (start-up, final eval, shutdown)
RUN_SLACK_S = 360.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--profiles", default="loopback,continental",
                        help="the runs, separated by ',' (by ';' when a mix contains ','), the first is the "
                             "reference: loopback or a --wan profile or mix (default loopback,continental)")
    parser.add_argument("--minutes", type=float, default=4.5, help="training budget of each run (default 4.5)")
    parser.add_argument("--wan-profiles", default=None, metavar="FILE", help="TOML file of extra WAN profiles")
    parser.add_argument("--checkpoint", default=None, help="base checkpoint (default: the shipped one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="run setting for every run (repeatable), as for `polis demo`")


def split_profiles(text: str) -> list[str]:
    """``loopback,continental`` -> two runs; with a ';' the runs are ';'-separated (mixes contain ',')."""
    parts = text.split(";") if ";" in text else text.split(",")
    runs = [p.strip() for p in parts if p.strip()]
    if not runs:
        raise ValueError("--profiles names no run")
    return runs


def demo_argv(profile: str, args: argparse.Namespace) -> list[str]:
    argv = ["demo", "--json", "--quiet", "--minutes", str(args.minutes)]
    if profile != "loopback":
        argv += ["--wan", profile]
        if args.wan_profiles:
            argv += ["--wan-profiles", args.wan_profiles]
    if args.checkpoint:
        argv += ["--checkpoint", args.checkpoint]
    for item in args.set:
        argv += ["--set", item]
    return argv


def profile_result(profile: str, summary: dict[str, Any], minutes: float) -> dict[str, Any]:
    """One run's figures, from ``polis demo --json``'s summary."""
    before, after = summary.get("eval_before"), summary.get("eval_after")
    seconds = summary.get("seconds") or 0.0
    relay = (summary.get("wan") or {}).get("relay") or {}
    total = relay.get("total") or {}
    return {
        "profile": profile, "eval_before": before, "eval_after": after,
        "rise_points": None if before is None or after is None else round(100 * (after - before), 1),
        "versions": summary.get("versions"), "versions_per_min": round((summary.get("versions") or 0) / minutes, 2),
        "rollouts_lost": summary.get("rollouts_lost"), "rollouts": summary.get("rollouts"),
        "tokens_per_s": round((summary.get("tokens_generated") or 0) / seconds, 1) if seconds else None,
        "train_job_seconds_mean": summary.get("train_job_seconds_mean"),
        "step_seconds_mean": summary.get("step_seconds_mean"),
        "staleness_histogram": summary.get("staleness_histogram"),
        "bytes_on_wire": summary.get("bytes_on_wire"), "seconds": seconds,
        "relay_forwarded": total.get("forwarded"), "relay_dropped_loss": total.get("dropped_loss"),
        "relay_dropped_queue": total.get("dropped_queue"), "relay_links": total.get("links"),
        "wan_profiles": (summary.get("wan") or {}).get("profiles"),
        "in_flight": summary.get("in_flight"),  # per route at the end: the pacer's limit, cycle and step times
    }


def compare(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each later profile's figures as ratios of the first's (rise, versions/min, tokens/s)."""
    ref = results[0]
    ratio = lambda a, b: None if a is None or not b else round(a / b, 3)  # noqa: E731
    return {r["profile"]: {"rise_ratio": ratio(r["rise_points"], ref["rise_points"]),
                           "versions_per_min_ratio": ratio(r["versions_per_min"], ref["versions_per_min"]),
                           "tokens_per_s_ratio": ratio(r["tokens_per_s"], ref["tokens_per_s"])}
            for r in results[1:]}


def _run_demo(profile: str, args: argparse.Namespace, out) -> dict[str, Any]:
    argv = polis_command(*demo_argv(profile, args))
    print(f"running: {' '.join(argv[-len(demo_argv(profile, args)):])}", file=out, flush=True)
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=args.minutes * 60 + RUN_SLACK_S)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    try:
        summary = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"the '{profile}' demo printed no summary (exit {done.returncode}): "
                           f"{done.stderr.strip()[-600:]}") from None
    return profile_result(profile, summary, args.minutes)


def run(args: argparse.Namespace) -> int:
    out = sys.stderr if args.json else sys.stdout
    try:
        runs = split_profiles(args.profiles)
        results = [_run_demo(profile, args, out) for profile in runs]
    except (ValueError, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"polis bench wan: {exc}", file=sys.stderr)
        return 1
    print(f"{'profile':>14} {'before':>7} {'after':>7} {'rise':>6} {'ver/min':>8} {'lost':>5} {'tok/s':>7} "
          f"{'job s':>6}  staleness", file=out)
    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    for r in results:
        print(f"{r['profile']:>14} {fmt(r['eval_before'], '7.3f')} {fmt(r['eval_after'], '7.3f')} "
              f"{fmt(r['rise_points'], '+6.1f')} {r['versions_per_min']:>8.2f} {fmt(r['rollouts_lost'], '5d')} "
              f"{fmt(r['tokens_per_s'], '7.0f')} {fmt(r['train_job_seconds_mean'], '6.2f')}  "
              f"{r['staleness_histogram']}", file=out)
    result = {"minutes_per_run": args.minutes, "profiles": results, "vs_first": compare(results)}
    if args.json:
        print(json.dumps(result))
    return 0
