"""``polis bench shard``: the sharded model's accuracy, load memory and speed, in one run.

On one checkpoint (``--model DIR``, e.g. a base made by ``polis import``, or by
default a random one of ~190 MB fp32 written to a temporary directory) and for
each S in ``--stages`` (default 2 and 4) it measures:

* ``max_abs_diff`` — the S-stage pipeline's logits against the unsplit
  ``transformers`` model, for an all-torch, an all-MLX and a mixed
  torch -> mlx -> torch -> ... pipeline (target <= 1e-5 in fp32 on the random
  model, <= 1e-4 on a real one: 30 layers and a 49 k vocabulary add rounding);
  a tied model's head is the embedding matrix, held by stage 0 and the last stage;
* ``max_abs_diff_vs_unsplit`` — the S-stage pipeline against the whole model (S = 1) on the
  same backend (the mixed chain against whole torch): what cutting the model costs by itself,
  apart from how a backend's fp32 kernels round differently from transformers' (``split_ok``;
  ``ok``, and the exit status, judge ``max_abs_diff``);
* ``max_abs_diff_vs_fp64`` and ``reference_fp32_vs_fp64`` — the same logits
  against the unsplit model run in float64, and the fp32 reference's own
  distance from it: on a deep model the fp32 target sits near rounding noise,
  and this says whether a backend is further from the true value or only
  rounds differently;
* ``stage_load_peak_mb`` vs ``full_load_peak_mb`` — peak resident memory above
  the post-import baseline of loading the largest of the S stages vs the whole
  model, each in a fresh process (``engine.bench.load_probe``); the target is
  about 1/S of the whole plus a small constant (plus the tied matrix on the
  last stage of a tied model);
* ``forward_tokens_per_s`` — in-process pipeline forward throughput per backend
  on its default device (CUDA/MPS when present; memory is always measured on CPU).

A backend that is not installed reports ``null`` and its reason under
``unavailable``. The readable table goes to stdout; ``--json`` adds one JSON
object as the last line: the checkpoint, the target, and one entry per S under
``runs``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from backends import registry
from backends.registry import TORCH_THREADS_ENV
from engine.model.checkpoint import Checkpoint
from engine.model.loader import load_stage
from engine.model.random_checkpoint import small_config, write_random_checkpoint
from engine.model.shard_plan import plan_stages
from engine.model.sharded_decode import pipeline_forward

#: fp32 target for the random checkpoint (DESIGN §8)
TARGET_MAX_ABS_DIFF = 1e-5
#: fp32 target for a real checkpoint given with --model (DESIGN §8)
REAL_MODEL_TARGET_MAX_ABS_DIFF = 1e-4


def _stage_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stages takes comma-separated integers, got {text!r}") from None
    if not counts or any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"--stages needs positive stage counts, got {text!r}")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--stages", type=_stage_counts, default=[2, 4],
                        help="pipeline stage counts S, comma-separated (default 2,4)")
    parser.add_argument("--model", "--checkpoint", dest="model", type=Path, default=None,
                        help="HF checkpoint directory (e.g. made by `polis import`) instead of a random one")
    parser.add_argument("--layers", type=int, default=12, help="layers of the random checkpoint (default 12)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the random checkpoint (default 512)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per forward pass (default 2)")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--min-time-s", type=float, default=1.0, help="minimum timing per backend (default 1 s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice; use 1 on a busy machine)")


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        os.environ[TORCH_THREADS_ENV] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="polis-bench-shard-") as tmp:
        if args.model is None:
            config = small_config(vocab_size=256, hidden_size=args.hidden, num_layers=args.layers,
                                  num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 128))
            checkpoint_dir = write_random_checkpoint(Path(tmp) / "random", config, seed=0,
                                                     max_shard_bytes=64 * 2**20)
            target = TARGET_MAX_ABS_DIFF
        else:
            checkpoint_dir = args.model
            target = REAL_MODEL_TARGET_MAX_ABS_DIFF
        report = measure(checkpoint_dir, args.stages, batch=args.batch, seq_len=args.seq_len,
                         min_time_s=args.min_time_s, target=target)
    report["checkpoint"]["path"] = str(args.model) if args.model else "random (temporary)"
    print(format_table(report))
    if args.json:
        print(json.dumps(report))
    return 0 if report["ok"] else 1


def measure(checkpoint_dir: Path, stage_counts: list[int], *, batch: int = 4, seq_len: int = 64,
            min_time_s: float = 2.0, target: float = TARGET_MAX_ABS_DIFF) -> dict:
    """Every figure of the bench as one JSON-able dict (see the module docstring)."""
    from engine.model.reference import load_reference_model, reference_logits, reference_logits_fp64

    checkpoint = Checkpoint(checkpoint_dir)
    config = checkpoint.config
    unavailable = {n: registry.unavailable_reason(n) for n in registry.names() if registry.unavailable_reason(n)}
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq_len)).astype(np.int64)

    reference = load_reference_model(checkpoint_dir)
    want = reference_logits(reference, tokens[:2])
    truth = reference_logits_fp64(reference, tokens[:2])
    del reference
    gc.collect()

    memory_backend = "torch" if "torch" not in unavailable else registry.resolve("auto")
    full = _probe(checkpoint_dir, 0, 1, memory_backend)
    whole = plan_stages(config.num_hidden_layers, 1)
    unsplit = {name: _unsplit_logits(checkpoint, whole[0], name, tokens[:2])
               for name in registry.names() if name not in unavailable}
    runs = [_measure_stages(checkpoint, s, tokens, want, truth, min_time_s, unavailable, memory_backend, full,
                            unsplit)
            for s in stage_counts]
    ok = all(d is None or d <= target for r in runs for d in r["max_abs_diff"].values())
    split_ok = all(d is None or d <= target for r in runs for d in r["max_abs_diff_vs_unsplit"].values())
    return {
        "layers": config.num_hidden_layers,
        "checkpoint": {"parameters": config.num_parameters, "tied_embeddings": config.tie_word_embeddings,
                       "fp32_mb": round(checkpoint.stage_nbytes(whole[0]) / 2**20, 1)},
        "max_abs_diff_target": target,
        #: the yardstick's own rounding: unsplit transformers fp32 vs the same model in fp64
        "reference_fp32_vs_fp64": float(np.abs(want.astype(np.float64) - truth).max()),
        "max_abs_logit": float(np.abs(truth).max()),
        "ok": ok,  #: every pipeline within the target of transformers
        "split_ok": split_ok,  #: every pipeline within the target of the whole model on its own backend
        "full_load_peak_mb": full["load_peak_mb"],
        "full_fp32_mb": full["stage_fp32_mb"],
        "memory_backend": memory_backend,
        "forward_shape": [batch, seq_len],
        "runs": runs,
        "unavailable": unavailable,
    }


def _unsplit_logits(checkpoint: Checkpoint, spec, backend: str, tokens: np.ndarray) -> np.ndarray:
    """The whole model (one stage) on ``backend``: the yardstick of what cutting it costs there."""
    stage = load_stage(checkpoint, spec, backend)
    try:
        return pipeline_forward([stage], tokens)
    finally:
        stage.close()
        gc.collect()


def _measure_stages(checkpoint: Checkpoint, num_stages: int, tokens: np.ndarray, want: np.ndarray,
                    truth: np.ndarray, min_time_s: float, unavailable: dict[str, str], memory_backend: str,
                    full: dict, unsplit: dict[str, np.ndarray]) -> dict:
    plan = plan_stages(checkpoint.config.num_hidden_layers, num_stages)
    chains = {name: [name] * num_stages for name in registry.names()}
    chains["mixed"] = [("torch", "mlx")[i % 2] for i in range(num_stages)]  # torch, mlx, torch, mlx, ...
    diffs: dict[str, float | None] = {}
    diffs_unsplit: dict[str, float | None] = {}
    diffs_fp64: dict[str, float | None] = {}
    speeds: dict[str, float | None] = {}
    devices: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for label, chain in chains.items():
        missing = [b for b in set(chain) if b in unavailable]
        if missing or (label == "mixed" and num_stages < 2):
            diffs[label] = diffs_fp64[label] = diffs_unsplit[label] = None
            skipped[label] = "needs at least 2 stages" if not missing else f"needs {', '.join(missing)}"
            if label != "mixed":
                speeds[label] = None
            continue
        stages = [load_stage(checkpoint, spec, b) for spec, b in zip(plan, chain)]
        devices.update({stage.name: stage.device for stage in stages})
        try:
            got = pipeline_forward(stages, tokens[:2])
            diffs[label] = float(np.abs(got - want).max())
            diffs_unsplit[label] = float(np.abs(got - unsplit[chain[0]]).max())
            diffs_fp64[label] = float(np.abs(got.astype(np.float64) - truth).max())
            if label != "mixed":
                speeds[label] = _tokens_per_s(stages, tokens, min_time_s)
        finally:
            for stage in stages:
                stage.close()
        gc.collect()
    memory = measure_load_memory(checkpoint.path, num_stages, memory_backend, full=full)
    for key in ("full_load_peak_mb", "full_fp32_mb", "memory_backend"):  # reported once, at the top
        memory.pop(key)
    return {"stages": num_stages, "max_abs_diff": diffs, "max_abs_diff_vs_unsplit": diffs_unsplit,
            "max_abs_diff_vs_fp64": diffs_fp64,
            "forward_tokens_per_s": speeds, "devices": devices,
            "skipped": skipped, **memory}


def measure_load_memory(checkpoint_dir: Path, num_stages: int, backend: str = "torch", *,
                        full: dict | None = None) -> dict:
    """Load peak (MB above baseline) of the whole model and of each of S stages, each in a fresh process."""
    full = full if full is not None else _probe(checkpoint_dir, 0, 1, backend)
    per_stage = [_probe(checkpoint_dir, i, num_stages, backend) for i in range(num_stages)]
    stage_peak = max(p["load_peak_mb"] for p in per_stage)
    return {
        "stage_load_peak_mb": stage_peak,
        "full_load_peak_mb": full["load_peak_mb"],
        "stage_to_full_ratio": round(stage_peak / full["load_peak_mb"], 3) if full["load_peak_mb"] > 0 else None,
        "ideal_ratio": round(1 / num_stages, 3),
        #: what the largest stage must hold, as a share of the whole (a tied head is held twice)
        "stage_fp32_ratio": round(max(p["stage_fp32_mb"] for p in per_stage) / full["stage_fp32_mb"], 3)
        if full["stage_fp32_mb"] else None,
        "stage_load_peak_mb_per_stage": [p["load_peak_mb"] for p in per_stage],
        "stage_fp32_mb_per_stage": [p["stage_fp32_mb"] for p in per_stage],
        "full_fp32_mb": full["stage_fp32_mb"],
        "memory_backend": backend,
    }


def _tokens_per_s(stages, tokens: np.ndarray, min_time_s: float) -> float:
    pipeline_forward(stages, tokens)  # warm-up
    runs, start = 0, time.perf_counter()
    while runs < 2 or time.perf_counter() - start < min_time_s:
        pipeline_forward(stages, tokens)
        runs += 1
    return round(runs * tokens.size / (time.perf_counter() - start), 1)


def _probe(checkpoint_dir: Path, stage: int, num_stages: int, backend: str) -> dict:
    cmd = [sys.executable, "-m", "engine.bench.load_probe", "--checkpoint", str(checkpoint_dir),
           "--stage", str(stage), "--stages", str(num_stages), "--backend", backend]
    if backend == "torch":
        cmd += ["--device", "cpu"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                            cwd=Path(__file__).resolve().parents[2])
    if result.returncode != 0:
        raise RuntimeError(f"load probe failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def format_table(report: dict) -> str:
    def num(value, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    ckpt = report["checkpoint"]
    rows = [
        ("checkpoint", f"{ckpt['path']}: {report['layers']} layers, {ckpt['parameters'] / 1e6:.1f} M params, "
                       f"{ckpt['fp32_mb']} MB fp32{', tied embeddings' if ckpt['tied_embeddings'] else ''}"),
        ("load peak, whole model", f"{report['full_load_peak_mb']:.1f} MB ({report['memory_backend']})"),
        ("transformers fp32 vs fp64", f"{report['reference_fp32_vs_fp64']:.2e}  (the yardstick's own rounding; "
                                      f"max |logit| {report['max_abs_logit']:.1f})"),
    ]
    for run in report["runs"]:
        s = run["stages"]
        rows += [
            *((f"S={s} max |logits - transformers| {k}",
               f"{num(v, '.2e')}  (target <= {report['max_abs_diff_target']:.0e}; vs fp64 "
               f"{num(run['max_abs_diff_vs_fp64'][k], '.2e')})"
               + (f"  [{run['skipped'][k]}]" if k in run["skipped"] else ""))
              for k, v in run["max_abs_diff"].items()),
            *((f"S={s} max |logits - unsplit, same backend| {k}", num(v, ".2e"))
              for k, v in run["max_abs_diff_vs_unsplit"].items()),
            (f"S={s} load peak, largest stage",
             f"{run['stage_load_peak_mb']:.1f} MB  (per stage: "
             f"{', '.join(f'{m:.1f}' for m in run['stage_load_peak_mb_per_stage'])})"),
            (f"S={s} stage / whole", f"{num(run['stage_to_full_ratio'], '.3f')}  (1/S = {run['ideal_ratio']:.3f}; "
                                     f"largest stage's own fp32 share {num(run['stage_fp32_ratio'], '.3f')})"),
            *((f"S={s} forward tokens/s {k}", f"{num(v, ',.0f')}  (batch x seq = {report['forward_shape'][0]} x "
                                              f"{report['forward_shape'][1]}, in-process on "
                                              f"{run['devices'].get(k, 'n/a')})")
              for k, v in run["forward_tokens_per_s"].items()),
        ]
    rows += [(f"unavailable: {k}", v) for k, v in report["unavailable"].items()]
    rows.append(("split == whole, same backend", "OK" if report.get("split_ok") else "FAILED: cutting the model "
                 "changed its logits beyond the target"))
    rows.append(("result", "OK" if report["ok"] else "FAILED: a pipeline's logits are off target"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
