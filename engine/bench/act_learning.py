"""Learning through an encoded stage boundary: in-process RL at equal steps, one run per scheme.

``polis bench act --learn-steps N`` (the tiny base) and ``--real-learn-versions N`` (with
``--model``) train the same recipe once per activation encoding, every boundary tensor encoded
and decoded as between two nodes (``engine.bench.act_boundary``), from the same base, seed and
prompts, and report held-out accuracy along the way with the bytes that crossed:

* tiny: the tested recipe (``engine.rl.recipe``), exact match before and after N steps;
* real: ``polis demo --model``'s recipe (the very ``RunConfig``: LoRA, learning rate, task,
  batch shape; ``engine.swarm.train_command``), strict and content-only scores on the run's
  held-out items every ``eval_every`` versions. Before the first eval a ``basis`` scheme fits
  its bases from a forward and backward pass over training-stream rows (greedy completions of
  ``calibration_items`` training prompts), as a swarm's stages fit them from their first jobs,
  never from the held-out items it is scored on. Evals decode through the encoded boundary too.

What it does not know: links, replicas, processes; which scheme is good.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from engine.bench.act_boundary import BoundaryMeter, gradient_pass, token_table_for, totals, wrap_stages
from engine.bench.real_recipe import eval_point, load_stages, make_trainer, recipe

#: training-stream items whose forward and backward pass comes first for every scheme of a real-model
#: bench (a basis scheme fits its bases from them, as a swarm's stages do from their first jobs); not measured
CALIBRATION_ITEMS = 24


def tiny_learning(checkpoint: Path, schemes: list[str], steps: int) -> dict[str, Any]:
    """Equal-sample in-process RL on the tiny base through each scheme's boundary."""
    from engine.model.checkpoint import Checkpoint
    from engine.model.loader import load_stage
    from engine.model.shard_plan import plan_stages
    from engine.rl.codec import TaskCodec
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.recipe import RL_OPTIMIZER, trainer_config
    from engine.rl.trainer import Trainer

    config = trainer_config(seed=0, eval_every_steps=max(1, steps))
    samples = steps * config.prompts_per_step * config.group_size
    out: dict[str, Any] = {"checkpoint": str(checkpoint), "steps": steps, "samples": samples, "schemes": {}}
    ck = Checkpoint(checkpoint)
    for name in schemes:
        t0 = time.perf_counter()
        stages = [load_stage(ck, spec, "torch", "cpu", RL_OPTIMIZER)
                  for spec in plan_stages(ck.config.num_hidden_layers, 2)]
        chain = wrap_stages(stages, name, token_table_for(name, checkpoint))
        try:
            trainer = Trainer(LocalPipeline(chain), TaskCodec.from_dir(checkpoint), config)
            start = trainer.evaluate()
            for boundary in chain:
                boundary.reset_meters()
            for _ in range(steps):
                trainer.step()
            acts, grads = totals(chain, "act"), totals(chain, "grad")
            end = trainer.evaluate()
        finally:
            for stage in stages:
                stage.close()
        out["schemes"][name] = {
            "exact_start": round(start.exact_match, 4), "exact_end": round(end.exact_match, 4),
            **_byte_figures(acts, grads, samples),
            "seconds": round(time.perf_counter() - t0, 1)}
        print(f"  tiny {name:<14} exact {start.exact_match:.3f} -> {end.exact_match:.3f}", file=sys.stderr,
              flush=True)
    return out


def real_learning(model: Path, schemes: list[str], versions: int, eval_every: int,
                  calibration_items: int = CALIBRATION_ITEMS, settings: list[str] | None = None) -> dict[str, Any]:
    """``polis demo --model``'s recipe (with ``settings``, ``KEY=VALUE`` run-config overrides, on top)
    trained ``versions`` versions in process through each scheme's boundary (2 stages, torch on the
    CPU): the eval curve and the bytes per trained sample."""
    from engine.rl.codec import load_codec
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.rollout import greedy_completions

    run = recipe(model, settings or [])
    codec = load_codec(model)
    out: dict[str, Any] = {"model": str(model), "task": run.task.name, "task_options": dict(run.task.options),
                           "lora_rank": run.lora.rank if run.lora.enabled else None, "lr": run.lr,
                           "settings": list(settings or []), "micro_batch_rows": run.micro_batch_rows,
                           "versions": versions, "eval_every": eval_every, "schemes": {}}
    calibration: list[list[int]] | None = None
    calibration_lens: list[int] = []
    for name in schemes:
        t0 = time.perf_counter()
        stages = load_stages(model, run)
        chain = wrap_stages(stages, name, token_table_for(name, model))
        try:
            trainer = make_trainer(model, run, chain)
            if calibration is None:  # the same rows for every scheme: exact completions of training prompts
                task = trainer.run_task  # prompts of another seed's training stream than the run's own
                prompts = [task.prompt_ids(key) for key, _ in zip(task.train_prompts(run.seed + 1),
                                                                   range(calibration_items))]
                done = greedy_completions(LocalPipeline(stages), prompts, run.sampling.max_new_tokens, codec.eos_id)
                calibration = [list(p) + [int(t) for t in c] for p, c in zip(prompts, done)]
                calibration_lens = [len(p) for p in prompts]
            gradient_pass(chain, calibration, calibration_lens, run.micro_batch_rows, codec.pad_id)
            curve = [eval_point(chain, trainer, 0, 0)]  # resets the meters after: evals are not counted
            samples, version = 0, 0
            trained = {"act": BoundaryMeter(), "grad": BoundaryMeter()}  # the training steps' bytes
            while version < versions:
                step = trainer.step()
                samples += step.trained_samples
                version = max(trainer.pipeline.versions())
                if step.trained and (version % eval_every == 0 or version >= versions):
                    curve.append(eval_point(chain, trainer, version, samples, trained))
            acts, grads = trained["act"].summary(), trained["grad"].summary()
        finally:
            for stage in stages:
                stage.close()
        out["schemes"][name] = {
            "curve": curve, "samples": samples, **_byte_figures(acts, grads, samples),
            "seconds": round(time.perf_counter() - t0, 1)}
    return out


def _byte_figures(acts: dict[str, Any], grads: dict[str, Any], samples: int) -> dict[str, Any]:
    """The boundary's two directions, their bytes per trained sample and the ratio against fp32."""
    wire = acts["wire_bytes"] + grads["wire_bytes"]
    fp32 = acts["fp32_bytes"] + grads["fp32_bytes"]
    return {"activations": acts, "gradients": grads,
            "bytes_per_sample": round(wire / samples, 1) if samples else None,
            "x_fewer_than_fp32": round(fp32 / wire, 2) if wire else None}
