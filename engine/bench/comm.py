"""``polis bench comm``: what each communication scheme costs in bytes and in learning.

For each scheme of :data:`SCHEMES` (a name and a list of run-setting overrides, as ``polis
demo --set`` takes them) one run of the tiny demo swarm, 2 stages x 2 replicas over WebRTC
on loopback, from the shipped base to ``--versions`` versions, held-out greedy evals every
``--eval-every``. Per scheme, from the coordinator's stats API:

* **replica-update bytes per trained sample** — bytes the replicas sent each other for
  their updates (gradient shares every step, or pseudo-gradients at DiLoCo syncs), over
  the samples trained on; and the ratio against the ``int8_every_step`` row (today's default)
  and against dense fp32 every step;
* **activation bytes per trained sample** — every byte on the wire (the nodes' ledger) minus
  the update bytes, per sample: activations and their gradients, tokens, control;
* **held-out accuracy at equal samples** — the scheme's eval curve against the
  ``dense_fp32_every_step`` row's at the same versions (every version trains on the same
  number of rows, so equal versions are equal samples; the table shows the samples);
* **wall clock** — seconds of the training run (meaningful only on an otherwise idle machine;
  the JSON says whether ``--contended`` was given).

The weight stream to inference replicas is not part of these runs (the demo swarm has none):
``--weights`` adds the bytes per version of each weight-delta encoding on the tiny base
(``polis bench weights``: int8 per-row deltas against exact sparse fp32 / bf16 deltas).

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


#: the rows, in order; the first two are the references the others are measured against
SCHEMES: list[Scheme] = [
    Scheme("dense_fp32_every_step", ("update_encoding=fp32",), "fp32 gradients, every step"),
    Scheme("int8_every_step", ("update_encoding=int8",), "int8 per-row gradients, every step (today's default)"),
    Scheme("diloco_h8_int8", ("replica_sync.mode=diloco", "replica_sync.inner_steps=8", "replica_sync.encoding=int8"),
           "DiLoCo: 8 inner steps, int8 pseudo-gradients, averaging"),
    Scheme("sparseloco_h8_top2_2bit", ("replica_sync.mode=diloco", "replica_sync.inner_steps=8",
                                       "replica_sync.encoding=topk", "replica_sync.topk_fraction=0.02",
                                       "replica_sync.value_bits=2"),
           "SparseLoCo: 8 inner steps, top 2 %, 2-bit values, error feedback"),
    Scheme("diloco_h16_dense2bit", ("replica_sync.mode=diloco", "replica_sync.inner_steps=16",
                                    "replica_sync.encoding=topk", "replica_sync.topk_fraction=1.0",
                                    "replica_sync.value_bits=2"),
           "DiLoCo: 16 inner steps, every entry at 2 bits, error feedback"),
    Scheme("diloco_h64_int8", ("replica_sync.mode=diloco", "replica_sync.inner_steps=64",
                               "replica_sync.encoding=int8"),
           "DiLoCo: 64 inner steps, int8 pseudo-gradients, averaging"),
]
DENSE, INT8 = "dense_fp32_every_step", "int8_every_step"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--checkpoint", default=None, help="base checkpoint (default: the shipped one)")
    parser.add_argument("--versions", type=int, default=240, help="policy versions per scheme (default 240)")
    parser.add_argument("--eval-every", type=int, default=60, help="versions between held-out evals (default 60)")
    parser.add_argument("--schemes", default=",".join(s.name for s in SCHEMES),
                        help="comma-separated scheme names (default: all): " + ", ".join(s.name for s in SCHEMES))
    parser.add_argument("--contended", action="store_true",
                        help="say in the output that other work shared the CPU (wall clock not comparable)")
    parser.add_argument("--out", default=None,
                        help="JSON file the rows are written to after every scheme; schemes already in it are "
                             "not run again (a long bench interrupted goes on where it stopped)")
    parser.add_argument("--weights", action="store_true",
                        help="also measure weight-delta bytes per version (tiny base, in process)")


def _scheme(name: str) -> Scheme:
    for s in SCHEMES:
        if s.name == name:
            return s
    raise SystemExit(f"unknown scheme {name!r}; choose from {', '.join(s.name for s in SCHEMES)}")


def _row(scheme: Scheme, result: dict[str, Any], wire_bytes: int) -> dict[str, Any]:
    curve = result["curve"]
    samples = max(1, curve[-1]["samples"])
    return {"scheme": scheme.name, "what": scheme.what, "settings": list(scheme.settings),
            "samples": curve[-1]["samples"], "update_bytes": result["update_bytes"],
            "dense_update_bytes": result["dense_update_bytes"],
            "update_bytes_per_sample": result["update_bytes"] / samples,
            "other_wire_bytes_per_sample": max(0, wire_bytes - result["update_bytes"]) / samples,
            "curve": curve, "accuracy_start": curve[0]["accuracy"], "accuracy_final": curve[-1]["accuracy"],
            "seconds": result["seconds"], "staleness_histogram": result["staleness_histogram"]}


def compare(rows: list[dict[str, Any]]) -> None:
    """Add ratios against the int8 row and accuracy gaps against the dense row (in place)."""
    by_name = {r["scheme"]: r for r in rows}
    int8, dense = by_name.get(INT8), by_name.get(DENSE)
    for r in rows:
        r["update_reduction_vs_int8_every_step"] = (
            int8["update_bytes_per_sample"] / r["update_bytes_per_sample"]
            if int8 and r["update_bytes_per_sample"] > 0 else None)
        r["update_ratio_vs_dense_every_step"] = (
            r["update_bytes_per_sample"] / dense["update_bytes_per_sample"]
            if dense and dense["update_bytes_per_sample"] > 0 else None)
        if dense:
            pairs = [(p, q) for p in r["curve"] for q in dense["curve"] if q["version"] == p["version"]]
            gaps = [100.0 * (p["accuracy"] - q["accuracy"]) for p, q in pairs[1:]]
            r["accuracy_gap_points_vs_dense"] = gaps[-1] if gaps else None
            r["accuracy_gap_points_vs_dense_mean"] = sum(gaps) / len(gaps) if gaps else None
        r["meets_target"] = bool(r.get("update_reduction_vs_int8_every_step") and
                                 r["update_reduction_vs_int8_every_step"] >= 50 and
                                 r.get("accuracy_gap_points_vs_dense") is not None and
                                 r["accuracy_gap_points_vs_dense"] >= -5.0)


def _train(base: str, tmp: Path, args: argparse.Namespace, scheme: Scheme, out) -> dict[str, Any]:
    """One scheme's swarm run; a swarm that did not start (a machine too busy to start five
    processes in time) is tried once more."""
    from engine.bench.swarm import _swarm_training

    for attempt in (1, 2):
        try:
            return _swarm_training(base, tmp / f"try{attempt}", args.versions, args.eval_every, scheme.settings)
        except RuntimeError as exc:
            if attempt == 2 or "did not start" not in str(exc):
                raise
            print(f"   {exc}; trying once more", file=out, flush=True)
    raise AssertionError("unreachable")


def _saved_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rows of an earlier run of the same bench (same versions and eval spacing) from ``--out``."""
    if not args.out or not Path(args.out).exists():
        return []
    saved = json.loads(Path(args.out).read_text())
    if (saved.get("versions"), saved.get("eval_every")) != (args.versions, args.eval_every):
        raise SystemExit(f"{args.out} holds a run of other --versions / --eval-every; give another --out")
    return list(saved.get("rows", []))


def _save_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    if args.out:
        from engine.atomic_file import atomic_write_bytes

        atomic_write_bytes(Path(args.out), json.dumps({"versions": args.versions, "eval_every": args.eval_every,
                                                       "rows": rows}).encode())


def run(args: argparse.Namespace) -> int:
    from engine.bench.swarm import _base

    base = _base(args)
    out = sys.stderr if args.json else sys.stdout
    schemes = [_scheme(n.strip()) for n in args.schemes.split(",") if n.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="polis-bench-comm-"))
    rows, started = _saved_rows(args), time.monotonic()
    try:
        for i, scheme in enumerate(schemes, start=1):
            if any(r["scheme"] == scheme.name for r in rows):
                print(f"{i}/{len(schemes)} {scheme.name}: already in {args.out}", file=out, flush=True)
                continue
            print(f"{i}/{len(schemes)} {scheme.name}: {args.versions} versions, 2 stages x 2 replicas...",
                  file=out, flush=True)
            trained = _train(base, tmp / scheme.name, args, scheme, out)
            rows.append(_row(scheme, trained, trained.get("bytes_on_wire", 0)))
            _save_rows(args, rows)
            print(f"   {rows[-1]['update_bytes_per_sample']:.1f} update bytes/sample, accuracy "
                  f"{rows[-1]['accuracy_start']:.3f} -> {rows[-1]['accuracy_final']:.3f} in {trained['seconds']} s",
                  file=out, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    compare(rows)
    result: dict[str, Any] = {"versions": args.versions, "eval_every": args.eval_every, "rows": rows,
                              "contended": bool(args.contended), "seconds": round(time.monotonic() - started, 1),
                              "targets": {"update_reduction_vs_int8_every_step": 50,
                                          "accuracy_gap_points_vs_dense": -5}}
    if args.weights:
        from engine.bench.weight_stream import measure

        result["weight_deltas"] = measure(argparse.Namespace(checkpoint=args.checkpoint, stages=2, versions=20,
                                                             seed=0, lr=None))
    print(f"{'scheme':<26} {'upd B/sample':>12} {'vs int8':>8} {'other B/s':>10} {'acc':>6} {'gap':>6} {'s':>6}",
          file=out)
    for r in rows:
        red = r["update_reduction_vs_int8_every_step"]
        gap = r.get("accuracy_gap_points_vs_dense")
        print(f"{r['scheme']:<26} {r['update_bytes_per_sample']:>12.1f} "
              f"{(f'{red:.0f}x' if red else '-'):>8} {r['other_wire_bytes_per_sample']:>10.0f} "
              f"{r['accuracy_final']:>6.3f} {(f'{gap:+.1f}' if gap is not None else '-'):>6} {r['seconds']:>6.0f}",
              file=out)
    if args.json:
        print(json.dumps(result))
    return 0
