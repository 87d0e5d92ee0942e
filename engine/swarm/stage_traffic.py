"""What each stage's nodes upload per optimiser step, by role: the swarm's bytes model.

One policy version (one optimiser step) of a run with S stages moves, per stage boundary:

* **activations forward** (stage s to s + 1, every stage but the last):
  generation prefills each distinct prompt once (``prompts / version x prompt tokens``) and
  then sends one row-token per decoded token (``rows / version x (new tokens - 1)``);
  training sends every row-token of every trained row (``rows / version x (prompt + new
  tokens)``), twice when a batch has several updates (the proximal pass first);
* **gradients back** (stage s to s - 1, every stage but the first): one row-token per
  trained row-token;
* **tokens back** (the last stage to stage 0): each sampled token's id and log-prob (8 bytes);
* **replica updates** (every trainer of a stage, to each other trainer of it): the stage's
  trainable parameters in the run's update encoding, every step (or every H steps with
  DiLoCo, at its encoding);
* the weight stream to inference replicas is not modelled (their leader streams deltas).

``rows / version = prompts_per_step x group_size / updates_per_batch``. A row-token costs
``ACTIVATION_BYTES`` of the run's encoding (per hidden unit and per row, an estimate: rank-k
schemes send about k bytes a row). A node carrying a share ``f`` of its stage's work (routes
are weighted by measured throughput, equal shares when equally fast) with ``k`` trainers on
the stage uploads ``f x (boundary bytes of its stage) + (k - 1) x (replica update bytes)``
per version (:meth:`StageTraffic.upload_bytes`). On the tiny base (hidden 64, int8 rows,
2 stages): ~0.45 MB/version from stage 0 (activations) against ~0.2 MB from stage 1
(gradients): the last stage is where a slow uplink hurts least.

What it does not know: nodes, links, measured rates (see ``engine.swarm.bandwidth_placement``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from engine.model.config import ModelConfig
from engine.swarm.pipeline_hops import scheme_of
from engine.swarm.run_config import ReplicaSyncSettings, RunConfig

#: bytes of one sampled token going back to stage 0 (its id and behaviour log-prob)
TOKEN_BYTES = 8
#: bytes on the wire per row of a plain encoding: (per hidden unit, per row)
_PLAIN = {"fp32": (4.0, 0.0), "fp16": (2.0, 0.0), "bf16": (2.0, 0.0), "int8_rowwise": (1.0, 4.0),
          "int8_outliers": (1.006, 4.0)}
#: how much more a coded basis's RL traffic costs than held-out greedy rows (measured on SmolLM2-135M)
_RL_TRAFFIC_FACTOR = 2.0
#: bytes per parameter of a replica update (int8: per-row scales are negligible; top-k: value + index)
_UPDATE_BYTES = {"int8": 1.0, "fp32": 4.0}


def row_bytes(encoding: str, hidden_size: int) -> tuple[float, float]:
    """Estimated wire bytes of one row-token's activations and of its gradient under ``encoding``."""
    if encoding in _PLAIN:
        per_unit, per_row = _PLAIN[encoding]
        size = per_unit * hidden_size + per_row
        return size, size
    # subspace / basis schemes: about rank x code bits / 8 coefficient bytes and a scale a row (and
    # a token id with a predicted scheme), coded ones what their step costs a row;
    # a rank of 0 (int8 rows with exact outliers) is the whole width at a byte
    scheme = scheme_of(encoding)
    return (_coefficient_row_bytes(scheme.params, hidden_size),
            _coefficient_row_bytes(scheme.grad_params, hidden_size))


def _coefficient_row_bytes(params: dict, hidden_size: int) -> float:
    token_id = 2.0 if params.get("predict") else 0.0  # a token-predicted row carries its token's id
    if "step" in params:  # range-coded: the bits follow the data, not a rank
        return hidden_size * _coded_bits_per_entry(float(params["step"]), bool(params.get("predict"))) / 8 + token_id
    rank = min(int(params.get("rank", 0)), hidden_size) or hidden_size
    return rank * int(params.get("code_bits", 8)) / 8 + 4.0 + token_id


def _coded_bits_per_entry(step: float, predict: bool) -> float:
    """Bits per entry of a coded basis with ``step`` in RL traffic: SmolLM2-135M's layer-15 rows
    with their outliers cost 1.86 / 1.35 / 0.98 bits at steps 0.1 / 0.2 / 0.4 on held-out greedy
    completions (a token prediction first: 1.01 / 0.69 at 0.2 / 0.4, a 0.75 factor); sampled RL
    rows, which spread wider than the calibration rows, cost ~2x that over a 64-version learning
    run (predcoded at 0.4: 110 bytes a row of activations, its basis included). Another model's
    rows will differ: an estimate for placement."""
    return _RL_TRAFFIC_FACTOR * 1.35 * (0.2 / step) ** 0.46 * (0.75 if predict else 1.0)


def _diloco_bytes_per_parameter(sync: ReplicaSyncSettings) -> float:
    """Bytes per trainable parameter of one DiLoCo sync (top-k: values, and varint index gaps of
    a byte, two below 1/128 of the entries; every entry: values only)."""
    if sync.encoding != "topk":
        return _UPDATE_BYTES[sync.encoding]
    index = 0.0 if sync.topk_fraction == 1.0 else (1.0 if sync.topk_fraction >= 1 / 128 else 2.0)
    return sync.topk_fraction * (sync.value_bits / 8 + index)


def trainable_parameters(model: ModelConfig, run: RunConfig, stage: int, layers: Sequence[int]) -> int:
    """Parameters stage ``stage`` trains (its layers; the embedding on the first, head and norm on the last)."""
    h, q = model.hidden_size, model.num_attention_heads * model.head_dim
    kv = model.num_key_value_heads * model.head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, model.intermediate_size), "up_proj": (h, model.intermediate_size),
              "down_proj": (model.intermediate_size, h)}
    if run.lora.enabled:
        r = run.lora.rank
        return layers[stage] * sum(r * (shapes[m][0] + shapes[m][1]) for m in run.lora.target_modules)
    layer = sum(a * b for a, b in shapes.values()) + 2 * h + (q + 2 * kv if model.attention_bias else 0)
    total = layers[stage] * layer
    if stage == 0:
        total += model.vocab_size * h
    if stage == len(layers) - 1:
        total += h + (model.vocab_size * h if not model.tie_word_embeddings or len(layers) > 1 else 0)
    return total


@dataclass(frozen=True)
class StageTraffic:
    """Bytes per policy version of each stage, by role (see the module docstring)."""

    activations_forward: tuple[float, ...]  #: per stage: to the next stage (0 for the last)
    gradients_back: tuple[float, ...]  #: per stage: to the previous stage (0 for the first)
    tokens_back: tuple[float, ...]  #: per stage: sampled tokens to stage 0 (the last stage only)
    replica_update: tuple[float, ...]  #: per stage: one trainer's update to one other trainer

    @property
    def num_stages(self) -> int:
        return len(self.activations_forward)

    def boundary_bytes(self, stage: int) -> float:
        """Bytes a stage sends to its neighbours per version, whoever carries them."""
        return self.activations_forward[stage] + self.gradients_back[stage] + self.tokens_back[stage]

    def upload_bytes(self, stage: int, trainers: int, share: float | None = None) -> float:
        """Bytes per version one trainer of ``stage`` uploads with ``trainers`` on it (``share`` of its
        work; default an equal share)."""
        trainers = max(1, trainers)
        share = 1.0 / trainers if share is None else share
        return share * self.boundary_bytes(stage) + (trainers - 1) * self.replica_update[stage]

    def snapshot(self) -> list[dict[str, float]]:
        """Per stage, for the stats API (bytes per version)."""
        return [{"stage": s, "activations_forward_bytes": round(self.activations_forward[s]),
                 "gradients_back_bytes": round(self.gradients_back[s]), "tokens_back_bytes": round(self.tokens_back[s]),
                 "replica_update_bytes": round(self.replica_update[s])} for s in range(self.num_stages)]


def stage_traffic(run: RunConfig, model: ModelConfig, stage_layers: Sequence[int],
                  prompt_tokens: float) -> StageTraffic:
    """The bytes model of ``run`` on ``model`` cut into ``stage_layers`` (``prompt_tokens``: a prompt's mean)."""
    stages = len(stage_layers)
    act, grad = row_bytes(run.activation_encoding, model.hidden_size)
    rows = run.prompts_per_step * run.group_size / run.updates_per_batch
    prompts = run.prompts_per_step / run.updates_per_batch
    new = run.sampling.max_new_tokens
    seq = prompt_tokens + new
    passes = 2 if run.updates_per_batch > 1 else 1
    forward = act * (prompts * prompt_tokens + rows * max(0, new - 1) + passes * rows * seq)
    back = grad * rows * seq
    sync = run.replica_sync
    if sync.mode == "diloco":
        per_param = _diloco_bytes_per_parameter(sync) / sync.inner_steps
    elif run.update_encoding == "topk":
        per_param = run.update_topk_fraction * (1 + 4)
    else:
        per_param = _UPDATE_BYTES[run.update_encoding]
    return StageTraffic(
        activations_forward=tuple(forward if s < stages - 1 else 0.0 for s in range(stages)),
        gradients_back=tuple(back if s > 0 else 0.0 for s in range(stages)),
        tokens_back=tuple(rows * new * TOKEN_BYTES if s == stages - 1 and stages > 1 else 0.0 for s in range(stages)),
        replica_update=tuple(per_param * trainable_parameters(model, run, s, stage_layers) for s in range(stages)))


def mean_prompt_tokens(lengths: Iterable[int], default: float = 16.0) -> float:
    """The mean of some prompts' token counts (``default`` when there are none)."""
    counts = list(lengths)
    return sum(counts) / len(counts) if counts else default
