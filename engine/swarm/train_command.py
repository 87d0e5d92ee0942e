"""``polis train``: the swarm's run recipe trained in one process, for comparison at equal samples.

It builds the very :class:`~engine.swarm.run_config.RunConfig` a coordinator would (``polis
demo``'s recipe with ``--model``, then ``--task``, then ``--set``: :func:`engine.swarm.demo.
real_model_settings`), cuts the same base into the same number of stages in this process
(``engine.rl.pipeline.LocalPipeline``), and runs ``engine.rl.trainer.Trainer`` with the run's
task, objective, sampling, batch shape, staleness bound, optimiser (AdamW at the run's ``lr``)
and LoRA settings. Prompts, rewards and held-out scores come from the same ``RunTask`` the
coordinator uses, with the run's seed, so the held-out items are the swarm's.

What differs from the swarm, by design: no wire (activations stay fp32 between stages, no
gradient compression between replicas, one replica per stage) and no generation ahead of
training unless ``--lag-versions`` asks for it. Evals run at version 0, every
``eval_every_versions`` versions and at the end; ``--json`` prints one summary object with the
curve (version, samples trained, strict, content) and the time per step (generation, training).

What it does not know: processes, networks, the coordinator's database.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a real model (smollm2-135m or an imported directory), with polis demo's real-model "
                             "recipe; default: the shipped tiny base and the swarm's defaults")
    parser.add_argument("--task", default=None, help="the task, as for polis demo (e.g. reasoning_gym:chain_sum)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a run setting, exactly as for polis demo / polis coordinator (repeatable)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages in this process (default 2)")
    parser.add_argument("--samples", type=int, default=0,
                        help="stop once this many samples (rows) were trained on, e.g. a swarm run's total")
    parser.add_argument("--versions", type=int, default=0, help="stop at this policy version")
    parser.add_argument("--minutes", type=float, default=0.0, help="stop after this many minutes of training")
    parser.add_argument("--lag-versions", type=int, default=0,
                        help="train on batches generated this many versions earlier (0: on-policy)")
    parser.add_argument("--backend", default="torch", help="stage backend: torch or mlx (default torch)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")


def trainer_config(run, *, lag_versions: int = 0):
    """The in-process ``TrainerConfig`` of a swarm ``RunConfig`` (the same RL settings, field by field)."""
    from engine.rl.trainer import TrainerConfig

    return TrainerConfig(task=run.task, objective=run.objective, sampling=run.sampling,
                         prompts_per_step=run.prompts_per_step, group_size=run.group_size,
                         lag_versions=lag_versions * run.updates_per_batch, max_staleness=run.max_staleness,
                         max_grad_norm=run.max_grad_norm, micro_batch_rows=run.micro_batch_rows,
                         updates_per_batch=run.updates_per_batch, eval_every_steps=0, seed=run.seed,
                         pack_groups=run.pack_groups)


def optimizer_config(run):
    """The optimiser every swarm trainer node builds from ``run`` (``engine.swarm.node``)."""
    from backends.base import OptimizerConfig

    return OptimizerConfig(lr=run.lr, trainable=True, lora=run.lora.backend_config())


def run_config(args: argparse.Namespace):
    """The RunConfig a demo coordinator would run for these flags (raises ValueError)."""
    from engine.swarm.demo import real_model_settings
    from engine.swarm.run_config import RunConfig, apply_overrides

    return apply_overrides(RunConfig(), real_model_settings(args))


def _done(args: argparse.Namespace, version: int, samples: int, started: float) -> bool:
    if args.samples and samples >= args.samples:
        return True
    if args.versions and version >= args.versions:
        return True
    if args.minutes and time.monotonic() - started >= args.minutes * 60:
        return True
    return not (args.samples or args.versions or args.minutes) and version >= 1


def train(args: argparse.Namespace, out) -> dict[str, Any]:
    from engine.rl.codec import load_codec
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.trainer import Trainer
    from engine.swarm.demo import ensure_imported
    from engine.swarm.stage_loading import base_dir

    run = run_config(args)
    if args.model:
        ensure_imported(args.model, out)
    checkpoint = base_dir(None, run.model)
    pipeline = LocalPipeline.from_checkpoint(checkpoint, args.stages, args.backend, None, optimizer_config(run))
    try:
        trainer = Trainer(pipeline, load_codec(checkpoint), trainer_config(run, lag_versions=args.lag_versions))
        curve: list[list[Any]] = []

        def evaluate(version: int, samples: int) -> None:
            e = trainer.evaluate()
            curve.append([version, samples, e.exact_match, e.content])
            content = "" if e.content is None else f", content {100 * e.content:.1f} %"
            print(f"eval v{version} ({samples} samples): strict {100 * e.exact_match:.1f} %{content} "
                  f"[{e.seconds:.0f} s]", file=out, flush=True)

        evaluate(0, 0)
        started = time.monotonic()
        samples, version = 0, 0
        while not _done(args, version, samples, started):
            step = trainer.step()
            samples += step.trained_samples
            version = max(pipeline.versions())
            print(f"step {step.step}: v{version} reward {step.reward_mean:.3f} trained {step.trained_samples} rows "
                  f"zero-var {step.zero_variance_fraction:.2f} gen {step.generate_s:.1f} s train {step.train_s:.1f} s",
                  file=out, flush=True)
            if step.trained and run.eval_every_versions and version % run.eval_every_versions == 0:
                evaluate(version, samples)
        if not curve or curve[-1][0] != version:
            evaluate(version, samples)
        steps = trainer.steps
        return {
            "model": run.model or checkpoint.name, "task": run.task.name, "stages": args.stages,
            "lora_rank": run.lora.rank if run.lora.enabled else None, "lr": run.lr,
            "lag_versions": args.lag_versions, "versions": version, "samples_trained": samples,
            "eval_before": curve[0][2], "eval_after": curve[-1][2],
            "eval_before_content": curve[0][3], "eval_after_content": curve[-1][3],
            "eval_curve": curve, "seconds": round(time.monotonic() - started, 1),
            "generate_seconds_mean": round(sum(s.generate_s for s in steps) / len(steps), 2) if steps else None,
            "train_seconds_mean": round(sum(s.train_s for s in steps) / len(steps), 2) if steps else None,
            "zero_variance_fraction_mean": (round(sum(s.zero_variance_fraction for s in steps) / len(steps), 3)
                                            if steps else None),
        }
    finally:
        pipeline.close()


def run(args: argparse.Namespace) -> int:
    from engine.model.errors import CheckpointError
    from engine.rl.codec import CodecError

    out = sys.stderr if args.json else sys.stdout
    try:
        summary = train(args, out)
    except (ValueError, FileNotFoundError, CheckpointError, CodecError) as exc:
        print(f"polis train: {exc}", file=sys.stderr)
        return 2
    print(f"Held-out on {summary['task']}: strict {100 * summary['eval_before']:.1f} % -> "
          f"{100 * summary['eval_after']:.1f} % after {summary['versions']} versions "
          f"({summary['samples_trained']} samples)", file=out)
    if args.json:
        print(json.dumps(summary))
    return 0
