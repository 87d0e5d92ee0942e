"""``polis make-base``: build the shipped base checkpoint by a short supervised warm-up.

A small Llama-architecture model (random init from the seed) is trained through the
stage API (``engine.rl.sft``) on the train stream of one task until its greedy exact match
on the held-out split first reaches ``target_exact`` (checked every ``eval_every_steps``
steps) or ``max_steps`` pass. The result is low but above zero on purpose: RL has to
carry it from there. The output directory gets ``config.json`` + ``model.safetensors``
(loadable by ``transformers.AutoModelForCausalLM``), the character tokenizer
(``engine.model.tokenizer``) and ``MADE_BY.md`` (command, seed, steps, time, accuracy).
Deterministic given the seed (single-threaded CPU maths).

What it does not know: RL, transports, the GUI.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from backends.base import OptimizerConfig
from engine.atomic_file import atomic_write_bytes
from engine.rl.codec import TaskCodec
from engine.rl.evaluation import evaluate_greedy
from engine.rl.pipeline import LocalPipeline
from engine.rl.recipe import BASE_TASK
from engine.rl.sft import sft_step
from engine.rl.tasks import ALPHABET, RewardKind, TaskConfig, make_task


@dataclass(frozen=True)
class BaseModelShape:
    """Architecture of the base model (Llama, untied head).

    Fields: hidden_size, num_layers, num_heads (query heads), num_kv_heads,
    intermediate_size (SwiGLU width), max_positions (context length).
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 192
    max_positions: int = 64

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads")
        if min(self.hidden_size, self.num_layers, self.intermediate_size, self.max_positions) < 1:
            raise ValueError("sizes must be positive")


@dataclass(frozen=True)
class MakeBaseConfig:
    """How the base checkpoint is made. Fields:

      task: the task of the warm-up (its train stream; its held-out split decides when to stop).
      shape: the model architecture.
      seed: initial weights and the order of training examples.
      batch_size: examples per SFT step.
      lr: AdamW learning rate.
      target_exact: stop at the first eval whose held-out exact match is >= this.
      eval_every_steps: how often to check.
      max_steps: give up (and keep what there is) after this many steps.
      max_new_tokens: greedy decoding budget in evals.
    """

    task: TaskConfig = BASE_TASK
    shape: BaseModelShape = field(default_factory=BaseModelShape)
    seed: int = 0
    batch_size: int = 64
    lr: float = 3e-3
    target_exact: float = 0.10
    eval_every_steps: int = 5
    max_steps: int = 3000
    max_new_tokens: int = 8

    def __post_init__(self) -> None:
        if not 0.0 < self.target_exact < 1.0:
            raise ValueError("target_exact must be in (0, 1)")
        if min(self.batch_size, self.eval_every_steps, self.max_steps, self.max_new_tokens) < 1 or self.lr <= 0:
            raise ValueError("batch_size, eval_every_steps, max_steps, max_new_tokens and lr must be positive")


def model_config(shape: BaseModelShape, vocab_size: int, codec: TaskCodec):
    from engine.model.config import ModelConfig

    return ModelConfig(model_type="llama", vocab_size=vocab_size, hidden_size=shape.hidden_size,
                       intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                       num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                       head_dim=shape.hidden_size // shape.num_heads, rms_norm_eps=1e-6, rope_theta=10000.0,
                       attention_bias=False, tie_word_embeddings=False, max_position_embeddings=shape.max_positions,
                       bos_token_id=codec.bos_id, eos_token_id=codec.eos_id, pad_token_id=codec.pad_id)


def init_weights(config, seed: int) -> dict[str, np.ndarray]:
    """HF-named fp32 weights: normal(0, 0.02) matrices, unit norms (the usual Llama init)."""
    from backends.base import StageSpec
    from engine.model.tensor_names import stage_tensor_shapes

    rng = np.random.default_rng(seed)
    whole = StageSpec(0, 1, 0, config.num_hidden_layers)
    weights = {}
    for name, shape in stage_tensor_shapes(config, whole).items():
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
        else:
            weights[name] = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
    return weights


def build_pipeline(config, weights, optimizer: OptimizerConfig, backend: str = "torch",
                   num_stages: int = 1) -> LocalPipeline:
    from backends import registry
    from engine.model.shard_plan import plan_stages
    from engine.model.tensor_names import stage_tensor_shapes

    stages = []
    for spec in plan_stages(config.num_hidden_layers, num_stages):
        stage = registry.create(backend, device="cpu" if backend == "torch" else None)
        stage.load(spec, {n: weights[n] for n in stage_tensor_shapes(config, spec)}, config, optimizer)
        stages.append(stage)
    return LocalPipeline(stages)


@dataclass
class MakeBaseReport:
    steps: int
    seconds: float
    eval_exact: float
    eval_reward: float
    final_nll: float
    num_parameters: int
    history: list[dict]


def make_base(cfg: MakeBaseConfig, out_dir: str | Path, *, backend: str = "torch", progress=None) -> MakeBaseReport:
    """Train and save the base checkpoint into ``out_dir``; returns what happened."""
    from engine.model.tokenizer import CharTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = CharTokenizer.build(ALPHABET)
    tokenizer.save(out, model_max_length=cfg.shape.max_positions)
    codec = TaskCodec.from_dir(out)
    config = model_config(cfg.shape, tokenizer.vocab_size, codec)
    task = make_task(cfg.task)
    pipeline = build_pipeline(config, init_weights(config, cfg.seed),
                              OptimizerConfig(lr=cfg.lr, weight_decay=0.0), backend=backend)
    stream = task.train_stream(cfg.seed)
    t0 = time.perf_counter()
    history: list[dict] = []
    nll, step, result = float("nan"), 0, None
    try:
        while step < cfg.max_steps:
            nll = sft_step(pipeline, [next(stream) for _ in range(cfg.batch_size)], codec, key=f"sft-{step}")
            step += 1
            if step % cfg.eval_every_steps == 0:
                result = evaluate_greedy(pipeline, codec, task, cfg.max_new_tokens)
                history.append({"step": step, "nll": round(nll, 4), "exact": result.exact_match,
                                "reward": round(result.mean_reward, 4)})
                if progress:
                    progress(history[-1])
                if result.exact_match >= cfg.target_exact:
                    break
        if result is None or history[-1]["step"] != step:
            result = evaluate_greedy(pipeline, codec, task, cfg.max_new_tokens)
        seconds = time.perf_counter() - t0
        save_checkpoint(out, config, pipeline.state_dicts()[0])
    finally:
        pipeline.close()
    return MakeBaseReport(steps=step, seconds=seconds, eval_exact=result.exact_match,
                          eval_reward=result.mean_reward, final_nll=nll, num_parameters=config.num_parameters,
                          history=history)


def save_checkpoint(out: Path, config, weights: dict[str, np.ndarray]) -> None:
    """``config.json`` + ``model.safetensors`` in the Hugging Face layout."""
    from safetensors.numpy import save

    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n", encoding="utf-8")
    data = save({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sorted(weights.items())},
                metadata={"format": "pt"})
    atomic_write_bytes(out / "model.safetensors", data)


def write_made_by(out: Path, cfg: MakeBaseConfig, report: MakeBaseReport, command: str) -> None:
    lines = [
        "# How this base checkpoint was made",
        "",
        f"Command: `{command}`",
        "",
        f"- seed: {cfg.seed}",
        f"- task: {cfg.task.name} ({cfg.task.min_digits}-{cfg.task.max_digits} digits, "
        f"held-out split of {cfg.task.eval_size})",
        f"- model: Llama, {cfg.shape.num_layers} layers, hidden {cfg.shape.hidden_size}, "
        f"{cfg.shape.num_heads} heads, MLP {cfg.shape.intermediate_size}, {report.num_parameters} parameters",
        f"- supervised warm-up: {report.steps} steps of {cfg.batch_size} examples, AdamW lr {cfg.lr}, "
        f"stopped at the first held-out exact match >= {cfg.target_exact} (checked every {cfg.eval_every_steps} steps)",
        f"- time: {report.seconds:.1f} s on {platform.machine()} ({platform.system()})",
        f"- held-out greedy exact match: {report.eval_exact:.3f}; mean per-position reward: {report.eval_reward:.3f}",
        f"- final answer-token NLL: {report.final_nll:.4f}",
        "",
        "Full settings:",
        "",
        "```json",
        json.dumps(_jsonable(asdict(cfg)), indent=2),
        "```",
        "",
    ]
    (out / "MADE_BY.md").write_text("\n".join(lines), encoding="utf-8")


def _jsonable(d):
    if isinstance(d, dict):
        return {k: _jsonable(v) for k, v in d.items()}
    if isinstance(d, RewardKind):
        return d.value
    return d


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.paths import base_checkpoint_dir

    d = MakeBaseConfig()
    parser.add_argument("--out", default=str(base_checkpoint_dir()), help="output directory (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--target-exact", type=float, default=d.target_exact,
                        help="stop when held-out exact match first reaches this (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=d.max_steps)
    parser.add_argument("--backend", default="torch", help="stage backend used for the warm-up")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 keeps it bit-for-bit reproducible; default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("POLIS_TORCH_THREADS", str(args.threads))
    cfg = MakeBaseConfig(seed=args.seed, target_exact=args.target_exact, max_steps=args.max_steps)
    print(f"making the base checkpoint in {args.out} (task {cfg.task.name}, seed {cfg.seed})")
    report = make_base(cfg, args.out, backend=args.backend,
                       progress=lambda h: print(f"  step {h['step']:5d}  nll {h['nll']:.3f}  "
                                                f"held-out exact {h['exact']:.3f}  reward {h['reward']:.3f}"))
    command = "polis make-base " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["make-base"] else "polis make-base"
    write_made_by(Path(args.out), cfg, report, command.strip())
    print(f"done in {report.seconds:.1f} s: {report.steps} steps, held-out exact {report.eval_exact:.3f}, "
          f"{report.num_parameters} parameters")
    return 0
