"""``polis bench swarm``: the swarm over WebRTC against the same stages in one process.

Measured in one run, on this machine:

1. **generation** — tokens/s of the same two-stage cut of the base checkpoint,
   (a) chained in one process (``engine.rl.rollout``) and (b) as two node
   processes talking over WebRTC on loopback, generation only (no training);
2. **activation bytes per token** — wire bytes per generated token with fp32
   activations and with the compressed (int8 rowwise) ones, each from a real
   swarm window;
3. **replica update bytes** — bytes the replicas exchanged per step against
   dense fp32, from a training run of 2 stages x 2 replicas;
4. **accuracy at equal samples** — held-out exact match of that swarm run and
   of the in-process trainer (``engine.rl.trainer``, same settings, the same
   number of versions = the same number of samples).

The last stdout line is the JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--checkpoint", default=None, help="base checkpoint (default: the shipped one)")
    parser.add_argument("--window-s", type=float, default=30.0, help="seconds of generation measured per swarm")
    parser.add_argument("--versions", type=int, default=30, help="policy versions of the accuracy comparison")


def _base(args) -> str:
    from engine.paths import base_checkpoint_dir

    return args.checkpoint or str(base_checkpoint_dir())


def _in_process_generation(base: str, run, seconds: float) -> float:
    """Completion tokens/s of the two-stage chain in this process, jobs shaped as in the swarm."""
    import os

    os.environ.setdefault("POLIS_TORCH_THREADS", "1")
    from engine.rl.codec import TaskCodec
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.rollout import generate_groups
    from engine.rl.tasks import make_task

    pipe = LocalPipeline.from_checkpoint(base, 2, "torch", "cpu")
    codec = TaskCodec.from_dir(base)
    task = make_task(run.task)
    rng = np.random.default_rng(0)
    sampling = replace(run.sampling, max_rows_per_cache=run.prompts_per_job * run.group_size)
    tokens, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        length = None
        prompts: list[str] = []
        while len(prompts) < run.prompts_per_job:  # one token length per job, like the coordinator
            p = task.random_prompt(rng)
            if length is None or len(p) == length:
                length = len(p)
                prompts.append(p)
        groups = generate_groups(pipe, prompts, [codec.encode_prompt(p) for p in prompts], run.group_size,
                                 sampling, codec.eos_id, rng)
        tokens += sum(len(s.completion_ids) for g in groups for s in g.samples)
    elapsed = time.perf_counter() - started
    pipe.close()
    return tokens / elapsed


def _swarm_window(base: str, tmp: Path, settings: list[str], replicas: int, window_s: float) -> dict[str, Any]:
    """Start a swarm that only generates; measure tokens and wire bytes over ``window_s``."""
    from engine.swarm.demo import DemoSwarm

    args = argparse.Namespace(stages=2, replicas=replicas, checkpoint=base, backend="torch", max_versions=0,
                              set=settings + ["prompts_per_step=4096", "eval_every_versions=0"])
    tmp.mkdir(parents=True, exist_ok=True)
    swarm = DemoSwarm(tmp, args)
    try:
        swarm.start()
        deadline = time.monotonic() + 240
        while True:  # wait until the version-0 eval is done and generation flows
            stats = swarm.stats()
            if stats["evals"] and stats["counters"].get("completion_tokens", 0) > 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the swarm did not start generating; logs in {tmp}")
            time.sleep(0.5)
        first, t0 = swarm.stats(), time.monotonic()
        time.sleep(window_s)
        last, t1 = swarm.stats(), time.monotonic()
    finally:
        swarm.stop()
    tokens = last["counters"]["completion_tokens"] - first["counters"]["completion_tokens"]
    wire = last["bytes_on_wire"] - first["bytes_on_wire"]
    return {"tok_s": tokens / (t1 - t0), "bytes_per_token": wire / max(tokens, 1), "tokens": tokens}


def _swarm_training(base: str, tmp: Path, versions: int) -> dict[str, Any]:
    from engine.swarm.demo import DemoSwarm

    args = argparse.Namespace(stages=2, replicas=2, checkpoint=base, backend="torch", max_versions=versions,
                              set=[f"eval_every_versions={versions}"])
    tmp.mkdir(parents=True, exist_ok=True)
    swarm = DemoSwarm(tmp, args)
    try:
        swarm.start()
        deadline = time.monotonic() + 900
        while True:
            stats = swarm.stats()
            done = [e for e in stats["evals"] if e["version"] >= versions]
            if done and not stats["eval_running"]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the swarm did not reach version {versions}; logs in {tmp}")
            time.sleep(1.0)
    finally:
        swarm.stop()
    return {"accuracy": done[0]["accuracy"], "update_bytes": stats["update_bytes"],
            "dense_update_bytes": stats["dense_update_bytes"], "start_accuracy": stats["evals"][0]["accuracy"],
            "staleness_histogram": stats["staleness_histogram"]}


def _in_process_training(base: str, run, versions: int) -> dict[str, float]:
    from backends.base import OptimizerConfig
    from engine.rl.codec import TaskCodec
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.trainer import Trainer, TrainerConfig

    pipe = LocalPipeline.from_checkpoint(base, 2, "torch", "cpu", OptimizerConfig(lr=run.lr))
    config = TrainerConfig(task=run.task, objective=run.objective, sampling=run.sampling,
                           prompts_per_step=run.prompts_per_step, group_size=run.group_size,
                           updates_per_batch=run.updates_per_batch, lag_versions=run.updates_per_batch,
                           max_staleness=run.max_staleness, max_grad_norm=run.max_grad_norm, eval_every_steps=0,
                           seed=run.seed)
    trainer = Trainer(pipe, TaskCodec.from_dir(base), config)
    start = trainer.evaluate().exact_match
    for _ in range(versions):
        trainer.step()
    end = trainer.evaluate().exact_match
    pipe.close()
    return {"start_accuracy": start, "accuracy": end}


def run(args: argparse.Namespace) -> int:
    from engine.swarm.run_config import RunConfig

    base = _base(args)
    run_cfg = RunConfig()
    out = sys.stderr if args.json else sys.stdout
    tmp = Path(tempfile.mkdtemp(prefix="polis-bench-swarm-"))
    started = time.monotonic()
    try:
        print("1/5 in-process generation...", file=out, flush=True)
        inproc_tok_s = _in_process_generation(base, run_cfg, args.window_s)
        print("2/5 swarm generation, int8 activations...", file=out, flush=True)
        int8 = _swarm_window(base, tmp / "int8", ["activation_encoding=int8_rowwise"], 1, args.window_s)
        print("3/5 swarm generation, fp32 activations...", file=out, flush=True)
        fp32 = _swarm_window(base, tmp / "fp32", ["activation_encoding=fp32"], 1, args.window_s)
        print(f"4/5 swarm training, 2 stages x 2 replicas, {args.versions} versions...", file=out, flush=True)
        swarm = _swarm_training(base, tmp / "train", args.versions)
        print(f"5/5 in-process training, {args.versions} versions...", file=out, flush=True)
        local = _in_process_training(base, run_cfg, args.versions)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "generation_tok_s_webrtc": int8["tok_s"], "generation_tok_s_inprocess": inproc_tok_s,
        "generation_ratio": int8["tok_s"] / inproc_tok_s,
        "generation_tok_s_webrtc_fp32": fp32["tok_s"],
        "activation_bytes_per_token": {"fp32": fp32["bytes_per_token"], "compressed": int8["bytes_per_token"]},
        "activation_bytes_ratio": int8["bytes_per_token"] / fp32["bytes_per_token"],
        "update_bytes_ratio_vs_dense": (swarm["update_bytes"] / swarm["dense_update_bytes"]
                                        if swarm["dense_update_bytes"] else None),
        "versions": args.versions, "samples": args.versions * run_cfg.prompts_per_step * run_cfg.group_size,
        "accuracy_swarm": swarm["accuracy"], "accuracy_inprocess": local["accuracy"],
        "accuracy_start": local["start_accuracy"],
        "accuracy_gap_points": 100.0 * (swarm["accuracy"] - local["accuracy"]),
        "swarm_staleness_histogram": swarm["staleness_histogram"],
        "seconds": round(time.monotonic() - started, 1),
    }
    print(f"generation: {result['generation_tok_s_webrtc']:.0f} tok/s over WebRTC vs "
          f"{inproc_tok_s:.0f} in one process ({result['generation_ratio']:.2f}x)", file=out)
    print(f"activation bytes/token: fp32 {fp32['bytes_per_token']:.0f}, int8 {int8['bytes_per_token']:.0f} "
          f"({result['activation_bytes_ratio']:.3f}x)", file=out)
    if result["update_bytes_ratio_vs_dense"] is not None:
        print(f"replica updates: {result['update_bytes_ratio_vs_dense']:.4f}x dense fp32", file=out)
    print(f"accuracy after {args.versions} versions: swarm {swarm['accuracy']:.3f}, in-process "
          f"{local['accuracy']:.3f} (start {local['start_accuracy']:.3f}); gap "
          f"{result['accuracy_gap_points']:+.1f} points", file=out)
    if args.json:
        print(json.dumps(result))
    return 0
