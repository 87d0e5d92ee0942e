"""``polis bench trust``: held-out accuracy under poisoning (issue 14, findings 4 and 6) vs a clean run.

Every scenario is one in-process RL run from the shipped base with the tested recipe
(``engine.rl.recipe``), the same seed and the same number of steps as the clean run, on one
stage whose every optimiser update is the swarm's: the micro-batches of an update are the
shares of ``REPLICAS`` replicas (micro-batch i belongs to replica i mod 3), and the update
applied is the swarm's robust aggregate of those shares (``engine.swarm.replica_sync.aggregate``:
non-finite shares skipped, per-replica clipping, centred clipping with three), skipped when
it is not finite, as the swarm's ``apply`` skips it. Scenarios:

* ``clean`` — three honest replicas, honest generators;
* ``x10`` / ``flip_x10`` / ``noise`` — replica 0 sends 10x its share, -10x its share, or
  Gaussian noise of 10x its share's norm;
* ``colluders_3e38`` — replicas 0 and 1 send 3e38 in every entry (the sum overflows fp32);
* ``forged_rollouts`` — one generator in three returns what finding 4 describes (ids beyond
  the vocabulary after the stop id, version 2^40, forged behaviour log-probs); every group
  goes through the coordinator's ingestion check (``engine.swarm.rollout_checks.check_result``)
  and a refused group never reaches training.

Reported per scenario: held-out greedy exact match at the end and its difference from the clean
run (at equal steps), ``steps_lost`` (updates not applied), refused groups and the step at which
the forging generator was first flagged. What it does not model: transports, processes, eviction
(run the swarm tests for those: ``tests/integration/test_trust_*``); a colluding majority of a
stage (out of scope by design). The table goes to stdout; ``--json`` adds one JSON object as the
last line. Accuracy at equal steps does not depend on wall clock: it may run niced.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

#: replicas of the one stage whose shares are aggregated
REPLICAS = 3
#: scenario -> (attack on shares, replicas that attack, forged generators)
SCENARIOS: dict[str, dict[str, Any]] = {
    "clean": {},
    "x10": {"attack": "x10", "hostile": (0,)},
    "flip_x10": {"attack": "flip_x10", "hostile": (0,)},
    "noise": {"attack": "noise", "hostile": (0,)},
    "colluders_3e38": {"attack": "3e38", "hostile": (0, 1)},
    "forged_rollouts": {"forge": True},
}
DEFAULT_STEPS = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"trainer steps per run (default {DEFAULT_STEPS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of every run (default 0)")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds (e.g. 0,1,2): every scenario once per seed, each compared "
                             "with the clean run of its seed, then mean and spread per scenario (overrides --seed)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help="comma-separated subset of: " + ", ".join(SCENARIOS))
    parser.add_argument("--checkpoint", type=Path, default=None, help="base checkpoint (default: the shipped one)")


def attacked(share: dict[str, np.ndarray], attack: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """What a hostile replica sends instead of its honest ``share``."""
    if attack == "x10":
        return {k: 10.0 * v for k, v in share.items()}
    if attack == "flip_x10":
        return {k: -10.0 * v for k, v in share.items()}
    if attack == "noise":
        norm = float(np.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in share.values())))
        noise = {k: rng.standard_normal(v.shape) for k, v in share.items()}
        scale = 10.0 * norm / max(float(np.sqrt(sum(float(np.square(v).sum()) for v in noise.values()))), 1e-30)
        return {k: (scale * v).astype(np.float32) for k, v in noise.items()}
    if attack == "3e38":
        return {k: np.full(v.shape, 3e38, dtype=np.float32) for k, v in share.items()}
    raise ValueError(f"unknown attack {attack!r}")


class ReplicaShares:
    """A ``StagePipeline`` (``engine.rl.pipeline``) whose updates are the swarm's aggregate of
    ``REPLICAS`` replicas' shares, some of them hostile. Delegates everything else."""

    def __init__(self, inner, *, attack: str | None, hostile: Sequence[int], seed: int) -> None:
        self.inner, self.attack, self.hostile = inner, attack, set(hostile)
        self.rng = np.random.default_rng([seed, 14])
        self.steps_lost = 0
        self._shares: list[list[dict[str, np.ndarray]]] = []
        self._count = 0
        self._finite = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        self._shares = [[{} for _ in range(self.inner.num_stages)] for _ in range(REPLICAS)]
        self._count = 0

    def backward(self, key: str, grad_logprobs: np.ndarray) -> None:
        before = [{k: np.array(v, dtype=np.float32) for k, v in g.items()} for g in self.inner.grads()]
        self.inner.backward(key, grad_logprobs)
        after = self.inner.grads()
        shares = self._shares[self._count % REPLICAS]
        self._count += 1
        for stage, (b, a) in enumerate(zip(before, after)):
            for name, value in a.items():
                delta = np.asarray(value, dtype=np.float32) - b[name]
                shares[stage][name] = shares[stage].get(name, 0.0) + delta

    def grad_sq_norms(self) -> list[float]:
        """Called once per update after its last backward: install the aggregate, then its norms."""
        from engine.swarm.replica_sync import aggregate

        total = []
        for stage, honest in enumerate(self.inner.grads()):
            contributions = {}
            for r in range(REPLICAS):
                share = {n: np.asarray(self._shares[r][stage].get(n, np.zeros_like(g)), dtype=np.float32)
                         for n, g in honest.items()}  # a replica without a micro-batch this update sends zeros
                if self.attack is not None and r in self.hostile:
                    share = attacked(share, self.attack, self.rng)
                contributions[f"replica{r}"] = share
            total.append(aggregate(contributions))
        self._finite = all(np.isfinite(v).all() for g in total for v in g.values())
        if self._finite:
            self.inner.set_grads(total)
            return self.inner.grad_sq_norms()
        return [0.0] * self.inner.num_stages

    def step(self, grad_scale: float | Sequence[float] = 1.0) -> None:
        if not self._finite:  # the swarm's apply skips a non-finite aggregate: weights unchanged
            self.steps_lost += 1
            self.inner.zero_grad()
            return
        self.inner.step(grad_scale)


def forge(groups, vocab_size: int, stop_id: int, every: int = 3) -> list:
    """Groups of one generator in ``every`` replaced by finding 4's forgery (in place, returned)."""
    for i, group in enumerate(groups):
        if i % every:
            continue
        for s in group.samples:
            ids = list(s.completion_ids[:1]) + [stop_id, vocab_size + 5]
            s.completion_ids = np.asarray(ids, dtype=np.int64)
            s.behaviour_logprobs = np.full(len(ids), -40.0 + np.log(2.0), dtype=np.float32)
            s.versions = np.full((len(ids), s.versions.shape[1]), 2**40, dtype=np.int64)
    return groups


def run_one(checkpoint: str, name: str, seed: int, steps: int) -> dict:
    """One scenario in this process; returns its figures (JSON-able)."""
    from engine.rl.codec import TaskCodec
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.recipe import RL_OPTIMIZER, trainer_config
    from engine.rl.trainer import Trainer
    from engine.swarm.rollout_checks import RefusedResult, RolloutLimits, check_result

    spec = SCENARIOS[name]
    codec = TaskCodec.from_dir(checkpoint)
    config = trainer_config(seed=seed, eval_every_steps=0)
    rows_per_update = config.prompts_per_step * config.group_size // config.updates_per_batch
    config = trainer_config(seed=seed, eval_every_steps=0, micro_batch_rows=-(-rows_per_update // REPLICAS))
    inner = LocalPipeline.from_checkpoint(checkpoint, 1, "torch", "cpu", RL_OPTIMIZER)
    pipeline = ReplicaShares(inner, attack=spec.get("attack"), hostile=spec.get("hostile", ()), seed=seed)
    limits = RolloutLimits(vocab_size=codec.vocab_size, stop_ids=frozenset({codec.eos_id}),
                           max_new_tokens=config.sampling.max_new_tokens)
    refused, flagged_at = 0, None
    try:
        trainer = Trainer(pipeline, codec, config)

        def ingest(groups: list) -> list:
            nonlocal refused, flagged_at
            if spec.get("forge"):
                groups = forge(groups, codec.vocab_size, codec.eos_id)
            kept = []
            for g in groups:  # the coordinator's ingestion, group by group (one job each)
                try:
                    check_result([s.completion_ids.tolist() for s in g.samples],
                                 [s.behaviour_logprobs.tolist() for s in g.samples],
                                 [int(v) for v in g.samples[0].versions.max(axis=0)], limits,
                                 current_version=int(max(pipeline.versions())))
                    kept.append(g)
                except RefusedResult:
                    refused += 1
                    if flagged_at is None:
                        flagged_at = trainer.step_count + 1
            return kept
        trainer.ingest = ingest  # the one hook between sampling and training: ingestion goes here
        start = trainer.evaluate()
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.step()
        wall_s = time.perf_counter() - t0
        end = trainer.evaluate()
    finally:
        inner.close()
    return {"scenario": name, "seed": seed, "steps": steps, "eval_start": start.exact_match,
            "eval_end": end.exact_match, "steps_lost": pipeline.steps_lost, "refused_groups": refused,
            "flagged_at_step": flagged_at, "versions_end": list(pipeline.versions()), "wall_s": round(wall_s, 1)}


def format_table(report: dict) -> str:
    lines = [f"polis bench trust: {report['steps']} steps, seed {report['seed']}, {REPLICAS} replicas "
             f"(held-out exact match; clean ends at {report['clean_end']:.3f})",
             f"{'scenario':<18} {'end':>6} {'vs clean':>9} {'lost':>5} {'refused':>8} {'flagged':>8}"]
    for r in report["scenarios"]:
        flagged = "-" if r["flagged_at_step"] is None else f"step {r['flagged_at_step']}"
        lines.append(f"{r['scenario']:<18} {r['eval_end']:>6.3f} {r['vs_clean']:>+9.3f} {r['steps_lost']:>5} "
                     f"{r['refused_groups']:>8} {flagged:>8}")
    return "\n".join(lines)


def summarise(results: Sequence[dict]) -> list[dict]:
    """Per scenario over seeds: mean, min and max of the held-out end and of the gap to clean, and
    the largest number of updates lost (``results`` carry ``vs_clean``)."""
    out = []
    for name in dict.fromkeys(r["scenario"] for r in results):
        rows = [r for r in results if r["scenario"] == name]
        ends, gaps = [r["eval_end"] for r in rows], [r["vs_clean"] for r in rows]
        out.append({"scenario": name, "seeds": [r["seed"] for r in rows],
                    "eval_end_mean": round(float(np.mean(ends)), 4),
                    "eval_end_min": min(ends), "eval_end_max": max(ends),
                    "vs_clean_mean": round(float(np.mean(gaps)), 4),
                    "vs_clean_min": min(gaps), "vs_clean_max": max(gaps),
                    "steps_lost_max": max(r["steps_lost"] for r in rows),
                    "refused_groups_mean": round(float(np.mean([r["refused_groups"] for r in rows])), 1)})
    return out


def format_summary(summary: Sequence[dict], steps: int) -> str:
    lines = [f"polis bench trust: {steps} steps, seeds {summary[0]['seeds']} (held-out exact match, mean "
             f"[min, max] over seeds; 'vs clean' against the clean run of the same seed)",
             f"{'scenario':<18} {'end':>22} {'vs clean':>26} {'lost':>5}"]
    for s in summary:
        lines.append(f"{s['scenario']:<18} {s['eval_end_mean']:>6.3f} [{s['eval_end_min']:.3f}, "
                     f"{s['eval_end_max']:.3f}] {s['vs_clean_mean']:>+9.3f} [{s['vs_clean_min']:+.3f}, "
                     f"{s['vs_clean_max']:+.3f}] {s['steps_lost_max']:>5}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from backends.registry import TORCH_THREADS_ENV
    from engine.paths import base_checkpoint_dir

    checkpoint = Path(args.checkpoint) if args.checkpoint else base_checkpoint_dir()
    if not (checkpoint / "config.json").exists():
        print(f"polis bench trust: no base checkpoint in {checkpoint} (make one with `polis make-base`)",
              file=sys.stderr)
        return 2
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"polis bench trust: unknown scenario(s) {unknown} (choose from {', '.join(SCENARIOS)})",
              file=sys.stderr)
        return 2
    if "clean" not in names:
        names.insert(0, "clean")
    os.environ.setdefault(TORCH_THREADS_ENV, "1")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds else [args.seed]
    except ValueError:
        print(f"polis bench trust: --seeds takes comma-separated integers, not {args.seeds!r}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = []
    for seed in seeds:
        of_seed = []
        for name in names:
            r = run_one(str(checkpoint), name, seed, args.steps)
            of_seed.append(r)
            print(f"  seed {seed} {name:<18} exact {r['eval_start']:.3f} -> {r['eval_end']:.3f} ({r['wall_s']:.0f} s)",
                  file=sys.stderr if args.json else sys.stdout, flush=True)
        clean_end = next(r["eval_end"] for r in of_seed if r["scenario"] == "clean")
        for r in of_seed:
            r["vs_clean"] = round(r["eval_end"] - clean_end, 4)
        results.extend(of_seed)
    if len(seeds) > 1:
        summary = summarise(results)
        report = {"steps": args.steps, "seeds": seeds, "replicas": REPLICAS, "checkpoint": str(checkpoint),
                  "seconds": round(time.perf_counter() - t0, 1), "summary": summary, "scenarios": results}
        print(format_summary(summary, args.steps))
        if args.json:
            print(json.dumps(report))
        return 0
    report = {"steps": args.steps, "seed": args.seed, "replicas": REPLICAS, "checkpoint": str(checkpoint),
              "clean_end": clean_end, "seconds": round(time.perf_counter() - t0, 1), "scenarios": results}
    print(format_table(report))
    if args.json:
        print(json.dumps(report))
    return 0
