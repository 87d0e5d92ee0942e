"""``polis bench shard``: the sharded model's accuracy, load memory and speed, in one run.

On one checkpoint (a random one of ~190 MB fp32 written to a temporary
directory, or ``--checkpoint PATH``) it measures:

* ``max_abs_diff`` — the S-stage pipeline's logits against the unsplit
  ``transformers`` model, for an all-torch, an all-MLX and a mixed
  torch -> mlx -> torch -> ... pipeline (target <= 1e-5 in fp32);
* ``stage_load_peak_mb`` vs ``full_load_peak_mb`` — peak resident memory above
  the post-import baseline of loading the largest of the S stages vs the whole
  model, each in a fresh process (``engine.bench.load_probe``); the target is
  about 1/S of the whole plus a small constant;
* ``forward_tokens_per_s`` — in-process pipeline forward throughput per backend
  on its default device (CUDA/MPS when present; memory is always measured on CPU).

A backend that is not installed reports ``null`` and its reason under
``unavailable``. The readable table goes to stdout; ``--json`` adds one JSON
object as the last line.
"""

from __future__ import annotations

import argparse
import os
import gc
import json
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

TARGET_MAX_ABS_DIFF = 1e-5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--stages", type=int, default=4, help="number of pipeline stages S (default 4)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="HF checkpoint directory to use instead of a random one")
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
        if args.checkpoint is None:
            config = small_config(vocab_size=256, hidden_size=args.hidden, num_layers=args.layers,
                                  num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 128))
            checkpoint_dir = write_random_checkpoint(Path(tmp) / "random", config, seed=0,
                                                     max_shard_bytes=64 * 2**20)
        else:
            checkpoint_dir = args.checkpoint
        report = measure(checkpoint_dir, args.stages, batch=args.batch, seq_len=args.seq_len,
                         min_time_s=args.min_time_s)
    report["checkpoint"]["path"] = str(args.checkpoint) if args.checkpoint else "random (temporary)"
    print(format_table(report))
    if args.json:
        print(json.dumps(report))
    return 0


def measure(checkpoint_dir: Path, num_stages: int, *, batch: int = 4, seq_len: int = 64,
            min_time_s: float = 2.0) -> dict:
    """Every figure of the bench as one JSON-able dict (see the module docstring)."""
    from engine.model.reference import load_reference_model, reference_logits

    checkpoint = Checkpoint(checkpoint_dir)
    config = checkpoint.config
    plan = plan_stages(config.num_hidden_layers, num_stages)
    unavailable = {n: registry.unavailable_reason(n) for n in registry.names() if registry.unavailable_reason(n)}
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq_len)).astype(np.int64)

    reference = load_reference_model(checkpoint_dir)
    want = reference_logits(reference, tokens[:2])
    del reference
    gc.collect()

    chains = {name: [name] * num_stages for name in registry.names()}
    chains["mixed"] = [("torch", "mlx")[i % 2] for i in range(num_stages)]  # torch, mlx, torch, mlx, ...
    diffs: dict[str, float | None] = {}
    speeds: dict[str, float | None] = {}
    devices: dict[str, str] = {}
    for label, chain in chains.items():
        missing = [b for b in set(chain) if b in unavailable]
        if missing or (label == "mixed" and num_stages < 2):
            diffs[label] = None
            unavailable.setdefault(label, "needs at least 2 stages" if not missing else
                                   f"needs {', '.join(missing)}")
            if label != "mixed":
                speeds[label] = None
            continue
        stages = [load_stage(checkpoint, spec, b) for spec, b in zip(plan, chain)]
        devices.update({stage.name: stage.device for stage in stages})
        try:
            diffs[label] = float(np.abs(pipeline_forward(stages, tokens[:2]) - want).max())
            if label != "mixed":
                speeds[label] = _tokens_per_s(stages, tokens, min_time_s)
        finally:
            for stage in stages:
                stage.close()
        gc.collect()

    memory_backend = "torch" if "torch" not in unavailable else registry.resolve("auto")
    memory = measure_load_memory(checkpoint_dir, num_stages, memory_backend)
    return {
        "stages": num_stages,
        "layers": config.num_hidden_layers,
        "checkpoint": {"parameters": config.num_parameters,
                       "fp32_mb": round(sum(checkpoint.stage_nbytes(s) for s in plan) / 2**20, 1)},
        "max_abs_diff": diffs,
        "max_abs_diff_target": TARGET_MAX_ABS_DIFF,
        **memory,
        "forward_tokens_per_s": speeds,
        "devices": devices,
        "forward_shape": [batch, seq_len],
        "unavailable": unavailable,
    }


def measure_load_memory(checkpoint_dir: Path, num_stages: int, backend: str = "torch") -> dict:
    """Load peak (MB above baseline) of the whole model and of each of S stages, each in a fresh process."""
    full = _probe(checkpoint_dir, 0, 1, backend)
    per_stage = [_probe(checkpoint_dir, i, num_stages, backend) for i in range(num_stages)]
    stage_peak = max(p["load_peak_mb"] for p in per_stage)
    return {
        "stage_load_peak_mb": stage_peak,
        "full_load_peak_mb": full["load_peak_mb"],
        "stage_to_full_ratio": round(stage_peak / full["load_peak_mb"], 3) if full["load_peak_mb"] > 0 else None,
        "ideal_ratio": round(1 / num_stages, 3),
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

    s = report["stages"]
    rows = [
        ("checkpoint", f"{report['checkpoint']['path']}: {report['layers']} layers, "
                       f"{report['checkpoint']['parameters'] / 1e6:.1f} M params, {report['checkpoint']['fp32_mb']} MB fp32"),
        *((f"max |logits - transformers| {k}", f"{num(v, '.2e')}  (target <= {report['max_abs_diff_target']:.0e})")
          for k, v in report["max_abs_diff"].items()),
        (f"load peak, 1 stage of {s}", f"{report['stage_load_peak_mb']:.1f} MB  "
                                       f"(per stage: {', '.join(f'{m:.1f}' for m in report['stage_load_peak_mb_per_stage'])})"),
        ("load peak, whole model", f"{report['full_load_peak_mb']:.1f} MB"),
        ("stage / whole", f"{num(report['stage_to_full_ratio'], '.3f')}  (1/S = {report['ideal_ratio']:.3f})"),
        *((f"forward tokens/s {k}", f"{num(v, ',.0f')}  (batch x seq = {report['forward_shape'][0]} x "
                                    f"{report['forward_shape'][1]}, {s} stages in-process on "
                                    f"{report['devices'].get(k, 'n/a')})")
          for k, v in report["forward_tokens_per_s"].items()),
        *((f"unavailable: {k}", v) for k, v in report["unavailable"].items()),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
