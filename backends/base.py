"""The StageBackend protocol: one pipeline stage of a decoder LM on some tensor library.

What this module defines (and nothing else does):

* the **boundary format** — how tensors cross between stages, processes and
  backends: token ids are ``int64`` arrays ``[batch, seq]``; hidden states and
  their gradients are C-contiguous ``float32`` numpy arrays ``[batch, seq, hidden]``;
  logits are ``float32`` ``[batch, seq, vocab]``; per-token log-probabilities are
  ``float32`` ``[batch, seq]``. Every backend converts at its edges with
  :func:`to_boundary` so a torch stage can feed an MLX stage and back.
* the **StageBackend protocol** — synchronous; a backend is created, used and
  closed on one compute thread (MLX streams and CUDA contexts belong to their
  thread). It knows nothing about networking, asyncio or RL.

What it does not know: how stages are scheduled, where activations travel, what
loss is being optimised (the RL objective lives in ``engine.rl`` and hands the
last stage a gradient with respect to its log-probabilities).

Conventions every backend follows:

* Parameter names are the Hugging Face checkpoint names
  (``model.layers.3.self_attn.q_proj.weight``), so weights, gradients and deltas
  mean the same thing on every backend and on the wire.
* The AdamW state (``optimizer_state`` / ``load_optimizer_state``) uses one format,
  keyed by those names (``backends.optimizer_state``), so a run saved on one backend
  resumes on another.
* ``forward`` with ``cache_id`` appends to a per-sequence KV cache owned by the
  backend; positions continue from the cache length. All rows of one cache have
  the same length (a cache holds one group of samples of one prompt), so no
  attention mask is needed. Right-padding in training batches is harmless under
  causal attention; padded positions get zero loss weight from the caller.
* **Shared prefixes.** The G samples of one prompt share its prefill: the caller runs the
  distinct rows once, then ``expand_cache`` copies each cache row to the rows that share it
  (and takes the same rows of the last stage's logits). ``forward(..., last_only=True)`` on
  the last stage projects only each row's last position to the vocabulary: sampling needs
  nothing else, and over a prompt the head is a large part of a real model's prefill.
* **Packed rows.** A training row may hold one prompt once and several completions of it
  (``segments``: per row ``(prefix_len, n_1, ..., n_k)``, or None for a plain causal row):
  the prefix attends causally to itself; token ``i`` of completion ``j`` attends to the whole
  prefix and to completion ``j``'s tokens up to itself, at position ``prefix_len + i``; padding
  after the last completion attends to itself only. ``forward`` and ``token_logprobs`` take it
  (see :func:`segment_layout`); G samples of one prompt then cost the prompt once, not G times.
* ``forward`` with ``key`` (training) keeps what ``backward(key, ...)`` needs; a
  key is consumed by its backward (or released by ``release``). Several keys may be
  in flight at once (pipelined micro-batches).
* **Trainable tensors.** ``state_dict``, ``apply_delta``, ``set_weights``, ``grads``,
  ``set_grads`` and the optimiser state speak of the stage's *trainable* tensors:
  every parameter under full fine-tuning, only the LoRA adapters when
  ``OptimizerConfig.lora`` is enabled (so replicas sync and stream adapters only).
  ``merged_state_dict`` is always the plain HF parameters with adapters folded in.
* **Tied embeddings across stages.** With ``tie_word_embeddings`` and more than one
  stage, stage 0 (embedding) and the last stage (head) each hold a copy of
  ``model.embed_tokens.weight`` and list it in ``tied_names``. Each copy's gradient
  is only its own use; whoever drives the stages keeps the copies identical the way
  Megatron does: once per optimiser step, after the last backward (and after replica
  aggregation), read ``grads(tied_names)`` on both stages, ``set_grads`` the *sum* on
  both, count that tensor once in the global gradient norm, then ``step`` both with
  the same ``grad_scale``. Identical weights, moments and gradients give identical
  updates (bit-identical on one backend; to fp32 rounding between torch and MLX).
  A single stage holding the whole model has nothing shared (autograd sums both uses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

#: dtype of hidden states, their gradients and logits at every stage boundary.
BOUNDARY_FLOAT_DTYPE = np.dtype(np.float32)
#: dtype of token ids at every stage boundary.
BOUNDARY_TOKEN_DTYPE = np.dtype(np.int64)


class BackendError(RuntimeError):
    """A backend could not do what was asked (bad input shape, unknown cache, ...)."""


class BackendUnavailable(BackendError):
    """The backend's library or device is not present on this machine."""


@dataclass(frozen=True)
class StageSpec:
    """Which contiguous slice of the model one stage holds.

    ``layer_start``/``layer_end`` are a half-open range of decoder layer indices.
    Stage 0 owns the token embeddings; the last stage owns the final norm and the
    LM head.
    """

    stage_index: int
    num_stages: int
    layer_start: int
    layer_end: int

    def __post_init__(self) -> None:
        if not 0 <= self.stage_index < self.num_stages:
            raise ValueError(f"stage_index {self.stage_index} not in [0, {self.num_stages})")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"empty or negative layer range [{self.layer_start}, {self.layer_end})")

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def describe(self, total_layers: int) -> str:
        """Human text such as ``layers 4-7 of 8`` (1-based, inclusive)."""
        return f"layers {self.layer_start + 1}-{self.layer_end} of {total_layers}"


#: the linear layers of a decoder layer LoRA may adapt (``self_attn.*`` and ``mlp.*``)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on frozen base weights: ``y = W x + (alpha / rank) * B A x``.

    With ``enabled`` every targeted ``nn.Linear``-like weight ``W [out, in]`` of the
    stage's decoder layers gets ``A [rank, in]`` (uniform in ``+-1/sqrt(in)``, the
    kaiming-uniform bound PEFT uses) and ``B [out, rank]`` (zeros, so an untrained
    adapter computes the base model exactly). The base weights stay frozen: no
    gradients and no optimiser state for them. Dropout is always 0 (the log-probs a
    trainer recomputes must equal those the sampler saw).

    Adapter tensors are named after the weight they adapt, as PEFT saves them:
    ``model.layers.3.self_attn.q_proj.lora_A.weight`` / ``...lora_B.weight``. With
    LoRA on, a stage's ``state_dict``/``grads``/deltas/optimiser state hold only these.
    """

    enabled: bool = False  #: False: full fine-tuning (every parameter trains), the other fields unused
    rank: int = 16  #: r, the inner dimension of ``B A``
    alpha: float = 32.0  #: the update is scaled by ``alpha / rank``
    #: which linear layers of every decoder layer get an adapter (names from ``LORA_TARGETS``)
    target_modules: tuple[str, ...] = LORA_TARGETS
    #: seed of ``A``'s initialisation; with the tensor's name it fixes ``A`` on every backend
    #: and machine, so all replicas of a stage start from the same adapter
    init_seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str) or not isinstance(self.target_modules, tuple):
            raise ValueError(f"target_modules must be a tuple of names, got {self.target_modules!r}")
        if not self.enabled:
            return
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 1 <= self.rank <= 4096:
            raise ValueError(f"LoRA rank must be an integer in [1, 4096], got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA alpha must be a positive finite number, got {self.alpha!r}")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown or not self.target_modules or len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"LoRA target_modules must be distinct names from {', '.join(LORA_TARGETS)}; "
                             f"got {list(self.target_modules)}")

    @property
    def scaling(self) -> float:
        """``alpha / rank``, the factor on ``B A x``."""
        return float(self.alpha) / self.rank


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW settings applied by every backend identically, and what the optimiser trains."""

    lr: float = 1e-3  #: learning rate
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0  #: decoupled weight decay (AdamW)
    #: False: the stage only serves (inference replicas): no optimiser state is allocated
    #: and ``step`` raises BackendError
    trainable: bool = True
    #: LoRA adapters (trained, frozen base) or, when not enabled, full fine-tuning. An
    #: inference-only stage of a LoRA run sets it too: it holds the adapters it serves.
    lora: LoraConfig = LoraConfig()


#: most completions one packed row may hold
MAX_SEGMENTS = 4096
def segment_layout(segments: Sequence[Sequence[int] | None] | None, rows: int,
                   width: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Positions ``int64 [rows, width]`` and the attention mask ``bool [rows, width, width]``
    (True: query may attend to key) of rows laid out as ``segments`` says (see the module
    docstring), or None when every row is a plain causal row (the fast path). ``BackendError``
    for a layout that does not fit the rows."""
    if segments is None or all(seg is None for seg in segments):
        return None
    if len(segments) != rows:
        raise BackendError(f"segments: {len(segments)} layouts for {rows} rows")
    causal = np.tril(np.ones((width, width), dtype=bool))
    positions = np.broadcast_to(np.arange(width, dtype=np.int64), (rows, width)).copy()
    mask = np.broadcast_to(causal, (rows, width, width)).copy()
    for r, seg in enumerate(segments):
        if seg is None:
            continue
        parts = [int(v) for v in seg]
        if not 2 <= len(parts) <= MAX_SEGMENTS + 1 or parts[0] < 0 or min(parts[1:]) < 1 or sum(parts) > width:
            raise BackendError(f"segments of row {r}: need (prefix_len >= 0, n_1 >= 1, ...) within {width} tokens, "
                               f"got {parts[:8]}")
        prefix, row_mask = parts[0], np.eye(width, dtype=bool)
        row_mask[:prefix, :prefix] = causal[:prefix, :prefix]
        start = prefix
        for n in parts[1:]:
            stop = start + n
            row_mask[start:stop, :prefix] = True
            row_mask[start:stop, start:stop] = causal[:n, :n]
            positions[r, start:stop] = np.arange(prefix, prefix + n)
            start = stop
        mask[r] = row_mask
    return positions, mask


#: most rows one cache may be expanded to (a job's rows are bounded far below this on the wire)
MAX_EXPANDED_ROWS = 65536


def check_expand_rows(rows: np.ndarray, batch: int) -> np.ndarray:
    """``rows`` as an ``int64`` index into a cache of ``batch`` rows, or ``BackendError``: a
    non-empty 1-D integer array of at most ``MAX_EXPANDED_ROWS`` entries, each in ``[0, batch)``."""
    index = np.asarray(rows)
    if index.ndim != 1 or index.size == 0 or not np.issubdtype(index.dtype, np.integer):
        raise BackendError(f"expand rows must be a non-empty 1-D integer array, got {index.dtype} {list(index.shape)}")
    if index.size > MAX_EXPANDED_ROWS:
        raise BackendError(f"expand rows: {index.size} rows, at most {MAX_EXPANDED_ROWS}")
    if index.min() < 0 or index.max() >= batch:
        raise BackendError(f"expand rows must index the cache's {batch} rows")
    return np.ascontiguousarray(index, dtype=np.int64)


def to_boundary(array: np.ndarray, *, tokens: bool = False) -> np.ndarray:
    """Return ``array`` in the boundary format (dtype, C order), copying only if needed."""
    dtype = BOUNDARY_TOKEN_DTYPE if tokens else BOUNDARY_FLOAT_DTYPE
    return np.ascontiguousarray(array, dtype=dtype)


@runtime_checkable
class StageBackend(Protocol):
    """One stage of a decoder model on one device. Synchronous; one thread."""

    #: registry name, e.g. ``"torch"`` or ``"mlx"``
    name: str
    #: trainable parameter names another stage of the same model also holds (the tied
    #: embedding on the first and the last stage); ``()`` when nothing is shared, with
    #: one stage, or under LoRA (the embedding is frozen)
    tied_names: tuple[str, ...]
    #: device in words, e.g. ``"cuda:0 (NVIDIA RTX 4090, 24.0 GiB)"`` or ``"cpu"``
    device: str
    spec: StageSpec

    # -- weights -----------------------------------------------------------
    def load(self, spec: StageSpec, weights: Mapping[str, np.ndarray], config: "ModelConfigLike",
             optimizer: OptimizerConfig | None = None) -> None:
        """Build the stage from HF-named fp32/bf16 numpy tensors (only this stage's names)."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """This stage's trainable tensors as fp32 numpy arrays (HF names; adapters only under LoRA)."""

    def merged_state_dict(self) -> dict[str, np.ndarray]:
        """The stage's plain HF parameters, fp32, with any LoRA update ``(alpha/r) B A`` added
        to the weight it adapts (for export; equal to ``state_dict`` without LoRA)."""

    def apply_delta(self, delta: Mapping[str, np.ndarray]) -> None:
        """Add ``delta`` (a subset of parameter names, fp32) to the parameters in place."""

    def set_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters (a subset of names) with ``weights``."""

    # -- forward ---------------------------------------------------------------
    def forward(self, inputs: np.ndarray, *, cache_id: str | None = None,
                key: str | None = None, last_only: bool = False,
                segments: Sequence[Sequence[int] | None] | None = None) -> np.ndarray:
        """Run the stage.

        ``inputs``: token ids ``int64 [B, T]`` on the first stage, else hidden
        ``float32 [B, T, H]``. Returns hidden ``float32 [B, T, H]``, or logits
        ``float32 [B, T, V]`` on the last stage (``[B, 1, V]``, the last position only,
        with ``last_only``; other stages ignore it). ``cache_id`` and ``key`` are
        mutually exclusive; ``last_only`` does not go with ``key``; ``segments`` (packed
        rows, see :func:`segment_layout`) does not go with ``cache_id``.
        """

    def expand_cache(self, cache_id: str, rows: np.ndarray) -> None:
        """Make cache ``cache_id`` hold ``len(rows)`` rows, row ``i`` a copy of its current row
        ``rows[i]`` (``int64 [B']``, see :func:`check_expand_rows`). Unknown caches raise."""

    def drop_cache(self, cache_id: str) -> None:
        """Free a KV cache (unknown ids are ignored)."""

    def token_logprobs(self, inputs: np.ndarray, targets: np.ndarray, *,
                       key: str | None = None, temperature: float = 1.0,
                       segments: Sequence[Sequence[int] | None] | None = None) -> np.ndarray:
        """Last stage only: ``log softmax(logits / temperature)`` gathered at ``targets``.

        ``inputs`` and ``segments`` as for ``forward``; ``targets`` ``int64 [B, T]``. Returns
        ``float32 [B, T]``. With ``key`` the graph is kept and ``backward(key, g)``
        takes ``g = dLoss/dlogprobs`` of the same shape.
        """

    # -- backward / optimiser --------------------------------------------------
    def backward(self, key: str, grad_output: np.ndarray) -> np.ndarray | None:
        """Backpropagate ``grad_output`` (same shape as what the keyed call returned).

        Accumulates parameter gradients; returns the gradient of the stage input
        (``float32 [B, T, H]``), or ``None`` on the first stage (token ids).
        """

    def release(self, key: str) -> None:
        """Forget a training key without backpropagating (e.g. a dead micro-batch)."""

    def grads(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Accumulated gradients of the trainable tensors (all, or only ``names``), fp32, HF
        names (zeros if none yet). Unknown names raise ``BackendError``."""

    def set_grads(self, grads: Mapping[str, np.ndarray]) -> None:
        """Replace accumulated gradients (after replica aggregation)."""

    def zero_grad(self) -> None: ...

    def step(self, grad_scale: float = 1.0) -> None:
        """Multiply gradients by ``grad_scale`` (global-norm clipping), AdamW step, zero grads."""

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The AdamW state (moments and step counts, HF names), in the format of
        ``backends.optimizer_state``, which every backend shares."""

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the AdamW state with one exported by ``optimizer_state`` (any backend).

        Validated whole before anything is applied: unknown or missing keys, wrong shapes,
        non-finite values raise ``BackendError`` and leave the stage unchanged.
        """

    def close(self) -> None:
        """Free device memory. The backend is unusable afterwards."""


class ModelConfigLike(Protocol):
    """The fields of ``engine.model.config.ModelConfig`` a backend reads (read-only: configs are frozen)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def rms_norm_eps(self) -> float: ...

    @property
    def rope_theta(self) -> float: ...

    @property
    def attention_bias(self) -> bool: ...

    @property
    def tie_word_embeddings(self) -> bool: ...


def sample_from_logits(logits: np.ndarray, rng: np.random.Generator, *, temperature: float = 1.0,
                       top_p: float = 1.0, draws: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sample one token per row of ``logits [B, V]``.

    Returns ``(tokens int64 [B], logprobs float32 [B])`` where the log-prob is that
    of the sampled token under ``softmax(logits / temperature)`` *before* top-p
    truncation: this is the behaviour log-prob the trainer recomputes, so the
    importance ratio compares like with like. ``temperature == 0`` is greedy.
    ``draws``: each row's uniform draw ``[B, 1]`` (default: one per row from ``rng``), so that
    a row samples the same token whichever other rows are decoded beside it.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 2:
        raise BackendError(f"logits must be [B, V], got shape {logits.shape}")
    # a real model's vocabulary makes every pass over [B, V] count (49 k x 64 rows each decoding step):
    # exp once, the log-prob of the chosen token only, and a binary search of each row's CDF
    scaled = logits if temperature <= 0.0 else logits / temperature
    shifted = scaled - scaled.max(axis=-1, keepdims=True)
    weights = np.exp(shifted)
    log_total = np.log(weights.sum(axis=-1))
    if temperature <= 0.0:
        tokens = logits.argmax(axis=-1)
    else:
        if top_p < 1.0:
            order = np.argsort(-weights, axis=-1)
            sorted_w = np.take_along_axis(weights, order, axis=-1)
            cum = np.cumsum(sorted_w, axis=-1)
            keep_sorted = cum - sorted_w < top_p * cum[:, -1:]
            keep = np.zeros_like(keep_sorted)
            np.put_along_axis(keep, order, keep_sorted, axis=-1)
            weights = np.where(keep, weights, 0.0)
        cdf = np.cumsum(weights, axis=-1)
        cdf /= cdf[:, -1:]
        u = rng.random((logits.shape[0], 1)) if draws is None else np.asarray(draws, dtype=np.float64)
        tokens = np.array([np.searchsorted(row, draw, side="left") for row, draw in zip(cdf, u[:, 0])],
                          dtype=np.int64)
        tokens = np.minimum(tokens, logits.shape[1] - 1)
    chosen = np.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - log_total
    return tokens.astype(np.int64), chosen.astype(np.float32)
