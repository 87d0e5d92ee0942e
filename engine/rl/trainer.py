"""The RL loop in one process: sample groups, score, drop stale, advantages, update, evaluate.

One ``Trainer.step()``: generate a batch of groups with the current policy, push it into a
``LaggedQueue`` and train on the batch that comes out — the one generated ``lag_versions``
optimiser steps ago (``0`` = synchronous). That is an honest in-process simulation of an
asynchronous system whose generators run ``k`` versions ahead: the very same weights the
samples came from are gone by the time they are trained on.

The update: ``engine.rl.update.plan_update`` (the planner the swarm uses too) drops stale
groups, computes the advantages, skips zero-variance groups and splits the rest into
``updates_per_batch`` mini-batches of whole groups; each gets one optimiser step here
(micro-batched rows, token-level normalisation over the mini-batch, per-stage clipping). The
proximal log-probs are those of the weights at the start
of the batch (with a single update, the keyed forward itself provides them). Each step
records a ``StepLog``: reward, masked fraction, ESS of the importance weights, staleness
histogram, dropped and zero-variance counts, an entropy estimate.

Prompts, prompt ids, stop ids, rewards and held-out scores all come from the run's
``engine.rl.run_task.RunTask`` — the object the swarm's coordinator samples and scores with —
so a digit task on the character-level base and a chat task (``reasoning_gym:<dataset>``) on a
real model with a chat template (``ChatCodec``) go through one rollout and scoring path, the
swarm's. Digit tasks draw prompts from ``prompt_rng`` (saved and restored with the run); chat
tasks from the task's seeded training stream (``train_prompts(seed)``, never a held-out item),
which a restored run starts again from its beginning.

What it does not know: transports (it talks to a ``StagePipeline``), tensor libraries.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from engine.rl.batch import TrainBatch
from engine.rl.codec import ChatCodec, TaskCodec
from engine.rl.evaluation import evaluate_run_task
from engine.rl.objective import ObjectiveConfig, compute_objective
from engine.rl.pipeline import StagePipeline
from engine.rl.rollout import Group, SamplingConfig, generate_groups
from engine.rl.run_state import restore_run, save_run
from engine.rl.run_task import DigitRunTask, run_task_for_codec
from engine.rl.staleness import LaggedQueue
from engine.rl.step_log import EvalLog, StepLog
from engine.rl.tasks import TaskConfig
from engine.rl.update import UpdateRules, plan_update

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerConfig:
    """Everything that defines a run. Validated on construction.

    Fields:
      task / objective / sampling: see their own configs.
      prompts_per_step: prompts per batch (each sampled ``group_size`` times).
      group_size: G, samples per prompt.
      lag_versions: k; a batch is trained on k optimiser steps after the policy that
        generated it (0 = synchronous on-policy). A multiple of ``updates_per_batch``.
      max_staleness: groups more than this many versions behind the trainer are dropped.
      max_grad_norm: L2 clip of each stage's gradient on its own (0 disables clipping; see
        ``engine.rl.update`` for why per stage).
      micro_batch_rows: samples per keyed forward/backward (a packed row holds a group's).
      updates_per_batch: optimiser steps per batch (its groups split into this many
        mini-batches; the proximal policy is the one at the start of the first).
      pack_groups: each group trains as one packed row, its prompt computed once (``engine.rl.batch``).
      eval_every_steps: greedy eval on the held-out split every this many steps (0 = only when asked).
      shuffle_rewards: negative control: permute rewards across all samples of a batch.
      seed: seeds prompt choice, sampling and the control's shuffling.
    """

    task: TaskConfig = field(default_factory=TaskConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompts_per_step: int = 16
    group_size: int = 8
    lag_versions: int = 0
    max_staleness: int = 4
    max_grad_norm: float = 1.0
    micro_batch_rows: int = 256
    updates_per_batch: int = 1
    eval_every_steps: int = 10
    shuffle_rewards: bool = False
    seed: int = 0
    pack_groups: bool = True

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1 or self.group_size < 2:
            raise ValueError("need prompts_per_step >= 1 and group_size >= 2")
        if self.lag_versions < 0 or self.max_staleness < 0:
            raise ValueError("lag_versions and max_staleness must be >= 0")
        if self.updates_per_batch < 1:
            raise ValueError("updates_per_batch must be >= 1")
        if self.lag_versions % self.updates_per_batch:
            raise ValueError(f"lag_versions ({self.lag_versions}) must be a multiple of "
                             f"updates_per_batch ({self.updates_per_batch})")
        if self.max_grad_norm < 0 or self.micro_batch_rows < 1 or self.eval_every_steps < 0:
            raise ValueError("max_grad_norm >= 0, micro_batch_rows >= 1 and eval_every_steps >= 0 required")
        if self.sampling.temperature <= 0:
            raise ValueError("RL sampling needs temperature > 0 (greedy samples have no log-prob to correct)")

    def update_rules(self) -> UpdateRules:
        """The planner's rules for this run (``engine.rl.update``)."""
        return UpdateRules(objective=self.objective, max_staleness=self.max_staleness,
                           updates_per_batch=self.updates_per_batch, max_grad_norm=self.max_grad_norm,
                           pack_groups=self.pack_groups)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["task"]["reward"] = self.task.reward.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainerConfig":
        d = dict(d)
        return cls(task=TaskConfig(**d.pop("task")), objective=ObjectiveConfig(**d.pop("objective")),
                   sampling=SamplingConfig(**d.pop("sampling")), **d)


class Trainer:
    """Runs RL on ``pipeline`` for ``config``. ``reference`` (frozen base) is needed for KL."""

    def __init__(self, pipeline: StagePipeline, codec: TaskCodec | ChatCodec, config: TrainerConfig, *,
                 reference: StagePipeline | None = None) -> None:
        if config.objective.kl_coef > 0 and reference is None:
            raise ValueError("kl_coef > 0 needs a reference pipeline")
        self.pipeline, self.codec, self.config, self.reference = pipeline, codec, config, reference
        #: what happens to sampled groups before they are queued (the swarm's ingestion checks, in
        #: ``polis bench trust``); None: every group is queued as sampled
        self.ingest: Callable[[list[Group]], list[Group]] | None = None
        self.rules = config.update_rules()
        self.run_task = run_task_for_codec(config.task, codec)  # raises CodecError when they do not fit
        if isinstance(self.run_task, DigitRunTask):
            digits = self.run_task
            missing = set(digits.task.alphabet) - set(digits.codec.char_to_id)
            if missing:
                raise ValueError(f"the tokenizer lacks characters {''.join(sorted(missing))!r} of task {digits.name}")
        self._train_keys = self.run_task.train_prompts(config.seed)
        self.prompt_rng = np.random.default_rng([config.seed, 1])
        self.sample_rng = np.random.default_rng([config.seed, 2])
        self.shuffle_rng = np.random.default_rng([config.seed, 3])
        self.queue: LaggedQueue[list[Group]] = LaggedQueue(config.lag_versions // config.updates_per_batch)
        self.step_count = 0
        self.steps: list[StepLog] = []
        self.evals: list[EvalLog] = []
        self._eval_prompts = self.run_task.eval_prompts()

    # -- rollouts ---------------------------------------------------------------------
    def next_prompts(self) -> list[str]:
        """The next ``prompts_per_step`` training prompt keys (never a held-out one)."""
        n = self.config.prompts_per_step
        if not isinstance(self.run_task, DigitRunTask):
            return [next(self._train_keys) for _ in range(n)]
        task = self.run_task.task
        prompts: list[str] = []
        while len(prompts) < n:
            p = task.random_prompt(self.prompt_rng)
            if not task.is_held_out(p):
                prompts.append(p)
        return prompts

    def sample(self, prompts: list[str]) -> list[Group]:
        """``group_size`` unscored samples of each prompt key from the current policy (the run task's
        prompt ids and stop ids, the run's sampling settings)."""
        task = self.run_task
        return generate_groups(self.pipeline, prompts, [task.prompt_ids(p) for p in prompts],
                               self.config.group_size, self.config.sampling, task.stop_ids, self.sample_rng)

    def generate(self) -> list[Group]:
        """A scored batch of groups from the current policy."""
        task = self.run_task
        groups = self.sample(self.next_prompts())
        for g in groups:
            for s in g.samples:
                s.reward = task.reward(g.prompt, [int(t) for t in s.completion_ids])
        return groups

    # -- one step -----------------------------------------------------------------------
    def step(self) -> StepLog:
        t0 = time.perf_counter()
        groups = self.generate()
        self.queue.push(self.ingest(groups) if self.ingest is not None else groups)
        t1 = time.perf_counter()
        batch = self.queue.pop_ready()
        self.step_count += 1
        log_ = StepLog(step=self.step_count, versions=self.pipeline.versions(), trained=False,
                       generate_s=t1 - t0)
        if batch is not None:
            self.train_on(batch, log_)
        log_.versions = self.pipeline.versions()
        log_.train_s = time.perf_counter() - t1
        self.steps.append(log_)
        log.debug("step %d v%s reward %.3f masked %.3f ess %.3f stale %s dropped %d zero-var %.2f entropy %.3f",
                  log_.step, log_.versions, log_.reward_mean, log_.masked_fraction, log_.ess,
                  log_.staleness_histogram, log_.dropped_stale, log_.zero_variance_fraction, log_.entropy_proxy)
        every = self.config.eval_every_steps
        if every and self.step_count % every == 0:
            self.evaluate()
        return log_

    def train_on(self, groups: list[Group], out: StepLog) -> None:
        """Train on one batch of scored groups (one or more optimiser steps), recording into ``out``."""
        cfg = self.config
        samples = [s for g in groups for s in g.samples]
        out.groups = len(groups)
        out.reward_mean = float(np.mean([s.reward for s in samples]))
        score = self.run_task.eval_score
        out.exact_fraction = float(np.mean([score(g.prompt, [int(t) for t in s.completion_ids]).strict
                                            for g in groups for s in g.samples]))
        out.finished_fraction = float(np.mean([s.finished for s in samples]))
        out.completion_tokens_mean = float(np.mean([len(s.completion_ids) for s in samples]))
        out.entropy_proxy = float(-np.mean(np.concatenate([s.behaviour_logprobs for s in samples])))

        plan = plan_update(groups, self.pipeline.versions(), self.rules, self.run_task.pad_id,
                           shuffle_rng=self.shuffle_rng if cfg.shuffle_rewards else None)
        out.staleness_histogram, out.dropped_stale = plan.staleness_histogram, plan.dropped_stale
        out.zero_variance_fraction = plan.zero_variance_fraction
        batches = plan.minibatches
        # With one update the proximal policy is the current one (taken from the keyed pass);
        # with several it is computed for every mini-batch before the first step.
        proximal: list[np.ndarray | None] = [None] * len(batches)
        if len(batches) > 1:
            proximal = [self._logprobs(b) for b in batches]
        for i, (batch, prox) in enumerate(zip(batches, proximal)):
            self._update(batch, out, prox, index=i)

    def _logprobs(self, batch: TrainBatch) -> np.ndarray:
        """Unkeyed log-probs of ``batch``'s targets under the current weights."""
        rows = batch.rows_for_samples(self.config.micro_batch_rows)
        return np.concatenate([
            self.pipeline.token_logprobs(batch.inputs[s:s + rows], batch.targets[s:s + rows],
                                         temperature=self.config.sampling.temperature,
                                         segments=None if batch.segments is None else batch.segments[s:s + rows])
            for s in range(0, batch.num_rows, rows)], axis=0)

    def _update(self, batch: TrainBatch, out: StepLog, proximal: np.ndarray | None, index: int) -> None:
        """One optimiser step on ``batch`` (micro-batched), folding its stats into ``out``."""
        cfg = self.config
        n_tokens = batch.num_tokens
        out.trained_samples += batch.num_samples
        totals = dict(masked=0.0, clipped=0.0, ess=0.0, weight=0.0, kl=0.0)
        self.pipeline.zero_grad()
        loss = 0.0
        per_mb = batch.rows_for_samples(cfg.micro_batch_rows)
        for start in range(0, batch.num_rows, per_mb):
            rows = slice(start, start + per_mb)
            inputs, targets = batch.inputs[rows], batch.targets[rows]
            segments = None if batch.segments is None else batch.segments[rows]
            key = f"rl-{self.step_count}-{index}-{start}"
            logp = self.pipeline.token_logprobs(inputs, targets, key=key, temperature=cfg.sampling.temperature,
                                                segments=segments)
            ref = None
            if self.reference is not None:
                ref = self.reference.token_logprobs(inputs, targets, temperature=cfg.sampling.temperature,
                                                    segments=segments)
            prox = logp if proximal is None else proximal[rows]
            result = compute_objective(logp, prox, batch.behaviour[rows], batch.advantages[rows], batch.mask[rows],
                                       cfg.objective, ref_logp=ref, normaliser=n_tokens)
            self.pipeline.backward(key, result.grad)
            loss += result.loss
            share = result.stats.num_tokens / n_tokens
            for name, value in (("masked", result.stats.masked_fraction), ("clipped", result.stats.clipped_fraction),
                                ("ess", result.stats.ess), ("weight", result.stats.mean_weight),
                                ("kl", result.stats.kl)):
                totals[name] += share * value
        sq_norms = self.pipeline.grad_sq_norms()
        norm = float(np.sqrt(sum(sq_norms)))
        self.pipeline.step(self.rules.stage_clip_scales(sq_norms, self.pipeline.clip_units()))
        k = index + 1  # running mean over the updates of this batch
        out.trained = True
        out.loss += (loss - out.loss) / k
        out.grad_norm += (norm - out.grad_norm) / k
        out.masked_fraction += (totals["masked"] - out.masked_fraction) / k
        out.clipped_fraction += (totals["clipped"] - out.clipped_fraction) / k
        out.ess += (totals["ess"] - out.ess) / k
        out.mean_weight += (totals["weight"] - out.mean_weight) / k
        out.kl += (totals["kl"] - out.kl) / k

    # -- persistence ----------------------------------------------------------------------
    def save(self, run_dir) -> None:
        """Checkpoint the learning state (see ``engine.rl.run_state``)."""
        save_run(run_dir, self)

    def restore(self, run_dir) -> None:
        """Continue from a state saved by ``save`` (same config, same stage layout)."""
        restore_run(run_dir, self)

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(self) -> EvalLog:
        """Greedy decoding on the held-out split, scored by the run task; recorded in ``self.evals``."""
        r = evaluate_run_task(self.pipeline, self.run_task, self.config.sampling.max_new_tokens, self._eval_prompts)
        result = EvalLog(step=self.step_count, versions=self.pipeline.versions(), exact_match=r.exact_match,
                         mean_reward=r.mean_reward, seconds=r.seconds, content=r.content)
        self.evals.append(result)
        log.info("eval at step %d: strict %.3f content %s reward %.3f", result.step, result.exact_match,
                 "-" if r.content is None else f"{r.content:.3f}", result.mean_reward)
        return result
