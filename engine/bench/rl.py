"""``polis bench rl``: does RL from the shipped base learn, and how much does staleness cost?

From the base checkpoint (``resources/base-model`` or ``--checkpoint``) and the tested
recipe (``engine.rl.recipe``) it runs, for every seed, five in-process trainings of the same
number of steps:

* ``sync`` — rollouts trained on by the policy that generated them;
* ``stale4_corrected`` — rollouts 4 versions old, decoupled objective (IS weight, band mask);
* ``stale4_uncorrected`` — rollouts 4 versions old, plain PPO against the behaviour policy;
* ``stale8_corrected`` — rollouts 8 versions old (staleness bound raised to 8);
* ``shuffled_reward`` — negative control: rewards permuted across the batch (must not learn);
  at most ``CONTROL_STEPS`` steps.

Every run evaluates greedy exact match on the task's held-out split every few steps. The
target is the base's exact match + 0.30; ``steps_to_target`` / ``seconds_to_target`` are
those of the first eval at or above it (seconds count generation and training, not evals).
``eval_end`` is the final eval; ``eval_end_last3`` the mean of the last three (the last
ten steps), which the "ends within 5 points" check uses because single evals of a sharp
policy swing by a few points from one eval to the next.
Runs go to ``--workers`` processes (one torch thread each). With several seeds a run's
numbers are the median (steps, seconds) or mean (accuracies) over seeds, and ``seeds``
lists every seed's own numbers. The readable table goes to stdout; ``--json`` adds one JSON
object as the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

#: rise over the base that defines the target accuracy
TARGET_RISE = 0.30
#: steps per run: full (runs end on the plateau) and --quick (runs end mid-rise, past the target)
FULL_STEPS, QUICK_STEPS = 150, 90
#: most steps of the shuffled-reward control: it is the slowest run (its completions grow to
#: the length cap and no group has zero variance) and is flat long before this
CONTROL_STEPS = 100

#: run name -> trainer-config overrides on top of the recipe
RUNS: dict[str, dict] = {
    "sync": dict(lag_versions=0, max_staleness=4),
    "stale4_corrected": dict(lag_versions=4, max_staleness=4),
    "stale4_uncorrected": dict(lag_versions=4, max_staleness=4, decoupled=False),
    "stale8_corrected": dict(lag_versions=8, max_staleness=8),
    "shuffled_reward": dict(lag_versions=0, max_staleness=4, shuffle_rewards=True),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--quick", action="store_true", help="fewer steps, one seed (under 3 minutes on 2 cores)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per run (default: 2, or 1 with --quick)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"trainer steps per run (default: {FULL_STEPS}, {QUICK_STEPS} with --quick)")
    parser.add_argument("--eval-every", type=int, default=5, help="steps between held-out evals (default 5)")
    parser.add_argument("--workers", type=int, default=None,
                        help="parallel runs (default: min(2, CPUs); each uses one torch thread)")
    parser.add_argument("--stages", type=int, default=1, help="pipeline stages in each run (default 1)")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of: " + ", ".join(RUNS))
    parser.add_argument("--checkpoint", type=Path, default=None, help="base checkpoint (default: the shipped one)")


def steps_of(name: str, steps: int) -> int:
    """Steps of one run: ``steps``, but at most CONTROL_STEPS for the shuffled-reward control."""
    return min(steps, CONTROL_STEPS) if RUNS[name].get("shuffle_rewards") else steps


def run_one(checkpoint: str, name: str, seed: int, steps: int, eval_every: int, stages: int) -> dict:
    """One training run in this process; returns its curve and diagnostics (JSON-able)."""
    from dataclasses import replace

    from engine.rl.codec import TaskCodec
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.recipe import RL_OPTIMIZER, trainer_config
    from engine.rl.trainer import Trainer

    overrides = dict(RUNS[name])
    decoupled = overrides.pop("decoupled", True)
    config = trainer_config(seed=seed, eval_every_steps=eval_every, **overrides)
    config = replace(config, objective=replace(config.objective, decoupled=decoupled))
    pipeline = LocalPipeline.from_checkpoint(checkpoint, stages, "torch", "cpu", RL_OPTIMIZER)
    try:
        trainer = Trainer(pipeline, TaskCodec.from_dir(checkpoint), config)
        start = trainer.evaluate()
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.step()
        wall_s = time.perf_counter() - t0
    finally:
        pipeline.close()
    trained = [s for s in trainer.steps if s.trained]
    compute_s, cumulative = 0.0, {}
    for s in trainer.steps:
        compute_s += s.generate_s + s.train_s
        cumulative[s.step] = compute_s
    hist: dict[str, int] = {}
    for s in trainer.steps:
        for k, v in s.staleness_histogram.items():
            hist[str(k)] = hist.get(str(k), 0) + v
    mean = (lambda xs: float(sum(xs) / len(xs)) if xs else 0.0)
    return {
        "run": name, "seed": seed, "steps": steps, "wall_s": round(wall_s, 2),
        "curve": [[start.step, start.exact_match]] + [[e.step, e.exact_match] for e in trainer.evals[1:]],
        "compute_s_at_step": cumulative,
        "masked_fraction": mean([s.masked_fraction for s in trained]),
        "ess": mean([s.ess for s in trained]),
        "clipped_fraction": mean([s.clipped_fraction for s in trained]),
        "zero_variance_fraction": mean([s.zero_variance_fraction for s in trained]),
        "entropy_proxy_end": mean([s.entropy_proxy for s in trained[-5:]]),
        "reward_end": mean([s.reward_mean for s in trained[-5:]]),
        "dropped_stale": sum(s.dropped_stale for s in trainer.steps),
        "staleness_histogram": hist,
        "versions_end": list(trained[-1].versions) if trained else [],
    }


def summarise_seed(result: dict, target: float) -> dict:
    curve = result["curve"]
    hit = next((step for step, acc in curve if acc >= target), None)
    seconds = None if hit is None else round(result["compute_s_at_step"].get(hit, 0.0), 2)
    last3 = [acc for _, acc in curve[-3:]]
    return {"seed": result["seed"], "eval_start": curve[0][1], "eval_end": curve[-1][1],
            "eval_end_last3": round(sum(last3) / len(last3), 4), "steps_to_target": hit,
            "seconds_to_target": seconds, "masked_fraction": round(result["masked_fraction"], 4),
            "ess": round(result["ess"], 4), "clipped_fraction": round(result["clipped_fraction"], 4),
            "zero_variance_fraction": round(result["zero_variance_fraction"], 4),
            "entropy_proxy_end": round(result["entropy_proxy_end"], 4), "dropped_stale": result["dropped_stale"],
            "staleness_histogram": result["staleness_histogram"], "wall_s": result["wall_s"],
            "curve": curve}


def _median_or_null(values: list) -> float | None:
    """Median treating a missed target as +inf; ``None`` if the median itself is a miss."""
    vals = sorted(math.inf if v is None else v for v in values)
    med = statistics.median(vals) if vals else math.inf
    return None if math.isinf(med) else med


def aggregate(per_seed: list[dict]) -> dict:
    mean = (lambda k: round(sum(s[k] for s in per_seed) / len(per_seed), 4))
    out = {"eval_start": mean("eval_start"), "eval_end": mean("eval_end"), "eval_end_last3": mean("eval_end_last3"),
           "steps_to_target": _median_or_null([s["steps_to_target"] for s in per_seed]),
           "seconds_to_target": _median_or_null([s["seconds_to_target"] for s in per_seed]),
           "masked_fraction": mean("masked_fraction"), "ess": mean("ess"),
           "zero_variance_fraction": mean("zero_variance_fraction"),
           "dropped_stale": sum(s["dropped_stale"] for s in per_seed)}
    if len(per_seed) > 1:
        ends = [s["eval_end"] for s in per_seed]
        out["eval_end_spread"] = [min(ends), max(ends)]
        steps = [s["steps_to_target"] for s in per_seed]
        out["steps_to_target_per_seed"] = steps
    out["seeds"] = per_seed
    return out


def checks(runs: dict, target: float, *, ends_comparable: bool = True) -> dict:
    """The acceptance checks of issue 3, computed from the numbers above.

    Rise and shuffled control use ``eval_end`` (final eval); the stale-vs-sync end
    comparison uses ``eval_end_last3`` and is ``None`` when the runs stop mid-rise
    (``ends_comparable=False``, as in ``--quick``); steps are medians over seeds.
    """
    out = {}
    sync = runs.get("sync")
    if sync:
        out["sync_rises_30_points"] = sync["eval_end"] - sync["eval_start"] >= TARGET_RISE - 1e-9
        stale = runs.get("stale4_corrected")
        if stale:
            s_sync, s_stale = sync["steps_to_target"], stale["steps_to_target"]
            out["stale4_corrected_within_1_2x_steps"] = (s_sync is not None and s_stale is not None
                                                         and s_stale <= 1.2 * s_sync)
            out["stale4_corrected_ends_within_5_points"] = (
                abs(stale["eval_end_last3"] - sync["eval_end_last3"]) <= 0.05 + 1e-9 if ends_comparable else None)
    shuffled = runs.get("shuffled_reward")
    if shuffled:
        out["shuffled_reward_does_not_rise"] = shuffled["eval_end"] <= shuffled["eval_start"] + 0.05
    return out


def format_table(report: dict) -> str:
    lines = [f"RL bench: task {report['task']}, base exact {report['base_eval']:.3f}, target {report['target']:.3f}, "
             f"{report['steps']} steps x {report['num_seeds']} seed(s), {report['workers']} worker(s), "
             f"{report['seconds']:.0f} s", "",
             f"{'run':<20}{'start':>7}{'end':>7}{'last3':>7}{'steps->t':>10}{'s->t':>8}{'masked':>8}{'ESS':>7}"
             f"{'zero-var':>9}{'dropped':>8}"]
    for name, r in report["runs"].items():
        fmt = (lambda v, f: "-" if v is None else format(v, f))
        lines.append(f"{name:<20}{r['eval_start']:>7.3f}{r['eval_end']:>7.3f}{r['eval_end_last3']:>7.3f}"
                     f"{fmt(r['steps_to_target'], '.0f'):>10}"
                     f"{fmt(r['seconds_to_target'], '.1f'):>8}{r['masked_fraction']:>8.3f}{r['ess']:>7.3f}"
                     f"{r['zero_variance_fraction']:>9.3f}{r['dropped_stale']:>8d}")
    lines.append("")
    for name, ok in report["checks"].items():
        mark = "n/a" if ok is None else "ok" if ok else "FAIL"
        lines.append(f"  [{mark}] {name}")
    if report.get("quick"):
        lines.append("  (--quick ends mid-rise: run without --quick for the end-of-run comparison)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from backends.registry import TORCH_THREADS_ENV
    from engine.paths import base_checkpoint_dir
    from engine.rl.recipe import BASE_TASK

    checkpoint = Path(args.checkpoint) if args.checkpoint else base_checkpoint_dir()
    if not (checkpoint / "config.json").exists():
        print(f"polis bench rl: no base checkpoint in {checkpoint} (make one with `polis make-base`)", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        print(f"polis bench rl: unknown run(s) {unknown} (choose from {', '.join(RUNS)})", file=sys.stderr)
        return 2
    steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
    num_seeds = args.seeds or (1 if args.quick else 2)
    workers = args.workers or max(1, min(2, os.cpu_count() or 1))
    os.environ[TORCH_THREADS_ENV] = "1"  # inherited by the workers: one thread per run
    jobs = [(name, seed) for seed in range(num_seeds) for name in names]
    t0 = time.perf_counter()
    results: dict[tuple[str, int], dict] = {}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_one, str(checkpoint), name, seed, steps_of(name, steps), args.eval_every,
                               args.stages): (name, seed)
                   for name, seed in jobs}
        for future, key in futures.items():
            results[key] = future.result()
            r = results[key]
            print(f"  {key[0]:<20} seed {key[1]}: exact {r['curve'][0][1]:.3f} -> {r['curve'][-1][1]:.3f} "
                  f"({r['wall_s']:.0f} s)", file=sys.stderr if args.json else sys.stdout, flush=True)
    base_eval = results[jobs[0]]["curve"][0][1]
    target = round(min(base_eval + TARGET_RISE, 1.0), 4)
    runs = {name: aggregate([summarise_seed(results[(name, s)], target) for s in range(num_seeds)]) for name in names}
    report = {"task": f"{BASE_TASK.name} ({BASE_TASK.min_digits}-{BASE_TASK.max_digits} digits, "
                      f"{BASE_TASK.reward.value} reward, {BASE_TASK.eval_size} held-out prompts)",
              "target": target, "base_eval": base_eval, "steps": steps,
              "control_steps": steps_of("shuffled_reward", steps), "num_seeds": num_seeds, "workers": workers,
              "stages": args.stages, "checkpoint": str(checkpoint), "seconds": round(time.perf_counter() - t0, 1),
              "runs": runs}
    report["quick"] = bool(args.quick)
    report["checks"] = checks(runs, target, ends_comparable=not args.quick)
    print(format_table(report))
    if args.json:
        print(json.dumps(report))
    return 0
