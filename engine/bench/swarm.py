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
4. **accuracy at equal samples** — held-out exact match of that swarm run at
   every eval, and of the in-process trainer (``engine.rl.trainer``, the same
   recipe, rollouts one batch old like the swarm's, ``--seeds`` seeds) evaluated
   when the samples it has trained on first reach the swarm's count at that eval.
   (Equal versions would not be equal samples: the swarm fills every batch with
   groups that carry signal, the in-process trainer drops zero-variance groups
   from its batches.)

With ``--wan PROFILE`` (a profile or a mix, as for ``polis demo --wan``) every swarm
of the bench runs over the emulated internet; the in-process figures stay as they are.
``--only generation`` measures generation alone: in process, over WebRTC on loopback
and, with ``--wan``, over the emulated internet, with each route's jobs in flight.

``--only generation --model NAME|DIR`` measures a real model instead of the tiny base, with
the run ``polis demo --model`` runs (``engine.swarm.train_command.run_config``: the demo's
real-model recipe and task, the model resolved as the demo resolves it, imported on first
use): in process, jobs shaped as the coordinator's (``prompts_per_job`` chat-template
prompts of one token length, ``engine.rl.prompt_keys.LengthBuckets``, x ``group_size``
rows, the recipe's sampling and ``max_new_tokens``), sampled by the in-process trainer
(``Trainer.sample``) on the stages the swarm's trainer nodes load (LoRA included); over
WebRTC, the demo swarm with that recipe, generation only. A swarm counts a job's tokens
when the job ends (a real model's 64-row job takes ~15 s on one thread), so each window
begins and ends at a job's end and is ``REAL_MODEL_WINDOW_S`` long by default with
``--model`` (``--window-s`` sets it). The full comparison (``--only all``) knows the tiny
base only.

Where the gap in generation comes from is measured too: the CPU the swarm's
processes used during the window (Linux ``/proc``), against the one core the
in-process chain runs on.

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
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

if TYPE_CHECKING:
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.rollout import Group

#: seconds of generation measured per route (in process and per swarm) on the tiny base
WINDOW_S = 20.0
#: the same with ``--model``: a job of the real-model recipe (8 prompts x 8 samples, up to 48 tokens)
#: takes ~15 s on one thread and its tokens count when it ends, so a window holds several jobs per route
REAL_MODEL_WINDOW_S = 120.0
#: seconds a swarm window waits past its length for the job that ends it (then it ends without one)
WINDOW_END_PATIENCE_S = 300.0
#: seconds a real model's swarm gets to load its stages, connect, run the version-0 eval (64 greedy items)
#: and end its first job, on a machine shared with other work
REAL_MODEL_START_S = 900.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--checkpoint", default=None, help="base checkpoint (default: the shipped one)")
    parser.add_argument("--model", default=None,
                        help="with --only generation: measure a real model (a name such as smollm2-135m, imported "
                             "on first use, or an imported directory) with polis demo --model's recipe")
    parser.add_argument("--window-s", type=float, default=None,
                        help=f"seconds of generation measured per route (default {WINDOW_S:.0f}; "
                             f"{REAL_MODEL_WINDOW_S:.0f} with --model, whose jobs take seconds each and count "
                             "when they end)")
    parser.add_argument("--versions", type=int, default=480,
                        help="policy versions the swarm trains for the accuracy comparison (default 480)")
    parser.add_argument("--eval-every", type=int, default=120, help="versions between held-out evals (default 120)")
    parser.add_argument("--seeds", type=int, default=2, help="in-process runs (seeds) to compare with (default 2)")
    parser.add_argument("--only", choices=["all", "generation"], default="all",
                        help="generation: only the generation windows (in-process, WebRTC on loopback and, with "
                             "--wan, over the emulated internet), a few minutes")
    from engine.swarm.demo import add_wan_arguments

    add_wan_arguments(parser)  # --wan: every swarm of the bench over the emulated internet


def _base(args) -> str:
    from engine.paths import base_checkpoint_dir

    return args.checkpoint or str(base_checkpoint_dir())


def window_seconds(args: argparse.Namespace) -> float:
    """Seconds measured per route: ``--window-s``, else :data:`REAL_MODEL_WINDOW_S` with ``--model``,
    else :data:`WINDOW_S`."""
    if args.window_s is not None:
        return float(args.window_s)
    return REAL_MODEL_WINDOW_S if args.model else WINDOW_S


def demo_run_args(model: str) -> argparse.Namespace:
    """The flags of ``polis demo --model MODEL`` that choose its run (no --task, --env or --set)."""
    return argparse.Namespace(model=model, task=None, env="", set=[])


def real_model_run(model: str):
    """(the ``RunConfig``, the coordinator's run settings) of ``polis demo --model MODEL``."""
    from engine.swarm.demo import real_model_settings
    from engine.swarm.train_command import run_config

    args = demo_run_args(model)
    return run_config(args), real_model_settings(args)


def _tokens_per_second(next_job: Callable[[], list[Group]], seconds: float) -> float:
    """Completion tokens/s of whole jobs (``next_job()``: one job's groups) run for at least ``seconds``."""
    tokens, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        tokens += sum(len(s.completion_ids) for g in next_job() for s in g.samples)
    return tokens / (time.perf_counter() - started)


def _in_process_generation(base: str, run, seconds: float) -> float:
    """Completion tokens/s of the two-stage chain in this process, jobs shaped as in the swarm."""
    import os

    os.environ.setdefault("POLIS_TORCH_THREADS", "1")
    from engine.rl.codec import TaskCodec
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.prompt_keys import LengthBuckets
    from engine.rl.rollout import generate_groups
    from engine.rl.tasks import make_task

    pipe = LocalPipeline.from_checkpoint(base, 2, "torch", "cpu")
    codec = TaskCodec.from_dir(base)
    task = make_task(run.task)
    rng = np.random.default_rng(0)
    sampling = replace(run.sampling, max_rows_per_cache=run.prompts_per_job * run.group_size)

    # one token length per job, held as the coordinator holds them (the character codec: a character a token)
    buckets = LengthBuckets(run.prompts_per_job, len)
    stream = iter(lambda: task.random_prompt(rng), None)

    def next_job() -> list[Group]:
        prompts = buckets.take(stream)
        return generate_groups(pipe, prompts, [codec.encode_prompt(p) for p in prompts], run.group_size,
                               sampling, codec.eos_id, rng)

    try:
        return _tokens_per_second(next_job, seconds)
    finally:
        pipe.close()


def real_model_jobs(base: str, run) -> tuple[Iterator[list[Group]], LocalPipeline]:
    """(an endless iterator of generation jobs' groups, the pipeline to close) of ``run`` on ``base``
    in this process: the two stages the swarm's trainer nodes load (``optimizer_config``: LoRA included),
    each job ``prompts_per_job`` of the run task's training prompts of one token length (as the
    coordinator builds them) x ``group_size`` samples in one KV cache, sampled by the in-process
    trainer (``Trainer.sample``: the run task's prompt ids and stop ids, the run's sampling)."""
    from engine.rl.codec import load_codec
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.prompt_keys import LengthBuckets
    from engine.rl.trainer import Trainer
    from engine.swarm.train_command import optimizer_config, trainer_config

    config = trainer_config(run)
    config = replace(config, sampling=replace(config.sampling,
                                              max_rows_per_cache=run.prompts_per_job * run.group_size))
    pipe = LocalPipeline.from_checkpoint(base, 2, "torch", "cpu", optimizer_config(run))
    try:
        trainer = Trainer(pipe, load_codec(base), config)
    except BaseException:
        pipe.close()
        raise
    task = trainer.run_task
    buckets = LengthBuckets(run.prompts_per_job, lambda key: len(task.prompt_ids(key)))
    prompts = task.train_prompts(run.seed)

    def jobs() -> Iterator[list[Group]]:
        while True:
            yield trainer.sample(buckets.take(prompts))

    return jobs(), pipe


def _in_process_real_model_generation(base: str, run, seconds: float) -> float:
    """Completion tokens/s of :func:`real_model_jobs` in this process (one torch thread)."""
    import os

    os.environ.setdefault("POLIS_TORCH_THREADS", "1")
    jobs, pipe = real_model_jobs(base, run)
    try:
        return _tokens_per_second(lambda: next(jobs), seconds)
    finally:
        pipe.close()


def _completion_tokens(stats: dict[str, Any]) -> int:
    return int(stats["counters"].get("completion_tokens", 0))


def _swarm_window(base: str | None, tmp: Path, settings: list[str], replicas: int, window_s: float,
                  wan: tuple[str | None, str | None] = (None, None), model: str | None = None,
                  start_s: float = 240.0) -> dict[str, Any]:
    """Start a swarm that only generates; measure tokens and wire bytes over ``window_s``.

    The window begins when the first job after the version-0 eval has ended and ends at the first
    job's end after ``window_s`` (tokens count when a job ends), or :data:`WINDOW_END_PATIENCE_S`
    later. ``base``: the checkpoint (``--checkpoint`` of every process); ``model``: the run's model
    with ``settings`` holding its recipe (``polis demo --model``); ``start_s``: how long the swarm
    gets to start generating. ``wan``: (mix, profile file) of an emulated internet (``polis demo
    --wan``), or (None, None).
    """
    from engine.swarm.demo import DemoSwarm, bytes_on_wire

    args = argparse.Namespace(stages=2, replicas=replicas, checkpoint=base, backend="torch", max_versions=0,
                              model=model, set=settings + ["prompts_per_step=4096", "eval_every_versions=0"],
                              wan=wan[0], wan_profiles=wan[1])
    tmp.mkdir(parents=True, exist_ok=True)
    swarm = DemoSwarm(tmp, args)
    try:
        swarm.start()
        deadline = time.monotonic() + start_s
        while True:  # wait until the version-0 eval is done and generation flows
            stats = swarm.stats()
            if stats["evals"] and _completion_tokens(stats) > 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the swarm did not start generating; logs in {tmp}")
            time.sleep(0.5)
        cpu0, first, t0 = _cpu_seconds(swarm.procs), swarm.stats(), time.monotonic()
        time.sleep(window_s)
        ended = _completion_tokens(swarm.stats())
        deadline = time.monotonic() + WINDOW_END_PATIENCE_S
        while True:  # end the window at the next job's end
            cpu1, last, t1 = _cpu_seconds(swarm.procs), swarm.stats(), time.monotonic()
            if _completion_tokens(last) > ended or t1 > deadline:
                break
            time.sleep(0.5)
    finally:
        swarm.stop()
    tokens = last["counters"]["completion_tokens"] - first["counters"]["completion_tokens"]
    wire = bytes_on_wire(last) - bytes_on_wire(first)
    cpu = None
    if cpu0 is not None and cpu1 is not None:
        cpu = {"coordinator": (cpu1[0] - cpu0[0]) / (t1 - t0),
               "nodes": [(b - a) / (t1 - t0) for a, b in zip(cpu0[1:], cpu1[1:])]}
    return {"tok_s": tokens / (t1 - t0), "bytes_per_token": wire / max(tokens, 1), "tokens": tokens,
            "seconds": t1 - t0,
            "cpu_cores": cpu, "in_flight": last.get("in_flight"), "jobs_in_flight": last.get("jobs_in_flight")}


def _cpu_seconds(procs) -> list[float] | None:
    """CPU seconds (user + system) each process has used so far; None where /proc is missing."""
    import os

    try:
        ticks = os.sysconf("SC_CLK_TCK")
        out = []
        for proc in procs:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / ticks)
        return out
    except (OSError, ValueError, IndexError):
        return None


def _cumulative_samples(versions: list[dict[str, Any]]) -> dict[int, int]:
    """Version -> samples trained on up to and including it (from the stats API's version log)."""
    total, out = 0, {0: 0}
    for v in sorted(versions, key=lambda v: v["version"]):
        total += int(v.get("samples") or 0)
        out[int(v["version"])] = total
    return out


def versions_per_min(versions: list[dict[str, Any]]) -> float | None:
    """Training pace from the coordinator's version log (``created_at`` in seconds): versions
    after the first over the seconds between the first and the last."""
    stamps = sorted(float(v["created_at"]) for v in versions if v.get("created_at") is not None)
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return None
    return 60.0 * (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _swarm_training(base: str, tmp: Path, versions: int, eval_every: int,
                    settings: list[str] | tuple[str, ...] = (),
                    wan: tuple[str | None, str | None] = (None, None)) -> dict[str, Any]:
    """2 stages x 2 replicas from the base to ``versions``; held-out evals every ``eval_every``;
    ``settings``: run-setting overrides (``KEY=VALUE``, as ``polis demo --set``); ``wan``: as for
    ``_swarm_window``."""
    from engine.swarm.demo import DemoSwarm, bytes_on_wire

    args = argparse.Namespace(stages=2, replicas=2, checkpoint=base, backend="torch", max_versions=versions,
                              model=None, set=[*settings, f"eval_every_versions={eval_every}"],
                              wan=wan[0], wan_profiles=wan[1])
    tmp.mkdir(parents=True, exist_ok=True)
    swarm = DemoSwarm(tmp, args)
    started = time.monotonic()
    try:
        swarm.start()
        deadline = time.monotonic() + 60 * 60
        while True:
            try:
                stats = swarm.stats()
            except OSError:  # a coordinator too busy to answer in time (other jobs on the machine): ask again
                if time.monotonic() > deadline:
                    raise
                time.sleep(2.0)
                continue
            done = [e for e in stats["evals"] if e["version"] >= versions]
            if done and not stats["eval_running"]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the swarm did not reach version {versions}; logs in {tmp}")
            time.sleep(1.0)
    finally:
        swarm.stop()
    samples = _cumulative_samples(stats["versions"])
    curve = [{"version": e["version"], "samples": samples.get(e["version"], max(samples.values())),
              "accuracy": e["accuracy"]} for e in stats["evals"]]
    return {"curve": curve, "update_bytes": stats["update_bytes"], "dense_update_bytes": stats["dense_update_bytes"],
            "staleness_histogram": stats["staleness_histogram"], "seconds": round(time.monotonic() - started, 1),
            "bytes_on_wire": bytes_on_wire(stats), "versions_per_min": versions_per_min(stats["versions"]),
            "dropped_stale": stats["counters"].get("dropped_stale", 0)}


def _in_process_training(base: str, run, sample_points: list[int], seed: int) -> dict[str, Any]:
    """The in-process trainer (same recipe, run lag = updates per batch) evaluated when the
    samples it has trained on first reach each of ``sample_points``."""
    from backends.base import OptimizerConfig
    from engine.rl.codec import TaskCodec
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.trainer import Trainer, TrainerConfig

    pipe = LocalPipeline.from_checkpoint(base, 2, "torch", "cpu", OptimizerConfig(lr=run.lr))
    config = TrainerConfig(task=run.task, objective=run.objective, sampling=run.sampling,
                           prompts_per_step=run.prompts_per_step, group_size=run.group_size,
                           updates_per_batch=run.updates_per_batch, lag_versions=run.updates_per_batch,
                           max_staleness=run.max_staleness, max_grad_norm=run.max_grad_norm, eval_every_steps=0,
                           seed=seed)
    trainer = Trainer(pipe, TaskCodec.from_dir(base), config)
    started = time.monotonic()
    curve = [{"version": 0, "samples": 0, "accuracy": trainer.evaluate().exact_match}]
    trained = 0
    for target in sorted(p for p in sample_points if p > 0):
        for _ in range(100_000):
            if trained >= target:
                break
            trained += trainer.step().trained_samples
        curve.append({"version": max(pipe.versions()), "samples": trained,
                      "accuracy": trainer.evaluate().exact_match})
    pipe.close()
    return {"curve": curve, "seed": seed, "seconds": round(time.monotonic() - started, 1)}


def _gaps(swarm_curve: list[dict], local_curves: list[list[dict]]) -> list[dict[str, float]]:
    """Per swarm eval point: in-process accuracy (mean over seeds) at the same samples, and the gap."""
    out = []
    for i, point in enumerate(swarm_curve):
        local = [c[i]["accuracy"] for c in local_curves if i < len(c)]
        if not local:
            continue
        mean = float(np.mean(local))
        out.append({"samples": point["samples"], "version": point["version"], "swarm": point["accuracy"],
                    "inprocess": mean, "inprocess_spread": [min(local), max(local)],
                    "gap_points": 100.0 * (point["accuracy"] - mean)})
    return out


def _generation_only(args: argparse.Namespace, seconds: float, tmp: Path, out) -> dict[str, Any]:
    """In-process vs WebRTC on loopback vs (with ``--wan``) WebRTC over the emulated internet: the tiny
    base, or with ``--model`` that model with ``polis demo --model``'s run."""
    from engine.swarm.run_config import RunConfig

    if args.model:
        from engine.swarm.demo import ensure_imported
        from engine.swarm.stage_loading import base_dir

        run_cfg, settings = real_model_run(args.model)
        ensure_imported(args.model, out)
        base = str(base_dir(args.checkpoint, run_cfg.model))  # the directory the demo's processes load
        checkpoint, start_s = args.checkpoint, REAL_MODEL_START_S
        in_process = _in_process_real_model_generation
    else:
        run_cfg, settings = RunConfig(), []
        base = checkpoint = _base(args)
        start_s = 240.0
        in_process = _in_process_generation
    print(f"1/3 in-process generation ({seconds:.0f} s)...", file=out, flush=True)
    inproc = in_process(base, run_cfg, seconds)
    print("2/3 swarm generation on loopback...", file=out, flush=True)
    loop = _swarm_window(checkpoint, tmp / "loopback", settings, 1, seconds, model=args.model, start_s=start_s)
    wan = None
    if args.wan:
        print(f"3/3 swarm generation over '{args.wan}'...", file=out, flush=True)
        wan = _swarm_window(checkpoint, tmp / "wan", settings, 1, seconds, (args.wan, args.wan_profiles),
                            model=args.model, start_s=start_s)
    result = {"wan": args.wan, "model": args.model, "base": base,
              "generation_tok_s_inprocess": inproc, "generation_tok_s_webrtc": loop["tok_s"],
              "generation_ratio": loop["tok_s"] / inproc, "loopback_in_flight": loop["in_flight"],
              "loopback_jobs_in_flight": loop["jobs_in_flight"], "generation_cpu_cores": loop["cpu_cores"],
              "webrtc_tokens": loop["tokens"], "webrtc_window_s": loop["seconds"],
              "generation_tok_s_wan": wan and wan["tok_s"], "wan_in_flight": wan and wan["in_flight"],
              "wan_vs_loopback": wan and wan["tok_s"] / loop["tok_s"], "window_s": seconds,
              "job": {"task": run_cfg.task.name, "prompts_per_job": run_cfg.prompts_per_job,
                      "group_size": run_cfg.group_size, "max_new_tokens": run_cfg.sampling.max_new_tokens,
                      "temperature": run_cfg.sampling.temperature, "generations_in_flight":
                      run_cfg.generations_in_flight, "activation_encoding": run_cfg.activation_encoding,
                      "lora": run_cfg.lora.enabled}}
    print(f"generation: in-process {inproc:.0f} tok/s, WebRTC loopback {loop['tok_s']:.0f} "
          f"({result['generation_ratio']:.2f}x)"
          + (f", over {args.wan} {wan['tok_s']:.0f} ({result['wan_vs_loopback']:.2f}x loopback)" if wan else ""),
          file=out)
    _print_cpu(loop["cpu_cores"], out)
    return result


def _print_cpu(cpu: dict[str, Any] | None, out) -> None:
    """The CPU the swarm's processes used during a window (None: not measured here)."""
    if cpu:
        print(f"  CPU during the WebRTC window: coordinator {cpu['coordinator']:.2f} cores, nodes "
              + ", ".join(f"{n:.2f}" for n in cpu["nodes"]) + " cores (the in-process chain: one thread)", file=out)


def run(args: argparse.Namespace) -> int:
    from engine.swarm.run_config import RunConfig

    if args.model and args.only != "generation":
        print("polis bench swarm: --model measures generation only (add --only generation); the full "
              "comparison knows the tiny base only", file=sys.stderr)
        return 2
    seconds = window_seconds(args)
    base = _base(args)
    run_cfg = RunConfig()
    out = sys.stderr if args.json else sys.stdout
    tmp = Path(tempfile.mkdtemp(prefix="polis-bench-swarm-"))
    started = time.monotonic()
    if args.only == "generation":
        try:
            result = _generation_only(args, seconds, tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if args.json:
            print(json.dumps(result))
        return 0
    try:
        print("1/5 in-process generation...", file=out, flush=True)
        inproc_tok_s = _in_process_generation(base, run_cfg, seconds)
        print("2/5 swarm generation, int8 activations...", file=out, flush=True)
        wan = (args.wan, args.wan_profiles)
        int8 = _swarm_window(base, tmp / "int8", ["activation_encoding=int8_rowwise"], 1, seconds, wan)
        print("3/5 swarm generation, fp32 activations...", file=out, flush=True)
        fp32 = _swarm_window(base, tmp / "fp32", ["activation_encoding=fp32"], 1, seconds, wan)
        print(f"4/5 swarm training, 2 stages x 2 replicas, {args.versions} versions...", file=out, flush=True)
        swarm = _swarm_training(base, tmp / "train", args.versions, args.eval_every, wan=wan)
        points = [p["samples"] for p in swarm["curve"]]
        print(f"5/5 in-process training to the same samples ({points[-1]}), {args.seeds} seed(s)...", file=out,
              flush=True)
        local = [_in_process_training(base, run_cfg, points, seed) for seed in range(args.seeds)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    gaps = _gaps(swarm["curve"], [r["curve"] for r in local])
    final = gaps[-1]
    result = {
        "wan": args.wan,  # None: loopback links
        "generation_tok_s_webrtc": int8["tok_s"], "generation_tok_s_inprocess": inproc_tok_s,
        "generation_ratio": int8["tok_s"] / inproc_tok_s,
        "generation_tok_s_webrtc_fp32": fp32["tok_s"],
        "generations_in_flight": run_cfg.generations_in_flight,
        "generation_cpu_cores": int8.get("cpu_cores"),
        "activation_bytes_per_token": {"fp32": fp32["bytes_per_token"], "compressed": int8["bytes_per_token"]},
        "activation_bytes_ratio": int8["bytes_per_token"] / fp32["bytes_per_token"],
        "update_bytes_ratio_vs_dense": (swarm["update_bytes"] / swarm["dense_update_bytes"]
                                        if swarm["dense_update_bytes"] else None),
        "versions": args.versions, "samples": final["samples"],
        "accuracy_swarm": final["swarm"], "accuracy_inprocess": final["inprocess"],
        "accuracy_start": swarm["curve"][0]["accuracy"],
        "accuracy_gap_points": final["gap_points"],
        "accuracy_gap_points_mean_abs": float(np.mean([abs(g["gap_points"]) for g in gaps[1:]] or [0.0])),
        "accuracy_by_samples": gaps,
        "swarm_curve": swarm["curve"], "inprocess_curves": [r["curve"] for r in local],
        "swarm_staleness_histogram": swarm["staleness_histogram"], "swarm_dropped_stale": swarm["dropped_stale"],
        "swarm_training_seconds": swarm["seconds"], "inprocess_training_seconds": [r["seconds"] for r in local],
        "seconds": round(time.monotonic() - started, 1),
    }
    print(f"generation: {result['generation_tok_s_webrtc']:.0f} tok/s over WebRTC vs "
          f"{inproc_tok_s:.0f} in one process ({result['generation_ratio']:.2f}x)", file=out)
    _print_cpu(int8.get("cpu_cores"), out)
    print(f"activation bytes/token: fp32 {fp32['bytes_per_token']:.0f}, int8 {int8['bytes_per_token']:.0f} "
          f"({result['activation_bytes_ratio']:.3f}x)", file=out)
    if result["update_bytes_ratio_vs_dense"] is not None:
        print(f"replica updates: {result['update_bytes_ratio_vs_dense']:.4f}x dense fp32", file=out)
    print(f"{'samples':>8} {'version':>8} {'swarm':>7} {'in-proc':>8} {'gap':>7}", file=out)
    for g in gaps:
        print(f"{g['samples']:>8} {g['version']:>8} {g['swarm']:>7.3f} {g['inprocess']:>8.3f} "
              f"{g['gap_points']:>+7.1f}", file=out)
    if args.json:
        print(json.dumps(result))
    return 0
