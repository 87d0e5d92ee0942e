"""The settings of one swarm training run, shared by the coordinator and its nodes.

The coordinator owns the run: it builds a :class:`RunConfig` (from flags or its
database), hands it to every node in the ``welcome`` message as a plain dict, and
nodes rebuild it with :func:`run_config_from_dict`, which validates every field
(the dict crossed a network): msgspec checks types (strict: no bool for an int, no
string for a number) and the bounds written in the field types, runs the nested
configs' own checks, and refuses unknown keys at every level. A RunConfig built in
code (``RunConfig(...)``, ``dataclasses.replace``) goes through the same check.
The RL pieces reuse the in-process configs of ``engine.rl`` so the swarm runs the
very same objective, sampling and tasks.

The defaults are the tested recipe of ``engine.rl.recipe`` (the task the shipped base
was warmed up on, its sampling and batch settings), so the swarm and the
in-process trainer learn the same thing the same way. It knows nothing about
sockets or tensors.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Annotated, Any, Literal, Mapping, get_args, get_type_hints

import msgspec
from msgspec import Meta

from backends.base import LORA_TARGETS, LoraConfig
from engine.envs.settings import EnvSettings
from engine.rl.objective import ObjectiveConfig
from engine.rl.recipe import BASE_TASK
from engine.rl.rollout import SamplingConfig
from engine.rl.tasks import TaskConfig

#: activation encodings a run may choose (engine.swarm.pipeline_hops.ACTIVATION_SCHEMES names)
ActivationEncoding = Literal["fp32", "fp16", "bf16", "int8_rowwise", "int8_outliers", "subspace_r8", "subspace_r16",
                             "subspace_r32", "subspace_r64", "subspace_r96", "subspace_r128",
                             "basis_r8", "basis_r16", "basis_r32", "basis_r48", "basis_r64", "basis_r96", "basis_r128",
                             "basis_r8_gs8", "basis_r64_gs64", "basis_r96_gs64", "basis_r96_gs96", "basis_r128_gs64",
                             "basis_r128_gs128", "basis_r96_gs64_b4", "basis_r128_gs64_b4", "basis_r128_gs96_b4",
                             "basis_r96_g8", "basis_r128_g8", "basis_r128_gp", "basis_r128_gp_b4", "basis_r16_b4",
                             "basis_r24_b4", "basis_r32_b4", "predicted_r128_gs64_b4", "coded_s10_gs64_b4",
                             "coded_s20_gs64_b4", "coded_s40_gs64_b4", "predcoded_s20_gs64_b4",
                             "predcoded_s40_gs64_b4"]
ACTIVATION_ENCODINGS = get_args(ActivationEncoding)
#: how replicas exchange gradients (engine.swarm.replica_sync; kept here so configs need no numpy)
UpdateEncoding = Literal["int8", "topk", "fp32"]
UPDATE_ENCODINGS = get_args(UpdateEncoding)
#: when replicas exchange: every optimiser step (gradients) or every H inner steps (pseudo-gradients)
ReplicaSyncMode = Literal["every_step", "diloco"]
REPLICA_SYNC_MODES = get_args(ReplicaSyncMode)

_checking = threading.local()


@dataclass(frozen=True)
class LoraSettings:
    """Low-rank adapters on the frozen base (``backends.base.LoraConfig``), or full fine-tuning.

    Fields:
      enabled: train adapters only (the base stays frozen). Replicas then exchange adapter
        gradients only, the weight stream and stage checkpoints carry adapters only, and the
        tied embedding is frozen (nothing to sum across stages). Off: every parameter trains.
      rank: r, the inner dimension of the adapter ``B A``.
      alpha: the adapter's update is scaled by ``alpha / rank``.
      target_modules: which linear layers of every decoder layer get an adapter (default: all
        of ``q/k/v/o_proj`` and ``gate/up/down_proj``, as "LoRA Without Regret" advises).
      init_seed: seeds ``A`` (with the tensor's name), so every replica starts from the same adapter.
    """

    enabled: bool = False
    rank: Annotated[int, Meta(ge=1, le=4096)] = 16
    alpha: Annotated[float, Meta(gt=0.0, le=1e6)] = 32.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    init_seed: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown:  # checked even while off, so a run that turns LoRA on later cannot fail then
            raise ValueError(f"lora.target_modules: unknown {unknown}; choose from {', '.join(LORA_TARGETS)}")
        self.backend_config()  # the backends' own checks (distinct names, rank, alpha)

    def backend_config(self) -> LoraConfig:
        """The backends' ``LoraConfig`` for these settings."""
        return LoraConfig(enabled=self.enabled, rank=self.rank, alpha=float(self.alpha),
                          target_modules=tuple(self.target_modules), init_seed=self.init_seed)


@dataclass(frozen=True)
class ReplicaSyncSettings:
    """How the replicas of a stage keep their weights together (``engine.swarm.outer_sync``).

    Fields:
      mode: "every_step" (default): every optimiser step the replicas exchange their gradients
        (``RunConfig.update_encoding``) and take one identical step. "diloco": each replica
        takes ``inner_steps`` AdamW steps on its own micro-batches alone (its gradient scaled
        by the number of replicas, an estimate of the whole step's), then the replicas
        exchange pseudo-gradients (weights at the last sync minus now), compressed with error
        feedback, aggregate them robustly (``engine.swarm.replica_sync.aggregate``, the mean)
        and take one identical outer step: after it every replica holds the same bits. A
        policy version still advances per inner step (so rollouts keep their staleness
        accounting and ``max_staleness`` keeps its meaning); replicas agree only at versions
        that are multiples of ``inner_steps``. Between syncs a rollout's version names the
        inner step, and its weights are those of the route that sampled it (route r takes
        replica r of every stage, so a route is one consistent model); the routes differ by
        at most the inner steps since the last sync. Behaviour log-probs are recorded by the
        sampling stage, so the off-policy correction sees the policy that really sampled. A
        row's proximal log-probs and its update run on the route that sampled it (its policy's
        lineage; the log-prob audit still checks it on another route first), so ``u`` measures
        the update alone and ``exp(p - b)`` the staleness alone; a row whose route is gone
        trains where its audit ran, its ``exp(p - b)`` then also spanning the drift between
        replicas (the mask band and the truncation bound it). Inference replicas follow their stage
        leader's weights through the weight stream as before: its inner steps, and the
        synced weights after each sync. Stage checkpoints hold the leader's weights. A
        coordinator refuses it for a tied-embedding model fully fine-tuned across stages
        (:func:`refuse_diloco_split_tied`; with LoRA it trains).
      inner_steps: H, inner steps between syncs (unit: versions). 1 is every step with
        pseudo-gradients.
      outer_lr: step size of the outer update (1.0 with momentum 0: the new weights are the
        last synced ones minus the mean pseudo-gradient, i.e. plain averaging).
      outer_momentum: Nesterov momentum of the outer step (DiLoCo: 0.9 with outer_lr 0.7;
        SparseLoCo: 0, the error-feedback residual acts as the momentum).
      encoding: how pseudo-gradients travel, with error feedback: "topk" (the
        ``topk_fraction`` largest entries per tensor, ``value_bits`` per value, varint index
        gaps), "int8" (every entry, per-row scales) or "fp32" (lossless).
      topk_fraction: share of a tensor's entries sent per sync with "topk" (1.0: every
        entry, no index section: dense ``value_bits`` quantisation with error feedback).
      value_bits: bits per sent value with "topk" (8, 4, 2 or 1; scales per 4096 values).
      value_scale: how "topk" picks each block's scale: "absmax" (the largest value on the
        outermost code, nothing clipped) or "mse" (of that scale and smaller ones, the one
        with the least squared error; what is clipped waits in the error feedback). The
        sender's choice alone: receivers decode both alike.
      error_decay: the residual is multiplied by this before the next pseudo-gradient is
        added (SparseLoCo's beta; 1.0 keeps everything owed).
    """

    mode: ReplicaSyncMode = "every_step"
    inner_steps: Annotated[int, Meta(ge=1, le=100_000)] = 8
    outer_lr: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    outer_momentum: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.0
    encoding: UpdateEncoding = "topk"
    topk_fraction: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.02
    value_bits: Literal[8, 4, 2, 1] = 2
    value_scale: Literal["absmax", "mse"] = "absmax"
    error_decay: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0

    def synced_at(self, version: int) -> bool:
        """Whether every replica of a stage holds the same weights at ``version``."""
        return self.mode == "every_step" or version % self.inner_steps == 0


@dataclass(frozen=True)
class RunConfig:
    """One RL run across the swarm.

    Fields:
      model: the base every stage is cut from. "" (default): the checkpoint each process was
        started with (``--checkpoint``; the shipped tiny base unless given). A name such as
        ``smollm2-135m``: the base imported under that name in each machine's user data dir
        (``<data dir>/models/<name>``: ``polis import smollm2-135m --out`` there; ``polis demo
        --model`` imports it on first use), so every node finds its own copy. Anything with a
        ``/``: that directory, on every machine. A chat task needs a model with a chat template.
      task: which verifiable task, its difficulty and reward (a digit task on the tiny base; a
        chat task, ``reasoning_gym:<dataset>`` with its options, on a real model).
      objective: decoupled-PPO hyper-parameters (engine.rl.objective).
      sampling: temperature / top-p / completion budget (``max_new_tokens``, stop token included)
        for rollouts; evals decode greedily with the same budget.
      group_size: samples per prompt (G).
      prompts_per_step: prompt groups consumed by one optimiser step.
      micro_batch_rows: most samples in one training micro-batch through the pipeline.
      pack_groups: a group trains as one packed row, its prompt computed once for its samples
        (``engine.rl.batch``: a chat prompt is most of a sample's tokens); False: a row per sample.
      updates_per_batch: optimiser steps per batch (its rows split into this many mini-batches);
        with more than one, a forward-only pass first records the proximal log-probs of every
        row under the weights at the start of the batch (decoupled PPO's anchor).
      max_staleness: rollouts more than this many policy versions behind are dropped (unit: versions).
      lora: LoRA adapters (the default of a real model's demo) or full fine-tuning (``LoraSettings``).
      env: the environment episodes run in (``EnvSettings``: none, or calculator with its limits).
      lr: AdamW learning rate on every stage (LoRA wants about 10x the full-fine-tuning rate).
      max_grad_norm: per-stage gradient-norm clip after replica aggregation (0 = off).
      activation_encoding: how activations and their gradients travel between stages (a scheme of
        ``engine.swarm.pipeline_hops.ACTIVATION_SCHEMES``). int8_rowwise (per-row scales) suits the
        tiny base only: a pretrained model's residual stream has massive entries that per-row int8
        crushes the rest under (SmolLM2's greedy answers went from 72 % to 3 %); int8_outliers keeps
        the largest 0.1 % of entries exact (4x fewer bytes than fp32, 2x fewer than bf16; SmolLM2's
        next tokens agree with fp32's); subspace_r<k> sends each tensor's rows as rank-k coefficients
        in a basis that travels with the tensor, plus the exact outliers: SmolLM2's middle boundary
        needs k ~ 128 (~11x fewer bytes than fp32); k = 32 (~37x) broke its answers. basis_r<k>
        sends rank-k coefficients in a basis each stage fits from its first 2048 rows (refitted
        every 64k rows) and sends once per link, plus the exact outliers: no per-tensor basis, so
        decoding steps pay ~k bytes a row; _gs<k> sends the gradients in each tensor's own rank-k
        basis instead (gradients share no fixed subspace), _gs<k>_b4 the same with 4-bit basis and
        coefficient codes, _g8 as int8 rows with exact outliers, _gp as coefficients in the
        activations' own basis (the exact gradient of the rank-k cut); basis_r<k>_b4 sends both ways
        as 4-bit coefficient codes. Measured by ``polis bench act``
        (SmolLM2, 100 items): basis_r128_gs64 18.4x fewer bytes than fp32 over generation + a
        training pass, 0.690 strict against fp32's 0.720; trained 64 versions of the real-model
        recipe through it (``--real-learn-versions``) it learns as fp32 does at 14.6x (small RL
        micro-batches pay for each gradient tensor's basis); basis_r128_gs64_b4 halves that basis:
        17x, within 5 points of fp32 at v64 on three seeds but 5.5-5.9 behind over the curve on two
        (int8_outliers, 3.9x, the real-model default before the predcoded schemes, stays within 1.6
        at every eval; basis_r128_gp, 16.6x, is no better: the rank-128 cut of the activations is
        the cost; predicted_r128_gs64_b4 codes each row less a linear prediction from its token's
        base embedding, which halves the next-token KL but at 16.2-16.3x ends 1.6-4.7 behind at v64
        and 4.7-6.3 behind over the curve, three seeds;
        coded_s<k> / predcoded_s<k> keep every direction of a full-rank basis, each coefficient
        quantised with one step, k/100 of their RMS, and range-coded: predcoded_s20_gs64_b4
        learned within 1 point of fp32 over the curve on three seeds at 11.5-14.1x, and
        predcoded_s40_gs64_b4, the real-model default, within 3.1 at v64 and 1.6 over the curve
        at 18.1-20.5x),
        while basis_r96 and basis_r96_gs64 (18-22x) lag 9-12 points; the tiny base's 64-wide boundary is not
        low-rank (basis_r8 lost learning, basis_r32 is 7.4x; basis_r32_b4 sends 8.5x fewer
        peer-link bytes than fp32 activations but ends 11 points behind, two seeds).
      update_encoding: how replicas exchange gradients, with error feedback: "int8" (every
        entry, per-row scales: ~1/4 of fp32), "topk" (the update_topk_fraction largest
        entries, int8 values: a few % of fp32) or "fp32" (dense, lossless). Measured
        (polis bench swarm, 2 x 2 swarm, equal versions): top-k at 2 % and 10 % learned
        25-30 points slower than the in-process trainer at 480 versions, int8 and fp32 kept
        pace, so int8 is the default and top-k is for links too slow for it.
      update_topk_fraction: share of gradient entries sent each step with "topk".
      replica_sync: every step (gradients, ``update_encoding``) or DiLoCo-style every H inner
        steps (compressed pseudo-gradients, an outer step): ``ReplicaSyncSettings``.
      prompts_per_job: prompts of one token length decoded together in one generation job
        (prompts_per_job x group_size rows share a KV cache; more rows amortise per-step latency).
      generations_in_flight: the most generation jobs kept in flight per pipeline route; below it the
        coordinator keeps as many as Little's law says the route needs, from its nodes' measured link
        RTTs and compute per step (``engine.swarm.inflight``: with 5 ms steps, 5 over a 1 ms link, 36 at 80 ms). The
        replay buffer's cap of two batches still bounds how much is generated ahead. Measured on 2
        cores with a fixed count: 3 -> 8 raised the demo from 672 to 796 versions in 8 minutes.
      microbatch_timeout_s: how long the coordinator waits for one training micro-batch before it
        re-dispatches it on another route and counts a miss against the route's trainers (two
        misses in a row evict a trainer), per micro-batch queued on that route (the k-th gets k
        times this); the coordinator's step deadline still bounds the pass.
      eval_every_versions: greedy held-out eval every this many versions (0 = start/end only).
      checkpoint_every_versions: stage leaders write a stage checkpoint this often.
      max_versions: the run stops training after this version (0 = never).
      seed: seeds the coordinator's prompt stream and the nodes' samplers.

    The bounds are in the field types (``Annotated[..., Meta(...)]``): one place, checked
    on every construction.
    """

    model: Annotated[str, Meta(max_length=1024, pattern=r"^[^\x00-\x1f]*$")] = ""
    task: TaskConfig = field(default_factory=lambda: BASE_TASK)
    objective: ObjectiveConfig = field(default_factory=lambda: ObjectiveConfig(scale_by_std=True))
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.7, max_new_tokens=8))
    group_size: Annotated[int, Meta(ge=2, le=256)] = 16
    prompts_per_step: Annotated[int, Meta(ge=1, le=4096)] = 32
    micro_batch_rows: Annotated[int, Meta(ge=1, le=4096)] = 128
    pack_groups: bool = True
    updates_per_batch: Annotated[int, Meta(ge=1, le=64)] = 4
    max_staleness: Annotated[int, Meta(ge=0, le=1000)] = 4
    lora: LoraSettings = field(default_factory=LoraSettings)
    env: EnvSettings = field(default_factory=EnvSettings)
    # measured in the swarm demo (12.5% -> 100% in 483 s); the in-process recipe uses 2.5e-4
    lr: Annotated[float, Meta(gt=0.0, lt=1.0)] = 3e-4
    max_grad_norm: Annotated[float, Meta(ge=0.0, lt=1e6)] = 1.0
    activation_encoding: ActivationEncoding = "int8_rowwise"
    update_encoding: UpdateEncoding = "int8"
    update_topk_fraction: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.02
    replica_sync: ReplicaSyncSettings = field(default_factory=ReplicaSyncSettings)
    prompts_per_job: Annotated[int, Meta(ge=1, le=256)] = 8
    # two WebRTC hops per token need several jobs to keep both stages busy, more over long links
    generations_in_flight: Annotated[int, Meta(ge=1, le=64)] = 32
    microbatch_timeout_s: Annotated[float, Meta(ge=0.1, le=3600.0)] = 30.0
    eval_every_versions: Annotated[int, Meta(ge=0, le=100_000)] = 20
    checkpoint_every_versions: Annotated[int, Meta(ge=1, le=100_000)] = 5
    max_versions: Annotated[int, Meta(ge=0, le=10**9)] = 0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0

    def __post_init__(self) -> None:
        if getattr(_checking, "active", False):
            return  # this instance is the one msgspec builds while checking another
        _checking.active = True
        try:
            _decode(_plain(self))
        finally:
            _checking.active = False

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


def refuse_diloco_split_tied(run: RunConfig, tied_embeddings: bool, num_stages: int) -> None:
    """Raise ValueError for DiLoCo on a tied-embedding model fully fine-tuned across stages.

    The first and the last stage each hold a copy of the tied matrix and keep them equal by
    exchanging its gradient every step (``engine.swarm.tied_sync``), which assumes every replica
    of a stage holds the same aggregate; under DiLoCo each replica steps on its own rows, so the
    copies would drift apart. With LoRA the matrix is frozen and nothing is exchanged."""
    if run.replica_sync.mode == "diloco" and tied_embeddings and num_stages > 1 and not run.lora.enabled:
        raise ValueError("replica_sync.mode=diloco cannot fully fine-tune a model with tied embeddings split "
                         "across stages (the first and last stage's copies would drift apart); set "
                         "lora.enabled=true, or use replica_sync.mode=every_step")


def _plain(config: RunConfig) -> dict[str, Any]:
    out = asdict(config)
    out["task"]["reward"] = config.task.reward.value
    return out


def _decode(data: dict[str, Any]) -> RunConfig:
    """Typed decode of a plain run-config map. Through JSON on purpose: msgspec writes NaN
    and inf as null, which no float field accepts, so non-finite values are refused at every
    level (the nested engine.rl configs have unbounded floats)."""
    try:
        return msgspec.json.decode(msgspec.json.encode(data), type=RunConfig)
    except (msgspec.ValidationError, msgspec.EncodeError) as exc:
        raise ValueError(f"run config: {exc}") from None


def _refuse_unknown(data: Any, cls: type, what: str) -> None:
    """msgspec ignores unknown keys of dataclasses: refuse them here, at every level."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be an object")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ValueError(f"{what}: unknown fields {unknown}")
    hints = get_type_hints(cls)
    for name, value in data.items():
        if is_dataclass(hints[name]):
            _refuse_unknown(value, hints[name], name)


def run_config_from_dict(data: Any) -> RunConfig:
    """Rebuild and validate a RunConfig that crossed the network (raises ValueError)."""
    if not isinstance(data, Mapping):
        raise ValueError("run config must be an object")
    _refuse_unknown(data, RunConfig, "run")
    return _decode(dict(data))


def apply_overrides(config: RunConfig, assignments: list[str]) -> RunConfig:
    """``["lr=0.001", "task.max_digits=5", "objective.decoupled=false"]`` applied to ``config`` (validated)."""
    data = config.to_dict()
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        target = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if not isinstance(target.get(part), dict):
                raise ValueError(f"unknown setting {key!r}")
            target = target[part]
        if parts[-1] not in target:
            raise ValueError(f"unknown setting {key!r}")
        old = target[parts[-1]]
        raw = raw.strip()
        if isinstance(old, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{key} must be true or false")
            value: Any = raw.lower() in ("true", "1")
        elif isinstance(old, int):
            value = int(raw)
        elif isinstance(old, float):
            value = float(raw)
        elif isinstance(old, (dict, list)):  # e.g. task.options={"min_terms": 2, "max_terms": 2}
            try:
                value = json.loads(raw)
            except ValueError:
                raise ValueError(f"{key} must be JSON, e.g. {key}={{\"min_terms\": 2}}") from None
        else:
            value = raw
        target[parts[-1]] = value
    return run_config_from_dict(data)
