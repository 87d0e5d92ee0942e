"""``polis bench comm``: what each communication scheme costs in bytes and in learning.

For each scheme of :data:`SCHEMES` (a name and a list of run-setting overrides, as ``polis
demo --set`` takes them) one run per ``--seeds`` seed of the tiny demo swarm, 2 stages x 2
replicas over WebRTC on loopback, from the shipped base to ``--versions`` versions, held-out
greedy evals every ``--eval-every``. Per scheme, from the coordinator's stats API:

* **replica-update bytes per trained sample** — bytes the replicas sent each other for
  their updates (gradient shares every step, or pseudo-gradients at DiLoCo syncs), over
  the samples trained on; and the ratio against the ``int8_every_step`` row (today's default)
  and against dense fp32 every step;
* **activation bytes per trained sample** — every byte on the wire (the nodes' ledger) minus
  the update bytes, per sample: activations and their gradients, tokens, control;
* **held-out accuracy at equal samples** — the scheme's eval curve (the mean over the seeds
  at each eval version) against the ``dense_fp32_every_step`` row's at the same versions
  (every version trains on about the same number of rows, so equal versions are equal
  samples; the table shows the samples); the gap at the last eval and the mean gap over all
  evals after version 0. One seed of the tiny run is noisy (two dense runs have ended 5
  points apart on the steep part of the curve), hence ``--seeds``;
* **wall clock** — versions per minute of the training run on loopback and, with ``--wan
  PROFILE``, of a ``--wan-versions`` run of the same scheme over that emulated internet
  (``polis demo --wan``), from the coordinator's version timestamps (meaningful only on an
  otherwise idle machine; the JSON says whether ``--contended`` was given).

The weight stream to inference replicas is not part of these runs (the demo swarm has none):
``--weights`` adds the bytes per version of each weight-delta encoding on the tiny base
(``polis bench weights``: int8 per-row deltas against exact sparse fp32 / bf16 deltas).

With ``--model DIR`` (a real model) the same question is asked of LoRA adapters in process
instead (``engine.bench.comm_real``): dense fp32 every step, then each diloco scheme of
``--schemes`` with ``--real-replicas`` replicas, ``--real-versions`` versions, the first seed.

Other benches add rows by appending to :data:`SCHEMES` (e.g. activation codecs). The last
stdout line is the JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Scheme:
    """One row of the bench: a named set of run-setting overrides."""

    name: str
    settings: tuple[str, ...]
    what: str  #: one line for the table


def _dense_diloco(inner_steps: int, value_bits: int, *more: str) -> tuple[str, ...]:
    """Settings of DiLoCo sending every entry of its pseudo-gradients at ``value_bits`` (no indices)."""
    return ("replica_sync.mode=diloco", f"replica_sync.inner_steps={inner_steps}", "replica_sync.encoding=topk",
            "replica_sync.topk_fraction=1.0", f"replica_sync.value_bits={value_bits}", *more)


#: the rows, in order; the first two are the references the others are measured against
SCHEMES: list[Scheme] = [
    Scheme("dense_fp32_every_step", ("update_encoding=fp32",), "fp32 gradients, every step"),
    Scheme("int8_every_step", ("update_encoding=int8",), "int8 per-row gradients, every step (today's default)"),
    Scheme("diloco_h1_fp32", ("replica_sync.mode=diloco", "replica_sync.inner_steps=1", "replica_sync.encoding=fp32"),
           "DiLoCo at H=1, lossless: each replica's own AdamW step, then the mean (no saving; isolates local AdamW)"),
    Scheme("act_fp32", ("activation_encoding=fp32",),
           "activations and their gradients as float32 (the reference of the activation rows)"),
    Scheme("act_basis_r32", ("activation_encoding=basis_r32",),
           "activations and their gradients as rank-32 coefficients in a per-stage basis sent once per link"),
    Scheme("act_basis_r32_b4", ("activation_encoding=basis_r32_b4",),
           "the same with 4-bit coefficient codes"),
    Scheme("act_basis_r24_b4", ("activation_encoding=basis_r24_b4",),
           "activations and their gradients as rank-24 coefficients with 4-bit codes"),
    Scheme("diloco_h8_int8", ("replica_sync.mode=diloco", "replica_sync.inner_steps=8", "replica_sync.encoding=int8"),
           "DiLoCo: 8 inner steps, int8 pseudo-gradients, averaging"),
    Scheme("sparseloco_h8_top2_2bit", ("replica_sync.mode=diloco", "replica_sync.inner_steps=8",
                                       "replica_sync.encoding=topk", "replica_sync.topk_fraction=0.02",
                                       "replica_sync.value_bits=2"),
           "SparseLoCo: 8 inner steps, top 2 %, 2-bit values, error feedback"),
    Scheme("diloco_h16_dense2bit", _dense_diloco(16, 2),
           "DiLoCo: 16 inner steps, every entry at 2 bits, error feedback"),
    Scheme("diloco_h16_2bit_mse", _dense_diloco(16, 2, "replica_sync.value_scale=mse"),
           "DiLoCo: 16 inner steps, every entry at 2 bits with least-squared-error scales, error feedback"),
    Scheme("diloco_h16_2bit_mse_lr", _dense_diloco(16, 2, "replica_sync.value_scale=mse", "lr=4.24e-4"),
           "the same with the inner AdamW's rate x sqrt(2) (a half-batch's noisier gradient shrinks its step)"),
    Scheme("diloco_h8_1bit_mse_lr", _dense_diloco(8, 1, "replica_sync.value_scale=mse", "lr=4.24e-4"),
           "DiLoCo: 8 inner steps, every entry as a sign and a block scale, error feedback, inner rate x sqrt(2)"),
    Scheme("diloco_h16_1bit_mse", _dense_diloco(16, 1, "replica_sync.value_scale=mse"),
           "DiLoCo: 16 inner steps, every entry as a sign and a block scale, error feedback"),
    Scheme("diloco_h32_1bit_mse", _dense_diloco(32, 1, "replica_sync.value_scale=mse"),
           "DiLoCo: 32 inner steps, every entry as a sign and a block scale, error feedback"),
    Scheme("diloco_h64_int8", ("replica_sync.mode=diloco", "replica_sync.inner_steps=64",
                               "replica_sync.encoding=int8"),
           "DiLoCo: 64 inner steps, int8 pseudo-gradients, averaging"),
]
DENSE, INT8 = "dense_fp32_every_step", "int8_every_step"
#: the reference of the rows that change ``activation_encoding`` (their bytes and accuracy are
#: measured against it: the other rows' activations are int8 rows)
ACT_FP32 = "act_fp32"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.swarm.demo import add_wan_arguments

    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--checkpoint", default=None, help="base checkpoint (default: the shipped one)")
    parser.add_argument("--versions", type=int, default=320, help="policy versions per scheme (default 320)")
    parser.add_argument("--eval-every", type=int, default=80, help="versions between held-out evals (default 80)")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated run seeds; each scheme runs once per seed and its curve is the "
                             "mean (default 0)")
    parser.add_argument("--schemes", default=",".join(s.name for s in SCHEMES),
                        help="comma-separated scheme names (default: all): " + ", ".join(s.name for s in SCHEMES))
    parser.add_argument("--contended", action="store_true",
                        help="say in the output that other work shared the CPU (wall clock not comparable)")
    parser.add_argument("--out", default=None,
                        help="JSON file the runs are written to after each one; runs already in it are "
                             "not run again (a long bench interrupted goes on where it stopped)")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: the table of the runs already in --out (each scheme with the seeds "
                             "it has there)")
    parser.add_argument("--weights", action="store_true",
                        help="also measure weight-delta bytes per version (tiny base, in process)")
    add_wan_arguments(parser)  # --wan: one more, shorter run per scheme over the emulated internet
    parser.add_argument("--wan-versions", type=int, default=60,
                        help="versions of each scheme's run over --wan (default 60)")
    parser.add_argument("--model", type=Path, default=None,
                        help="imported real model (e.g. <data dir>/models/smollm2-135m): run --real-versions "
                             "in process instead of the tiny swarm (engine.bench.comm_real)")
    parser.add_argument("--real-versions", type=int, default=64,
                        help="with --model: versions per scheme (default 64; ~15 s a version on 2 cores)")
    parser.add_argument("--real-eval-every", type=int, default=16,
                        help="with --model: versions between held-out evals, a multiple of every scheme's "
                             "inner steps (default 16)")
    parser.add_argument("--real-replicas", type=int, default=2, help="with --model: replicas per stage (default 2)")


def _scheme(name: str) -> Scheme:
    for s in SCHEMES:
        if s.name == name:
            return s
    raise SystemExit(f"unknown scheme {name!r}; choose from {', '.join(s.name for s in SCHEMES)}")


def mean_curve(curves: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per eval version present in every curve: the mean samples and accuracy, with the spread."""
    common = set.intersection(*({p["version"] for p in c} for c in curves)) if curves else set()
    out = []
    for version in sorted(common):
        points = [next(p for p in c if p["version"] == version) for c in curves]
        accuracies = [float(p["accuracy"]) for p in points]
        out.append({"version": version, "samples": round(sum(p["samples"] for p in points) / len(points)),
                    "accuracy": sum(accuracies) / len(accuracies),
                    "accuracy_range": [min(accuracies), max(accuracies)]})
    return out


def scheme_row(scheme: Scheme, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One scheme's row from its runs (one per seed): per-sample figures are over all runs."""
    curve = mean_curve([r["curve"] for r in runs])
    samples = max(1, sum(r["curve"][-1]["samples"] for r in runs))
    update = sum(r["update_bytes"] for r in runs)
    wire = sum(r.get("bytes_on_wire", 0) for r in runs)
    paces = [r["versions_per_min"] for r in runs if r.get("versions_per_min")]
    return {"scheme": scheme.name, "what": scheme.what, "settings": list(scheme.settings),
            "seeds": [r["seed"] for r in runs], "runs": runs, "samples": curve[-1]["samples"],
            "update_bytes": update / len(runs),
            "dense_update_bytes": sum(r["dense_update_bytes"] for r in runs) / len(runs),
            "update_bytes_per_sample": update / samples,
            "other_wire_bytes_per_sample": max(0, wire - update) / samples,
            "curve": curve, "accuracy_start": curve[0]["accuracy"], "accuracy_final": curve[-1]["accuracy"],
            "seconds": sum(r["seconds"] for r in runs),
            "versions_per_min": sum(paces) / len(paces) if paces else None,
            "staleness_histogram": runs[0]["staleness_histogram"]}


def _gaps(row: dict[str, Any], reference: dict[str, Any]) -> tuple[float | None, float | None]:
    """Accuracy points of ``row`` minus ``reference`` at the last common eval, and their mean
    over the common evals after version 0."""
    pairs = [(p, q) for p in row["curve"] for q in reference["curve"] if q["version"] == p["version"]]
    gaps = [100.0 * (p["accuracy"] - q["accuracy"]) for p, q in pairs[1:]]
    return (gaps[-1], sum(gaps) / len(gaps)) if gaps else (None, None)


def _within(gaps: tuple[float | None, float | None], points: float = 5.0) -> bool:
    last, mean = gaps
    return last is not None and mean is not None and last >= -points and mean >= -points


def compare(rows: list[dict[str, Any]]) -> None:
    """Add ratios against the int8 row and accuracy gaps against the dense row (in place); rows
    that change the activation encoding also get their other-wire bytes and accuracy against
    the ``act_fp32`` row (target: 16x fewer bytes within 5 points)."""
    by_name = {r["scheme"]: r for r in rows}
    int8, dense, act_fp32 = by_name.get(INT8), by_name.get(DENSE), by_name.get(ACT_FP32)
    for r in rows:
        r["update_reduction_vs_int8_every_step"] = (
            int8["update_bytes_per_sample"] / r["update_bytes_per_sample"]
            if int8 and r["update_bytes_per_sample"] > 0 else None)
        r["update_ratio_vs_dense_every_step"] = (
            r["update_bytes_per_sample"] / dense["update_bytes_per_sample"]
            if dense and dense["update_bytes_per_sample"] > 0 else None)
        gaps = _gaps(r, dense) if dense else (None, None)
        if dense:
            r["accuracy_gap_points_vs_dense"], r["accuracy_gap_points_vs_dense_mean"] = gaps
        r["meets_target"] = bool(r.get("update_reduction_vs_int8_every_step") and
                                 r["update_reduction_vs_int8_every_step"] >= 50 and _within(gaps))
        if act_fp32 and r is not act_fp32 and any(s.startswith("activation_encoding=") for s in r.get("settings", ())):
            other = r["other_wire_bytes_per_sample"]
            r["other_wire_reduction_vs_act_fp32"] = act_fp32["other_wire_bytes_per_sample"] / other if other else None
            act_gaps = _gaps(r, act_fp32)
            r["accuracy_gap_points_vs_act_fp32"], r["accuracy_gap_points_vs_act_fp32_mean"] = act_gaps
            r["meets_activation_target"] = bool(r["other_wire_reduction_vs_act_fp32"]
                                                and r["other_wire_reduction_vs_act_fp32"] >= 16 and _within(act_gaps))


def _train(base: str, tmp: Path, versions: int, eval_every: int, settings: list[str],
           wan: tuple[str | None, str | None], out) -> dict[str, Any]:
    """One swarm run; a swarm that did not start (a machine too busy to start five processes
    in time) is tried once more."""
    from engine.bench.swarm import _swarm_training

    for attempt in (1, 2):
        try:
            return _swarm_training(base, tmp / f"try{attempt}", versions, eval_every, settings, wan)
        except RuntimeError as exc:
            if attempt == 2 or "did not start" not in str(exc):
                raise
            print(f"   {exc}; trying once more", file=out, flush=True)
    raise AssertionError("unreachable")


def _saved(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Runs of an earlier run of the same bench (same versions and eval spacing) from ``--out``,
    by run key (scheme, seed or WAN profile)."""
    if not args.out or not Path(args.out).exists():
        return {}
    saved = json.loads(Path(args.out).read_text())
    if (saved.get("versions"), saved.get("eval_every")) != (args.versions, args.eval_every):
        raise SystemExit(f"{args.out} holds a run of other --versions / --eval-every; give another --out")
    return dict(saved.get("runs", {}))


def _save(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> None:
    if args.out:
        from engine.atomic_file import atomic_write_bytes

        atomic_write_bytes(Path(args.out), json.dumps({"versions": args.versions, "eval_every": args.eval_every,
                                                       "runs": runs}).encode())


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds takes comma-separated integers, e.g. 0,1; got {text!r}") from None
    if not seeds or min(seeds) < 0:
        raise SystemExit("--seeds needs at least one seed >= 0")
    return seeds


def _run_real(args: argparse.Namespace) -> int:
    """``--model``: dense fp32 and the diloco schemes of ``--schemes`` on the real model, in process."""
    from engine.bench.comm_real import DENSE as REAL_DENSE
    from engine.bench.comm_real import format_table, real_replica_sync

    if not (args.model / "config.json").exists():
        raise SystemExit(f"no model in {args.model} (import one with `polis import smollm2-135m`)")
    chosen = [_scheme(n.strip()) for n in args.schemes.split(",") if n.strip()]
    diloco = [s for s in chosen if "replica_sync.mode=diloco" in s.settings]
    if not diloco or args.real_versions < 1 or args.real_replicas < 2:
        raise SystemExit("--model needs --schemes with a diloco scheme (dense fp32 is the reference), "
                         "--real-versions >= 1 and --real-replicas >= 2")
    schemes = [(REAL_DENSE, _scheme(REAL_DENSE).settings)] + [(s.name, s.settings) for s in diloco]
    try:
        result = real_replica_sync(args.model, schemes, args.real_versions, args.real_eval_every,
                                   args.real_replicas, [f"seed={_seeds(args.seeds)[0]}"])
    except ValueError as exc:
        raise SystemExit(f"polis bench comm: {exc}") from None
    print(format_table(result), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0


def run(args: argparse.Namespace) -> int:
    from engine.bench.comm_table import print_table

    if args.model is not None:
        return _run_real(args)
    from engine.bench.swarm import _base

    base = _base(args)
    out = sys.stderr if args.json else sys.stdout
    schemes, seeds = [_scheme(n.strip()) for n in args.schemes.split(",") if n.strip()], _seeds(args.seeds)
    tmp = Path(tempfile.mkdtemp(prefix="polis-bench-comm-"))
    runs, started = _saved(args), time.monotonic()
    if args.report_only and not args.out:
        raise SystemExit("--report-only reads the runs of --out FILE; give it")
    plan = [] if args.report_only else (
        [(s, seed, None) for s in schemes for seed in seeds] + ([(s, seeds[0], args.wan) for s in schemes]
                                                                if args.wan else []))
    try:
        for i, (scheme, seed, wan) in enumerate(plan, start=1):
            key = f"{scheme.name}@{wan}" if wan else f"{scheme.name}#{seed}"
            if key in runs:
                print(f"{i}/{len(plan)} {key}: already in {args.out}", file=out, flush=True)
                continue
            versions, every = (args.wan_versions, args.wan_versions) if wan else (args.versions, args.eval_every)
            print(f"{i}/{len(plan)} {key}: {versions} versions, 2 stages x 2 replicas"
                  + (f" over '{wan}'" if wan else " on loopback") + "...", file=out, flush=True)
            trained = _train(base, tmp / key.replace("#", "-").replace("@", "-"), versions, every,
                             [*scheme.settings, f"seed={seed}"], (wan, args.wan_profiles) if wan else (None, None), out)
            runs[key] = {"seed": seed, "wan": wan, **trained}
            _save(args, runs)
            curve = trained["curve"]
            pace = trained["versions_per_min"]
            print(f"   accuracy {curve[0]['accuracy']:.3f} -> {curve[-1]['accuracy']:.3f}, "
                  f"{trained['update_bytes'] / max(1, curve[-1]['samples']):.1f} update bytes/sample, "
                  + (f"{pace:.1f} versions/min" if pace else "pace unknown"), file=out, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.report_only:  # every seed each scheme has in --out
        have = {s.name: sorted(int(k.split("#")[1]) for k in runs if k.split("#")[0] == s.name and "#" in k)
                for s in schemes}
        schemes = [s for s in schemes if have[s.name]]
        seeds_of = have
    else:
        seeds_of = {s.name: seeds for s in schemes}
    rows = [scheme_row(s, [runs[f"{s.name}#{seed}"] for seed in seeds_of[s.name]]) for s in schemes]
    compare(rows)
    for row in rows:
        wan_run = runs.get(f"{row['scheme']}@{args.wan}") if args.wan else None
        row["wan"] = None if wan_run is None else {
            "profile": args.wan, "versions": args.wan_versions, "versions_per_min": wan_run["versions_per_min"],
            "update_bytes_per_sample": wan_run["update_bytes"] / max(1, wan_run["curve"][-1]["samples"]),
            "accuracy_final": wan_run["curve"][-1]["accuracy"], "seconds": wan_run["seconds"]}
    result: dict[str, Any] = {"versions": args.versions, "eval_every": args.eval_every,
                              "seeds": sorted({x for v in seeds_of.values() for x in v}),
                              "wan": args.wan, "rows": rows, "contended": bool(args.contended),
                              "seconds": round(time.monotonic() - started, 1),
                              "targets": {"update_reduction_vs_int8_every_step": 50,
                                          "accuracy_gap_points_vs_dense": -5}}
    if args.weights:
        from engine.bench.weight_stream import measure

        result["weight_deltas"] = measure(argparse.Namespace(checkpoint=args.checkpoint, stages=2, versions=20,
                                                             seed=0, lr=None, lora_rank=0))
    print_table(result, out)
    if args.json:
        print(json.dumps(result))
    return 0
