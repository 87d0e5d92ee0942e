"""``polis bench act``: stage-boundary activation encodings on a real model and on the tiny one.

For each scheme in ``--schemes`` (``run_config.ActivationEncoding`` names: fp32, bf16,
int8_rowwise, subspace_r<k>, ...), with the model cut into two stages in this process and
every boundary tensor encoded and decoded exactly as between two nodes
(``engine.bench.act_boundary``):

* **real model** (``--model DIR``, e.g. SmolLM2-135M imported by ``polis import``), on
  ``--items`` held-out items of ``--task`` (default the real-model demo's chain_sum):
  ``strict`` greedy accuracy (the same decoding as ``polis eval``) and the bytes and
  relative error of the activations that crossed while decoding (prefill and every
  decoding step); on the fp32 run's completions, teacher-forced, the share of positions
  whose next-token argmax matches fp32's and the mean KL from fp32 (finer than strict
  accuracy on few items); then a training pass over the same prompts with the fp32 run's greedy
  completions (micro-batches of ``--micro-batch-rows`` right-padded rows, LoRA rank 16 as
  in the demo, an RL-like loss: +-1 advantages on the completion tokens), with the bytes
  and relative error of the training activations and of their gradients, and the cosine
  between the first stage's adapter gradient and the fp32 run's (what the gradient
  encoding does to learning, before any step); ``all_phases``: the ratio over generation,
  training forward and backward together. Before all that, a forward and backward pass over
  ``CALIBRATION_ITEMS`` training-stream items (not measured): a ``basis`` scheme fits its
  bases from them, as a swarm's stages do from their first jobs;
* **real model learning** (``--real-learn-versions N`` with ``--model``): ``polis demo
  --model``'s recipe (its ``RunConfig``: LoRA, lr, task, batch shape) trained N versions in
  process per scheme through the encoded boundary, strict and content-only scores on the
  run's held-out items every ``--real-learn-eval-every`` versions, and the training bytes
  per trained sample (``engine.bench.act_learning``); ``--real-learn-set KEY=VALUE`` changes
  the recipe (e.g. ``micro_batch_rows=32``: fewer, larger gradient tensors); ``--items 0`` skips the part above;
* **tiny model** (``--learn-steps N``, the shipped base): N in-process RL steps of the
  tested recipe (``engine.rl.recipe``) through the encoded boundary, at equal samples for
  every scheme: held-out exact match before and after, and bytes per trained sample
  (activations forward and gradients back during training, plus generation).

The readable table goes to stdout; ``--json`` adds one JSON object as the last line. No
figure here depends on wall clock (it may run at low priority); ``seconds`` is informative.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.bench.act_boundary import gradient_pass, signed_micro_batches, token_table_for, totals, wrap_stages
from engine.bench.act_learning import CALIBRATION_ITEMS, real_learning, tiny_learning
from engine.swarm.run_config import ACTIVATION_ENCODINGS

DEFAULT_SCHEMES = "fp32,bf16,int8_rowwise,subspace_r16,subspace_r32,subspace_r64"
DEFAULT_TASK = "reasoning_gym:chain_sum"
DEFAULT_TASK_OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
#: LoRA of the real-model demo (engine.swarm.demo.REAL_MODEL_SETTINGS)
DEMO_LORA_RANK, DEMO_LORA_ALPHA = 16, 32.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--model", type=Path, default=None,
                        help="imported real model (e.g. <data dir>/models/smollm2-135m); omit to skip that part")
    parser.add_argument("--schemes", default=DEFAULT_SCHEMES,
                        help=f"comma-separated activation encodings (default {DEFAULT_SCHEMES}; fp32 always runs "
                             f"first as the reference). Known: {', '.join(ACTIVATION_ENCODINGS)}")
    parser.add_argument("--items", type=int, default=32,
                        help="held-out items of the real model's task (default 32; 0 skips that part)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="greedy completion budget (default 48)")
    parser.add_argument("--micro-batch-rows", type=int, default=8,
                        help="rows per training micro-batch of the gradient pass (default 8, as in the demo)")
    parser.add_argument("--learn-steps", type=int, default=0,
                        help="in-process RL steps on the tiny base per scheme (default 0: skip)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="tiny base for --learn-steps (default: shipped)")
    parser.add_argument("--real-learn-versions", type=int, default=0,
                        help="with --model: train polis demo --model's recipe this many versions in process per "
                             "scheme through its boundary (default 0: skip; ~15 s a version on 2 cores)")
    parser.add_argument("--real-learn-eval-every", type=int, default=16,
                        help="versions between the held-out evals of --real-learn-versions (default 16)")
    parser.add_argument("--real-learn-set", action="append", default=[], metavar="KEY=VALUE",
                        help="run-config setting over polis demo --model's recipe for --real-learn-versions "
                             "(repeatable, as polis train --set; e.g. micro_batch_rows=32)")


def _schemes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ACTIVATION_ENCODINGS]
    if unknown:
        raise ValueError(f"unknown scheme(s) {unknown} (known: {', '.join(ACTIVATION_ENCODINGS)})")
    return ["fp32"] + [n for n in names if n != "fp32"]


# ------------------------------------------------------------------ real model

def _load_real(model: Path, lora: bool):
    from backends.base import LoraConfig, OptimizerConfig
    from engine.model.checkpoint import Checkpoint
    from engine.model.loader import load_stage
    from engine.model.shard_plan import plan_stages

    checkpoint = Checkpoint(model)
    optimizer = OptimizerConfig(lr=5e-5, lora=LoraConfig(enabled=lora, rank=DEMO_LORA_RANK, alpha=DEMO_LORA_ALPHA))
    return [load_stage(checkpoint, spec, "torch", "cpu", optimizer)
            for spec in plan_stages(checkpoint.config.num_hidden_layers, 2)]


def _all_phases(*meters: dict[str, Any]) -> dict[str, Any]:
    """Bytes over generation, training forward and backward together (the whole run's ratio)."""
    wire = sum(m["wire_bytes"] for m in meters)
    fp32 = sum(m["fp32_bytes"] for m in meters)
    return {"wire_bytes": wire, "fp32_bytes": fp32, "x_fewer_than_fp32": round(fp32 / wire, 2) if wire else None}


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _teacher_forced(stages, sequences, prompt_lens, rows: int, pad_id: int) -> np.ndarray:
    """Next-token log-probs ``[positions, vocab]`` at every completion position of the fixed sequences."""
    out = []
    for inputs, _, grad in signed_micro_batches(sequences, prompt_lens, rows, pad_id):
        x = inputs
        for stage in stages:
            x = stage.forward(x)
        out.append(_log_softmax(x[grad != 0].astype(np.float64)).astype(np.float32))
    return np.concatenate(out)


def _agreement(logp: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(share of positions whose argmax matches the reference, mean KL(reference || logp))."""
    agree = float(np.mean(logp.argmax(-1) == reference.argmax(-1)))
    p = np.exp(reference.astype(np.float64))
    kl = float(np.mean(np.sum(p * (reference.astype(np.float64) - logp.astype(np.float64)), axis=-1)))
    return agree, kl


def _cosine(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    dot = sum(float(np.vdot(a[k].astype(np.float64), b[k].astype(np.float64))) for k in a)
    na = sum(float(np.sum(a[k].astype(np.float64) ** 2)) for k in a) ** 0.5
    nb = sum(float(np.sum(b[k].astype(np.float64) ** 2)) for k in b) ** 0.5
    return dot / (na * nb) if na and nb else 0.0


def real_model(model: Path, schemes: list[str], n_items: int, max_new_tokens: int, rows: int) -> dict[str, Any]:
    """Greedy accuracy and boundary figures of each scheme on the real model (see the module docstring)."""
    from engine.rl.codec import ChatCodec, load_codec
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.rollout import greedy_completions
    from engine.rl.tasks import make_chat_task, summarise
    from engine.rl.tasks.config import TaskConfig

    codec = load_codec(model)
    if not isinstance(codec, ChatCodec):
        raise ValueError(f"{model} is not a chat model (bench act's real-model part needs a chat template)")
    task = make_chat_task(TaskConfig(name=DEFAULT_TASK, options=dict(DEFAULT_TASK_OPTIONS)))
    items = task.eval_items()[:n_items]
    prompts = [codec.encode_messages(item.prompt.as_dicts()) for item in items]
    train_items = [item for item, _ in zip(task.train_items(seed=0), range(CALIBRATION_ITEMS))]
    calib_prompts = [codec.encode_messages(item.prompt.as_dicts()) for item in train_items]
    stages = _load_real(model, lora=True)
    out: dict[str, Any] = {"model": str(model), "task": DEFAULT_TASK, "task_options": DEFAULT_TASK_OPTIONS,
                           "items": len(items), "max_new_tokens": max_new_tokens, "micro_batch_rows": rows,
                           "boundary_layer": stages[0].spec.layer_end, "schemes": {}}
    reference_grads, reference_logp, sequences, calib_sequences = None, None, None, None
    try:
        for name in schemes:
            t0 = time.perf_counter()
            wrapped = wrap_stages(stages, name, token_table_for(name, model))
            if calib_sequences is None:  # training-stream rows, as a swarm's first jobs (fp32's completions)
                calib_done = greedy_completions(LocalPipeline(stages), calib_prompts, max_new_tokens, codec.eos_id)
                calib_sequences = [list(p) + [int(t) for t in c] for p, c in zip(calib_prompts, calib_done)]
            # a basis scheme fits its bases from these (not from the held-out items it is scored on)
            gradient_pass(wrapped, calib_sequences, [len(p) for p in calib_prompts], rows, codec.pad_id)
            calibration = {"activations": totals(wrapped, "act"), "gradients": totals(wrapped, "grad")}
            for boundary in wrapped:
                boundary.reset_meters()
            completions = greedy_completions(LocalPipeline(wrapped), prompts, max_new_tokens, codec.eos_id)
            scores = [task.score_tokens(item, [int(t) for t in ids], codec) for item, ids in zip(items, completions)]
            summary = summarise(items, scores)
            gen = totals(wrapped, "act")
            if sequences is None:  # the fp32 run's completions are every scheme's training rows
                sequences = [list(p) + [int(t) for t in c] for p, c in zip(prompts, completions)]
            for boundary in wrapped:
                boundary.reset_meters()
            grads = gradient_pass(wrapped, sequences, [len(p) for p in prompts], rows, codec.pad_id)
            train_acts, train_grads = totals(wrapped, "act"), totals(wrapped, "grad")
            logp = _teacher_forced(wrapped, sequences, [len(p) for p in prompts], rows, codec.pad_id)
            if reference_grads is None or reference_logp is None:
                reference_grads, reference_logp = grads, logp
            agree, kl = _agreement(logp, reference_logp)
            out["schemes"][name] = {
                "strict": round(summary.strict, 4), "well_formed": round(summary.well_formed, 4),
                "teacher_forced_argmax_agreement": round(agree, 4), "teacher_forced_kl": round(kl, 5),
                "generation_activations": gen, "training_activations": train_acts,
                "training_gradients": train_grads,
                "stage0_grad_cosine_vs_fp32": round(_cosine(grads, reference_grads), 5),
                "calibration": calibration, "all_phases": _all_phases(gen, train_acts, train_grads),
                "seconds": round(time.perf_counter() - t0, 1)}
            print(f"  {name:<14} strict {summary.strict:.3f} {json.dumps(out['schemes'][name])}", file=sys.stderr,
                  flush=True)
    finally:
        for stage in stages:
            stage.close()
    return out


# ------------------------------------------------------------------ report

def format_table(report: dict[str, Any]) -> str:
    lines = []
    real = report.get("real")
    if real:
        lines += [f"real model {real['model']} cut after layer {real['boundary_layer']}, {real['items']} items",
                  f"{'scheme':<14}{'strict':>7}{'gen x':>8}{'gen err':>9}{'act x':>8}{'act err':>9}"
                  f"{'grad x':>8}{'grad err':>9}{'g cos':>7}{'agree':>7}{'KL':>8}{'all x':>7}"]
        for name, r in real["schemes"].items():
            g, a, d = r["generation_activations"], r["training_activations"], r["training_gradients"]
            lines.append(f"{name:<14}{r['strict']:>7.3f}{g['x_fewer_than_fp32']:>8.1f}{g['relative_error']:>9.4f}"
                         f"{a['x_fewer_than_fp32']:>8.1f}{a['relative_error']:>9.4f}{d['x_fewer_than_fp32']:>8.1f}"
                         f"{d['relative_error']:>9.4f}{r['stage0_grad_cosine_vs_fp32']:>7.3f}"
                         f"{r['teacher_forced_argmax_agreement']:>7.3f}{r['teacher_forced_kl']:>8.4f}"
                         f"{r['all_phases']['x_fewer_than_fp32']:>7.1f}")
    tiny = report.get("tiny")
    if tiny:
        lines += ["", f"tiny base, {tiny['steps']} RL steps ({tiny['samples']} samples) per scheme",
                  f"{'scheme':<14}{'start':>7}{'end':>7}{'B/sample':>10}{'x fp32':>8}{'act err':>9}{'grad err':>9}"]
        for name, r in tiny["schemes"].items():
            lines.append(f"{name:<14}{r['exact_start']:>7.3f}{r['exact_end']:>7.3f}{r['bytes_per_sample']:>10.0f}"
                         f"{r['x_fewer_than_fp32']:>8.1f}{r['activations']['relative_error']:>9.4f}"
                         f"{r['gradients']['relative_error']:>9.4f}")
    learned = report.get("real_learning")
    if learned:
        lines += ["", f"real model {learned['model']}, {learned['versions']} versions of polis demo --model's "
                      f"recipe per scheme (LoRA rank {learned['lora_rank']}, lr {learned['lr']}), strict / content "
                      "at each eval",
                  f"{'scheme':<16}{'samples':>8}{'B/sample':>10}{'x fp32':>8}  curve (version: strict/content)"]
        for name, r in learned["schemes"].items():
            curve = " ".join(f"v{p['version']}: {p['strict']:.3f}/{p['content'] if p['content'] is not None else '-'}"
                             for p in r["curve"])
            lines.append(f"{name:<16}{r['samples']:>8}{r['bytes_per_sample'] or 0:>10.0f}"
                         f"{r['x_fewer_than_fp32'] or 0:>8.1f}  {curve}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from engine.paths import base_checkpoint_dir

    try:
        schemes = _schemes(args.schemes)
    except ValueError as exc:
        print(f"polis bench act: {exc}", file=sys.stderr)
        return 2
    if args.model is None and args.learn_steps <= 0:
        print("polis bench act: nothing to do: give --model DIR (a real model) and/or --learn-steps N (tiny base)",
              file=sys.stderr)
        return 2
    if args.real_learn_versions > 0 and (args.model is None or args.real_learn_eval_every < 1):
        print("polis bench act: --real-learn-versions needs --model DIR and --real-learn-eval-every >= 1",
              file=sys.stderr)
        return 2
    report: dict[str, Any] = {"schemes": schemes}
    t0 = time.perf_counter()
    if args.model is not None:
        if not (args.model / "config.json").exists():
            print(f"polis bench act: no model in {args.model} (import one with `polis import smollm2-135m`)",
                  file=sys.stderr)
            return 2
        if args.items > 0:
            report["real"] = real_model(args.model, schemes, args.items, args.max_new_tokens, args.micro_batch_rows)
        if args.real_learn_versions > 0:
            report["real_learning"] = real_learning(args.model, schemes, args.real_learn_versions,
                                                    args.real_learn_eval_every, settings=args.real_learn_set)
    if args.learn_steps > 0:
        checkpoint = Path(args.checkpoint) if args.checkpoint else base_checkpoint_dir()
        report["tiny"] = tiny_learning(checkpoint, schemes, args.learn_steps)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(format_table(report))
    if args.json:
        print(json.dumps(report))
    return 0
