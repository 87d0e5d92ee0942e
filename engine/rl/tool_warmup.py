"""A short supervised tool-use warm-up before RL: a model that never calls the tool gives RL nothing.

SmolLM2-135M on the calculator environment made 0.03 tool calls per episode and scored 0, so no
group had reward variance and RL never stepped. ``warm_up`` gives RL a start that sometimes calls
the tool:

1. correct transcripts of the environment's own training items (``engine.envs.transcripts``:
   the environment runs the calculator and scores each one as solved), rendered through the run
   task's chat renderer, the one the swarm's rollouts use, into trajectories whose loss mask is 1
   on the assistant tokens only (the system prompt, the worked example, the question and the
   tool's observation are context);
2. ``steps`` SFT steps (``engine.rl.sft``, the one SFT loss) of ``batch_size`` transcripts each, on
   LoRA adapters of the run's shape over the frozen base, through the stage API in this process;
3. the adapters merged into the base (``W + (alpha/r) B A``, ``backends.lora.merge`` through the
   stage's ``merged_state_dict``) and written as an ordinary HF checkpoint directory (config and
   tokenizer files of the base): the swarm's nodes then start from it as their base, the simplest
   route (no adapter loading path in the nodes, the run's own fresh LoRA trains on top, and
   ``polis eval`` / ``polis export`` read it as they read any base).

Before and after training it scores ``eval_items`` held-out episodes greedily in the environment
(``evaluate_tool_use``: the run task's own episode stepping, so the figures are the swarm eval's),
reporting accuracy, tool calls and turns per episode, and the base on the same questions without
the tool (``engine.rl.checkpoint_eval``, one greedy turn). The result is cached under a key of the
settings, the task, the environment limits and the base's weights hash (``warmup_key``):
``cached_warm_up`` reuses a directory whose ``WARMUP.json`` has the same key.

What it does not know: the swarm, processes, the command line (``engine.swarm.demo`` calls it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from engine.envs.settings import EnvSettings
from engine.envs.trajectory import Trajectory
from engine.rl.tasks import TaskConfig

if TYPE_CHECKING:
    from engine.rl.env_run_task import EnvRunTask

log = logging.getLogger(__name__)

#: the warm-up's record in its output directory (settings, key, figures, seconds)
RECORD_FILE = "WARMUP.json"
#: tokenizer and side files copied from the base into the warmed checkpoint when present
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "generation_config.json")


@dataclass(frozen=True)
class WarmupSettings:
    """How the warm-up trains. Fields:

      steps: SFT steps (0: no training; the output is the base, re-saved).
      batch_size: transcripts per step (distinct training items: ``steps * batch_size`` in all).
      micro_batch_rows: rows per forward/backward pass (gradients accumulate over a step's rows).
      lr: AdamW learning rate of the adapters.
      lora_rank / lora_alpha: the adapters (all linear layers of every decoder layer, as the demo's RL).
      seed: the training stream the transcripts come from.
      max_grad_norm: global gradient-norm clip of a step.
      eval_items: held-out episodes scored before and after (0: none).
      max_new_tokens: tokens a model turn may take in those evals (the demo's RL turn budget).
    """

    steps: int = 2
    batch_size: int = 4
    micro_batch_rows: int = 4
    lr: float = 1e-4
    lora_rank: int = 16
    lora_alpha: float = 32.0
    seed: int = 0
    max_grad_norm: float = 1.0
    eval_items: int = 32
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.steps < 0 or min(self.batch_size, self.micro_batch_rows, self.lora_rank, self.max_new_tokens) < 1:
            raise ValueError("steps must be >= 0; batch_size, micro_batch_rows, lora_rank, max_new_tokens >= 1")
        if not (self.lr > 0 and self.lora_alpha > 0 and self.max_grad_norm > 0) or self.eval_items < 0:
            raise ValueError("lr, lora_alpha and max_grad_norm must be positive, eval_items >= 0")


@dataclass(frozen=True)
class ToolUseFigures:
    """Greedy held-out episodes of one model in the environment.

    Fields: episodes; strict (share answered right in tags, a cut episode 0); tool_calls_per_episode;
    turns_per_episode; calling_share (episodes with at least one tool call); seconds (wall clock).
    """

    episodes: int
    strict: float
    tool_calls_per_episode: float
    turns_per_episode: float
    calling_share: float
    seconds: float


@dataclass(frozen=True)
class WarmupReport:
    """What a warm-up did (written to ``RECORD_FILE``). ``losses``: each step's NLL before it;
    ``skipped_items``: training items whose transcript the environment did not score as solved."""

    key: str
    base_dir: str
    settings: dict[str, Any]
    steps: int
    transcripts: int
    skipped_items: int
    losses: list[float]
    train_seconds: float
    seconds: float
    before: ToolUseFigures | None
    after: ToolUseFigures | None
    reused: bool = False
    #: the base on the same held-out questions without the tool (one greedy turn; ``TaskEval`` as a dict)
    base_without_tool: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WarmupReport":
        figures = {k: ToolUseFigures(**data[k]) if data.get(k) else None for k in ("before", "after")}
        return cls(**{**data, **figures})


def weights_sha256(base_dir: str | Path) -> str:
    """SHA-256 over the base's safetensors files (names and bytes, sorted by name)."""
    h = hashlib.sha256()
    for path in sorted(Path(base_dir).glob("*.safetensors")):
        h.update(path.name.encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def warmup_key(settings: WarmupSettings, task: TaskConfig, env: EnvSettings, base_sha256: str) -> str:
    """The cache key: everything the warmed weights depend on."""
    blob = json.dumps({"settings": asdict(settings), "task": asdict(task), "env": asdict(env),
                       "base": base_sha256, "recipe": 1}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def transcript_trajectories(run_task: "EnvRunTask", count: int, seed: int) -> tuple[list[Trajectory], int]:
    """``count`` transcript trajectories of the run task's environment (model tokens masked in),
    and how many training items were skipped on the way."""
    from engine.envs.tool_env import ToolEnvironment
    from engine.envs.transcripts import tool_transcripts

    if not isinstance(run_task.env, ToolEnvironment):
        raise ValueError(f"the {run_task.env.name} environment has no tools to warm up on")
    made, skipped = tool_transcripts(run_task.env, seed, count, limits=run_task.limits, max_items=4 * count + 16)
    out = [run_task.renderer.trajectory(result.messages, opening=len(item.messages)) for item, result in made]
    if len(out) < count:
        raise ValueError(f"only {len(out)} of {count} training items gave a solved transcript; "
                         f"is {run_task.env.name} an arithmetic task?")
    return out, skipped


class GreedyTurns:
    """Greedy model turns for one episode, keeping the KV cache across turns (only new ids are fed)."""

    def __init__(self, pipeline, stop_ids: Sequence[int], cache_id: str) -> None:
        self.pipeline, self.stops, self.cache_id = pipeline, frozenset(int(i) for i in stop_ids), cache_id
        self.fed = 0

    def turn(self, context: Sequence[int], budget: int) -> tuple[list[int], bool]:
        logits = self.pipeline.next_token_logits(np.asarray([context[self.fed:]], dtype=np.int64), self.cache_id)
        self.fed = len(context)
        ids: list[int] = []
        while True:
            tok = int(np.argmax(logits[0]))
            ids.append(tok)
            if tok in self.stops or len(ids) >= budget:
                return ids, tok in self.stops
            logits = self.pipeline.next_token_logits(np.asarray([[tok]], dtype=np.int64), self.cache_id)
            self.fed += 1

    def close(self) -> None:
        self.pipeline.drop_cache(self.cache_id)


def evaluate_tool_use(pipeline, run_task: "EnvRunTask", n: int, max_new_tokens: int) -> ToolUseFigures:
    """Greedy episodes of the first ``n`` held-out items through the run task's own episode stepping."""
    started = time.perf_counter()
    prompts = run_task.eval_prompts()[:n]
    strict = calls = turns = calling = 0.0
    for i, prompt in enumerate(prompts):
        episode = run_task.open_episode(prompt, max_new_tokens)
        gen = GreedyTurns(pipeline, run_task.stop_ids, f"warmup-eval-{i}")
        try:
            while episode.outcome is None:
                if episode.budget <= 0:
                    episode.cut_full()
                    break
                ids, finished = gen.turn(episode.context_ids, episode.budget)
                episode.step(ids, [0.0] * len(ids), finished)
        finally:
            gen.close()
        out = episode.outcome
        assert out is not None
        strict += out.score.strict
        calls += out.tool_calls
        turns += out.turns
        calling += 1.0 if out.tool_calls > 0 else 0.0
    k = max(len(prompts), 1)
    return ToolUseFigures(episodes=len(prompts), strict=strict / k, tool_calls_per_episode=calls / k,
                          turns_per_episode=turns / k, calling_share=calling / k,
                          seconds=round(time.perf_counter() - started, 2))


def _train(pipeline, rows: list[Trajectory], settings: WarmupSettings, pad_id: int,
           progress: Callable[[str], None]) -> list[float]:
    from engine.rl.sft import sft_token_arrays
    from engine.rl.update import clip_scale

    losses = []
    for step in range(settings.steps):
        batch = rows[step * settings.batch_size:(step + 1) * settings.batch_size]
        arrays = [sft_token_arrays([(t.ids, t.mask) for t in batch[i:i + settings.micro_batch_rows]], pad_id)
                  for i in range(0, len(batch), settings.micro_batch_rows)]
        n = float(sum(m.sum() for _, _, m in arrays))
        pipeline.zero_grad()
        nll = 0.0
        for j, (inputs, targets, mask) in enumerate(arrays):
            key = f"warmup-{step}-{j}"
            logp = pipeline.token_logprobs(inputs, targets, key=key)
            pipeline.backward(key, (mask / -n).astype(np.float32))
            nll += float(-(logp * mask).sum() / n)
        pipeline.step(clip_scale(float(np.sqrt(sum(pipeline.grad_sq_norms()))), settings.max_grad_norm))
        losses.append(round(nll, 4))
        progress(f"warm-up step {step + 1}/{settings.steps}: transcript NLL {nll:.3f}")
    return losses


def write_checkpoint(pipeline, base_dir: Path, out_dir: Path, record: dict[str, Any]) -> None:
    """The pipeline's (single stage, adapters merged) weights as an HF checkpoint directory."""
    from safetensors.numpy import save_file

    from backends.base import StageSpec
    from engine.model.checkpoint import Checkpoint
    from engine.model.importers.output import publish_staged, read_json, staging_dir, write_json
    from engine.model.tensor_names import stage_tensor_shapes

    base = Checkpoint(base_dir)
    whole = StageSpec(0, 1, 0, base.config.num_hidden_layers)
    merged = pipeline.backends[0].merged_state_dict()
    weights = {n: np.ascontiguousarray(merged[n], dtype=np.float32) for n in stage_tensor_shapes(base.config, whole)}
    staging = staging_dir(out_dir)
    try:
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = read_json(base_dir / "config.json")
        config["torch_dtype"] = "float32"
        config.pop("dtype", None)
        write_json(staging / "config.json", config)
        for name in SIDE_FILES:
            if (base_dir / name).exists():
                shutil.copyfile(base_dir / name, staging / name)
        write_json(staging / "polis_model.json", {"name": f"{base_dir.name}-tool-warmup", "kind": "warmup",
                                                  "base": str(base_dir), "warmup_key": record["key"]})
        write_json(staging / RECORD_FILE, record)
        Checkpoint(staging).check_stage(whole)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_staged(staging, out_dir)


def warm_up(base_dir: str | Path, task: TaskConfig, env: EnvSettings, settings: WarmupSettings, out_dir: str | Path,
            *, key: str | None = None, backend: str = "torch", progress: Callable[[str], None] = log.info,
            ) -> WarmupReport:
    """Train the warm-up on ``base_dir`` and write the warmed checkpoint to ``out_dir`` (see the module)."""
    from backends.base import LoraConfig, OptimizerConfig
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.run_task import make_run_task

    started = time.perf_counter()
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    key = key or warmup_key(settings, task, env, weights_sha256(base_dir))
    if not env.name:
        raise ValueError("the tool warm-up needs a run in an environment (env.name, e.g. calculator)")
    from engine.rl.env_run_task import EnvRunTask

    run_task = make_run_task(task, base_dir, env)
    assert isinstance(run_task, EnvRunTask)  # an env.name gives an environment's run task
    rows, skipped = transcript_trajectories(run_task, settings.steps * settings.batch_size, settings.seed)
    without_tool = None
    if settings.eval_items:
        from engine.rl.checkpoint_eval import evaluate_checkpoint

        progress(f"warm-up: scoring the base on {settings.eval_items} held-out questions without the tool...")
        without_tool = evaluate_checkpoint(base_dir, task, n=settings.eval_items, backend=backend,
                                           max_new_tokens=settings.max_new_tokens).to_dict()
    lora = LoraConfig(enabled=True, rank=settings.lora_rank, alpha=settings.lora_alpha)
    pipeline = LocalPipeline.from_checkpoint(base_dir, 1, backend, optimizer=OptimizerConfig(lr=settings.lr, lora=lora))
    try:
        before = after = None
        if settings.eval_items:
            progress(f"warm-up: scoring the base on {settings.eval_items} held-out episodes...")
            before = evaluate_tool_use(pipeline, run_task, settings.eval_items, settings.max_new_tokens)
            progress(f"warm-up: base {before}")
        t0 = time.perf_counter()
        losses = _train(pipeline, rows, settings, run_task.pad_id, progress)
        train_s = round(time.perf_counter() - t0, 2)
        if settings.eval_items:
            after = evaluate_tool_use(pipeline, run_task, settings.eval_items, settings.max_new_tokens)
            progress(f"warm-up: warmed {after}")
        report = WarmupReport(key=key, base_dir=str(base_dir), settings=asdict(settings), steps=settings.steps,
                              transcripts=len(rows), skipped_items=skipped, losses=losses, train_seconds=train_s,
                              seconds=round(time.perf_counter() - started, 2), before=before, after=after,
                              base_without_tool=without_tool)
        write_checkpoint(pipeline, base_dir, out_dir, report.to_dict())
        return report
    finally:
        pipeline.close()


def read_report(out_dir: str | Path) -> WarmupReport | None:
    """The warm-up recorded in ``out_dir``, or None when there is none (or it cannot be read)."""
    path = Path(out_dir) / RECORD_FILE
    try:
        return WarmupReport.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def cached_warm_up(base_dir: str | Path, task: TaskConfig, env: EnvSettings, settings: WarmupSettings,
                   cache_root: str | Path, **kwargs) -> tuple[Path, WarmupReport]:
    """The warmed checkpoint for these inputs under ``cache_root/<key>``: reused when it is there
    (``reused`` set in the report returned), else made now."""
    key = warmup_key(settings, task, env, weights_sha256(base_dir))
    out_dir = Path(cache_root) / key[:24]
    report = read_report(out_dir)
    if report is not None and report.key == key and (out_dir / "model.safetensors").exists():
        return out_dir, WarmupReport.from_dict({**report.to_dict(), "reused": True})
    return out_dir, warm_up(base_dir, task, env, settings, out_dir, key=key, **kwargs)
