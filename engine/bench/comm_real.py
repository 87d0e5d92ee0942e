"""Replica sync on a real model, in process: the swarm's DiLoCo outer step between LoRA replicas.

``polis bench comm --model DIR --real-versions N`` trains ``polis demo --model``'s recipe (its
``RunConfig``: LoRA, so an adapter is what replicas exchange; lr, task, batch shape) on the CPU
without processes or links, once per scheme, from the same base:

* ``dense_fp32_every_step``, the reference: one 2-stage pipeline trained on each step's whole
  batch. R replicas that sum their fp32 gradients every step take this very step (up to the
  order of float sums), so its learning is theirs; its bytes are what they would send: R fp32
  gradients a step. The same gradients encoded as ``int8`` (``replica_sync.ReplicaCompressor``,
  packed as a node packs a share) give today's default's bytes a step.
* a ``diloco`` scheme of ``engine.bench.comm.SCHEMES``: R replicas of the 2-stage pipeline, each
  sampling and training its own share of a step's prompts with its own weights (route r is
  replica r of every stage, as in a swarm's diloco mode; a replica whose share has no reward
  variance sits that version out), and every ``inner_steps`` versions the
  swarm's outer step per stage: ``outer_sync.OuterSync`` compresses each replica's pseudo-gradient
  with error feedback, ``replica_sync.aggregate`` combines the shares as decoded, and every replica
  installs the identical result (checked bit for bit). Its bytes are the packed shares, as a
  node's ``Stepped.update_bytes`` counts them.

Held-out strict and content-only scores come at versions that are multiples of ``eval_every``
(which must be a multiple of every scheme's ``inner_steps``: replicas agree only at syncs).

What it does not know: links, processes, eviction, WAN profiles (``engine.bench.comm`` runs the
tiny base's swarm for those).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.bench.real_recipe import eval_point, load_stages, make_trainer, recipe

DENSE = "dense_fp32_every_step"


def _replica(model: Path, run):
    """A 2-stage pipeline of ``run``'s recipe and its trainer: ``(stages, trainer)``."""
    stages = load_stages(model, run)
    return stages, make_trainer(model, run, stages)


def _share_bytes(encoded) -> int:
    from engine.swarm import tensor_bundle

    return len(tensor_bundle.pack(encoded)[1])


def _trained_step(trainer) -> int:
    """Steps ``trainer`` until it trains (a batch of all-equal-reward groups trains nothing and
    moves no version); returns the samples trained."""
    for _ in range(16):
        step = trainer.step()
        if step.trained:
            return int(step.trained_samples)
    raise RuntimeError("16 batches in a row had no reward variance: nothing to train on")


def _tap_gradients(stage, sink: list[dict[str, np.ndarray]]) -> None:
    """Every optimiser step of ``stage`` first appends its gradients to ``sink`` (the step clears them)."""
    inner = stage.step

    def step(grad_scale: float = 1.0) -> None:
        sink.append(stage.grads())
        inner(grad_scale)

    stage.step = step


def dense_run(model: Path, settings: list[str], versions: int, eval_every: int, replicas: int) -> dict[str, Any]:
    """The reference: one pipeline on each step's whole batch; bytes as ``replicas`` replicas would send."""
    from engine.swarm.replica_sync import ReplicaCompressor, dense_nbytes

    stages, trainer = _replica(model, recipe(model, settings))
    int8 = ReplicaCompressor("int8")
    stepped: list[dict[str, np.ndarray]] = []  # each stage's gradients at each optimiser step
    for stage in stages:
        _tap_gradients(stage, stepped)
    fp32_bytes = int8_bytes = samples = 0
    try:
        curve = [eval_point([], trainer, 0, 0)]
        for version in range(1, versions + 1):
            samples += _trained_step(trainer)
            for grads in stepped:  # a replica sends each stage's gradient as its own share
                fp32_bytes += replicas * dense_nbytes(grads)
                int8_bytes += replicas * _share_bytes(int8.compress(grads)[0])
            stepped.clear()
            if version % eval_every == 0:
                curve.append(eval_point([], trainer, version, samples))
    finally:
        for stage in stages:
            stage.close()
    return {"curve": curve, "samples": samples, "update_bytes": fp32_bytes, "int8_update_bytes": int8_bytes}


def diloco_run(model: Path, settings: list[str], versions: int, eval_every: int, replicas: int) -> dict[str, Any]:
    """``replicas`` pipelines, each on its share of a step's prompts, synced by the swarm's outer step."""
    from engine.swarm.outer_sync import OuterSync
    from engine.swarm.replica_sync import aggregate

    base = recipe(model, settings)
    sync = base.replica_sync
    if sync.mode != "diloco" or eval_every % sync.inner_steps:
        raise ValueError(f"a diloco scheme with inner_steps dividing eval_every ({eval_every}) is needed")
    if base.prompts_per_step % replicas:
        raise ValueError(f"prompts_per_step {base.prompts_per_step} does not split over {replicas} replicas")
    share = [f"prompts_per_step={base.prompts_per_step // replicas}"]
    pipelines = [_replica(model, recipe(model, [*settings, *share, f"seed={base.seed + r}"])) for r in range(replicas)]
    outer = [[OuterSync(sync, stage.state_dict()) for stage in stages] for stages, _ in pipelines]
    update_bytes = samples = 0
    identical = True
    try:
        curve = [eval_point([], pipelines[0][1], 0, 0)]
        for version in range(1, versions + 1):
            # a replica whose share had no reward variance trains nothing this version (as a swarm
            # replica with no rows in a step): retrying until it trains would favour small shares
            samples += sum(int(trainer.step().trained_samples) for _, trainer in pipelines)
            if version % sync.inner_steps:
                continue
            for s in range(len(pipelines[0][0])):
                shares = {}
                for r, (stages, _) in enumerate(pipelines):
                    encoded, shares[f"replica-{r}"] = outer[r][s].compress(stages[s].state_dict())
                    update_bytes += _share_bytes(encoded)
                agg = aggregate(shares)
                for r, (stages, _) in enumerate(pipelines):
                    stages[s].set_weights(outer[r][s].outer_step(agg, replicas))
                first = pipelines[0][0][s].state_dict()
                identical &= all(all(np.array_equal(first[n], a) for n, a in stages[s].state_dict().items())
                                 for stages, _ in pipelines[1:])
            if version % eval_every == 0:
                curve.append(eval_point([], pipelines[0][1], version, samples))
    finally:
        for stages, _ in pipelines:
            for stage in stages:
                stage.close()
    return {"curve": curve, "samples": samples, "update_bytes": update_bytes, "replicas_identical": identical}


def real_replica_sync(model: Path, schemes: list[tuple[str, tuple[str, ...]]], versions: int, eval_every: int,
                      replicas: int = 2, settings: list[str] | None = None) -> dict[str, Any]:
    """Every scheme ``(name, run settings)`` trained ``versions`` versions; ``DENSE`` runs first and
    the others are compared with it: update bytes per trained sample against int8 every step, and
    strict accuracy points against dense at each common eval."""
    names = [name for name, _ in schemes]
    if DENSE not in names:
        raise ValueError(f"{DENSE} is the reference: include it")
    ordered = sorted(schemes, key=lambda s: s[0] != DENSE)
    run = recipe(model, list(settings or []))
    out: dict[str, Any] = {"model": str(model), "task": run.task.name, "replicas": replicas, "versions": versions,
                           "eval_every": eval_every, "lora_rank": run.lora.rank if run.lora.enabled else None,
                           "lr": run.lr, "prompts_per_step": run.prompts_per_step, "rows": []}
    dense: dict[str, Any] = {}
    for name, scheme_settings in ordered:
        t0 = time.perf_counter()
        print(f"  real {name}: {versions} versions, {replicas} replicas", file=sys.stderr, flush=True)
        every = [*(settings or []), *scheme_settings]
        result = (dense_run if name == DENSE else diloco_run)(model, every, versions, eval_every, replicas)
        row = {"scheme": name, "settings": list(scheme_settings), **result,
               "update_bytes_per_sample": result["update_bytes"] / max(1, result["samples"]),
               "seconds": round(time.perf_counter() - t0, 1)}
        if name == DENSE:
            dense = row
            row["int8_update_bytes_per_sample"] = result["int8_update_bytes"] / max(1, result["samples"])
        _compare(row, dense)
        out["rows"].append(row)
    return out


def _compare(row: dict[str, Any], dense: dict[str, Any]) -> None:
    """Ratios against int8 every step and strict-accuracy gaps against dense (in place)."""
    int8 = dense["int8_update_bytes_per_sample"]
    row["update_reduction_vs_int8_every_step"] = int8 / row["update_bytes_per_sample"] \
        if row["update_bytes_per_sample"] else None
    ref = {p["version"]: p for p in dense["curve"]}
    gaps = [100.0 * (p["strict"] - ref[p["version"]]["strict"]) for p in row["curve"][1:] if p["version"] in ref]
    row["accuracy_gap_points_vs_dense"] = gaps[-1] if gaps else None
    row["accuracy_gap_points_vs_dense_mean"] = sum(gaps) / len(gaps) if gaps else None
    row["meets_target"] = bool(row["update_reduction_vs_int8_every_step"] and gaps
                               and row["update_reduction_vs_int8_every_step"] >= 50
                               and min(gaps[-1], sum(gaps) / len(gaps)) >= -5.0)


def format_table(result: dict[str, Any]) -> str:
    lines = [f"real model {result['model']}, {result['replicas']} replicas of 2 stages, {result['versions']} "
             f"versions per scheme (LoRA rank {result['lora_rank']}, lr {result['lr']}, "
             f"{result['prompts_per_step']} prompts a step over all replicas)",
             f"{'scheme':<28}{'samples':>8}{'upd B/sample':>13}{'vs int8':>9}{'gap':>7}{'mean gap':>9}"
             "  curve (version: strict)  target"]
    for r in result["rows"]:
        red, gap, mean = (r.get("update_reduction_vs_int8_every_step"), r.get("accuracy_gap_points_vs_dense"),
                          r.get("accuracy_gap_points_vs_dense_mean"))
        curve = " ".join(f"v{p['version']}:{p['strict']:.3f}" for p in r["curve"])
        lines.append(f"{r['scheme']:<28}{r['samples']:>8}{r['update_bytes_per_sample']:>13.1f}"
                     f"{(f'{red:.3g}x' if red else '-'):>9}{(f'{gap:+.1f}' if gap is not None else '-'):>7}"
                     f"{(f'{mean:+.1f}' if mean is not None else '-'):>9}  {curve}"
                     + ("  met" if r["meets_target"] else "  -"))
    return "\n".join(lines)
