"""``TorchStage``: the StageBackend protocol (``backends.base``) on PyTorch — CUDA, MPS or CPU.

Device: CUDA if present, else Apple MPS, else CPU, unless ``device`` names one
(``"cpu"``, ``"cuda:1"``, ``"mps"``). Compute is fp32 everywhere. Threads:
``num_threads`` (or the ``POLIS_TORCH_THREADS`` environment variable) caps torch's
intra-op threads for this process; otherwise torch's default is left alone.

What it keeps: the stage's parameters (``backends.torch_model.StageModule``,
HF names), one KV cache per ``cache_id``, one autograd graph per training
``key`` (the input leaf and the output), accumulated gradients and a
``torch.optim.AdamW`` (its moments and per-parameter step counts export and load
in the shared ``backends.optimizer_state`` format). ``load`` copies the given
arrays, so callers may pass a lazy mapping and keep peak memory at the stage's
size plus one tensor.

LoRA (``OptimizerConfig.lora``): PEFT's LoRA layers wrap the targeted linears
(``backends.torch_lora``); the base is frozen (no gradients, no AdamW state) and the
parameters the protocol speaks of are the adapters (``backends.lora`` names).

Conventions shared with the MLX backend: both validate weights with
``backends.stage_layout`` (adapters with ``backends.lora``); ``set_grads`` replaces the named gradients only;
``step`` updates the parameters that have a gradient (none: no-op). Changing
weights does not touch existing KV caches. Unlike MLX (which recomputes at
backward time), autograd needs the weights a keyed forward used: changing them
(``step``/``apply_delta``/``set_weights``) before that key's ``backward`` makes
the backward raise ``BackendError``.

What it does not know: networking, scheduling, the RL objective.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from backends.base import (
    BackendError,
    BackendUnavailable,
    LoraConfig,
    OptimizerConfig,
    StageSpec,
    check_expand_rows,
    segment_layout,
    to_boundary,
)
from backends.lora import adapter_layout, initial_adapters, merge
from backends.optimizer_state import AdamWMoments, pack, unpack
from backends.registry import TORCH_THREADS_ENV
from backends.stage_layout import StageLayout, check_shapes, plan_stage
from backends.torch_model import KVCache, StageModule

log = logging.getLogger(__name__)


def pick_device(device: str | None) -> torch.device:
    """CUDA > MPS > CPU when ``device`` is None; otherwise check the named device exists."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError as exc:
        raise BackendUnavailable(f"unknown torch device '{device}': {exc}") from None
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailable("CUDA was asked for but torch sees no CUDA device")
        if chosen.index is not None and chosen.index >= torch.cuda.device_count():
            raise BackendUnavailable(f"{device} asked for but only {torch.cuda.device_count()} CUDA device(s)")
    elif chosen.type == "mps" and not torch.backends.mps.is_available():
        raise BackendUnavailable("MPS was asked for but this machine has no usable Apple GPU")
    elif chosen.type not in ("cpu", "cuda", "mps"):
        raise BackendUnavailable(f"torch device type '{chosen.type}' is not supported (cpu, cuda, mps)")
    return chosen


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return f"cuda:{index} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"
    if device.type == "mps":
        return "mps (Apple GPU)"
    return "cpu"


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A float32 numpy copy that owns its memory."""
    t = t.detach()
    t = t.clone() if t.device.type == "cpu" else t.cpu()
    return to_boundary(t.float().numpy())


class TorchStage:
    """One pipeline stage on PyTorch. See the module docstring and ``backends.base.StageBackend``."""

    name = "torch"

    def __init__(self, device: str | None = None, num_threads: int | None = None) -> None:
        self._device = pick_device(device)
        self.device = describe_device(self._device)
        if num_threads is None and os.environ.get(TORCH_THREADS_ENV):
            try:
                num_threads = int(os.environ[TORCH_THREADS_ENV])
            except ValueError:
                log.warning("ignoring %s=%r (not an integer)", TORCH_THREADS_ENV, os.environ[TORCH_THREADS_ENV])
        if num_threads is not None:
            if num_threads < 1:
                raise BackendError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        self.spec: StageSpec | None = None
        self.tied_names: tuple[str, ...] = ()
        self._module: StageModule | None = None
        self._params: dict[str, torch.nn.Parameter] = {}  # the trainable tensors: all, or the LoRA adapters
        self._base_params: dict[str, torch.nn.Parameter] = {}  # the HF parameters (frozen under LoRA)
        self._lora = LoraConfig()
        self._optimizer: torch.optim.Optimizer | None = None
        self._caches: dict[str, tuple[KVCache, int]] = {}  # cache_id -> (per-layer k/v, batch size)
        self._keys: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}  # key -> (input leaf, output)
        self._config = None
        self._layout: StageLayout | None = None  # the base parameters
        self._trainable: StageLayout | None = None  # what _params holds (names and shapes)
        self._closed = False

    # -- weights -----------------------------------------------------------------
    def load(self, spec: StageSpec, weights: Mapping[str, np.ndarray], config,
             optimizer: OptimizerConfig | None = None) -> None:
        self._check_open()
        layout = plan_stage(spec, config, weights.keys())
        with torch.device("meta"):
            module = StageModule(config, layout)
        state = {}
        for name in layout.names:  # one tensor at a time: a lazy mapping stays lazy
            state[name] = self._tensor(layout, name, weights[name], "weights")
        module.load_state_dict(state, assign=True, strict=True)
        del state
        opt = optimizer or OptimizerConfig()
        self._lora = opt.lora
        if opt.lora.enabled:
            from backends.torch_lora import attach_lora, base_parameters

            trainable = adapter_layout(layout, opt.lora)
            self._params = attach_lora(module, opt.lora, initial_adapters(layout, opt.lora))
            self._base_params = base_parameters(module)
        else:
            trainable = layout
            self._params = dict(module.named_parameters())
            self._base_params = self._params
        self._layout, self._trainable, self._module = layout, trainable, module
        self.tied_names = trainable.tied_names
        self._config, self.spec = config, spec
        self._optimizer = None
        if opt.trainable:
            self._optimizer = torch.optim.AdamW(list(self._params.values()), lr=opt.lr,
                                                betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                                weight_decay=opt.weight_decay)
        self._caches.clear()
        self._keys.clear()
        log.info("loaded stage %d/%d (%s) on %s: %d tensors, %d trainable%s", spec.stage_index + 1,
                 spec.num_stages, spec.describe(config.num_hidden_layers), self.device, len(layout.names),
                 sum(p.numel() for p in self._params.values()),
                 f" (LoRA rank {opt.lora.rank})" if opt.lora.enabled else "")

    def state_dict(self) -> dict[str, np.ndarray]:
        self._check_loaded()
        return {n: _to_numpy(p) for n, p in self._params.items()}

    def merged_state_dict(self) -> dict[str, np.ndarray]:
        self._check_loaded()
        base = {n: _to_numpy(p) for n, p in self._base_params.items()}
        return merge(base, self.state_dict(), self._lora) if self._lora.enabled else base

    def apply_delta(self, delta: Mapping[str, np.ndarray]) -> None:
        tensors = self._named_tensors(delta, "delta")
        with torch.no_grad():
            for name, t in tensors.items():
                self._params[name].add_(t)

    def set_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        tensors = self._named_tensors(weights, "weights")
        with torch.no_grad():
            for name, t in tensors.items():
                self._params[name].copy_(t)

    # -- forward -------------------------------------------------------------------
    def forward(self, inputs: np.ndarray, *, cache_id: str | None = None, key: str | None = None,
                last_only: bool = False, segments: Sequence[Sequence[int] | None] | None = None) -> np.ndarray:
        self._check_loaded()
        if cache_id is not None and key is not None:
            raise BackendError("forward takes cache_id or key, not both")
        if last_only and key is not None:
            raise BackendError("last_only is for inference: a training forward keeps every position")
        if segments is not None and cache_id is not None:
            raise BackendError("packed rows (segments) are for training passes, not cached decoding")
        x = self._input_tensor(inputs, requires_grad=key is not None)
        layout = self._layout_tensors(segments, x)
        if key is not None:
            self._check_new_key(key)
            with torch.enable_grad():
                out = self._module(x, layout=layout)
            self._keep(key, x, out)
            return _to_numpy(out)
        with torch.no_grad():
            if cache_id is None:
                return _to_numpy(self._module(x, last_only=last_only, layout=layout))
            cache, batch = self._caches.get(cache_id, ({}, x.shape[0]))
            if batch != x.shape[0]:
                raise BackendError(f"cache '{cache_id}' holds {batch} rows, got a batch of {x.shape[0]}")
            start = next(iter(cache.values()))[0].shape[2] if cache else 0  # every layer holds the same length
            out = self._module(x, start_pos=start, cache=cache, last_only=last_only)
            self._caches[cache_id] = (cache, batch)
            return _to_numpy(out)

    def expand_cache(self, cache_id: str, rows: np.ndarray) -> None:
        self._check_loaded()
        if cache_id not in self._caches:
            raise BackendError(f"unknown cache '{cache_id}'")
        cache, batch = self._caches[cache_id]
        index = check_expand_rows(rows, batch)
        picked = torch.from_numpy(index).to(self._device)
        self._caches[cache_id] = ({layer: (k.index_select(0, picked), v.index_select(0, picked))
                                   for layer, (k, v) in cache.items()}, len(index))

    def drop_cache(self, cache_id: str) -> None:
        self._caches.pop(cache_id, None)

    def token_logprobs(self, inputs: np.ndarray, targets: np.ndarray, *, key: str | None = None,
                       temperature: float = 1.0, segments: Sequence[Sequence[int] | None] | None = None
                       ) -> np.ndarray:
        self._check_loaded()
        if not self.spec.is_last:
            raise BackendError("token_logprobs runs on the last stage only")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise BackendError(f"temperature must be a positive finite number, got {temperature!r}")
        x = self._input_tensor(inputs, requires_grad=key is not None)
        tgt = self._token_tensor(targets, "targets")
        if tuple(tgt.shape) != tuple(x.shape[:2]):
            raise BackendError(f"targets shape {list(tgt.shape)} does not match inputs {list(x.shape[:2])}")
        if key is not None:
            self._check_new_key(key)
        layout = self._layout_tensors(segments, x)
        with torch.set_grad_enabled(key is not None):
            logits = self._module(x, layout=layout).float() / temperature
            logp = torch.log_softmax(logits, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        if key is not None:
            self._keep(key, x, logp)
        return _to_numpy(logp)

    # -- backward / optimiser ------------------------------------------------------
    def backward(self, key: str, grad_output: np.ndarray) -> np.ndarray | None:
        self._check_loaded()
        if key not in self._keys:
            raise BackendError(f"unknown training key '{key}' (never forwarded, or already consumed)")
        leaf, out = self._keys[key]
        grad = np.asarray(grad_output)
        if grad.dtype.kind != "f" and grad.dtype.name != "bfloat16":
            raise BackendError(f"grad_output must be floating point, got dtype {grad.dtype}")
        if tuple(grad.shape) != tuple(out.shape):
            raise BackendError(f"grad_output shape {list(grad.shape)} does not match output {list(out.shape)}")
        del self._keys[key]
        try:
            out.backward(torch.tensor(to_boundary(grad), device=self._device))
        except RuntimeError as exc:
            if "modified by an inplace operation" not in str(exc):
                raise
            raise BackendError(f"weights changed between the forward and the backward of key '{key}'") from None
        if leaf is None:
            return None
        return _to_numpy(leaf.grad) if leaf.grad is not None else np.zeros(tuple(leaf.shape), np.float32)

    def release(self, key: str) -> None:
        self._keys.pop(key, None)

    def grads(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        self._check_loaded()
        chosen = list(self._params) if names is None else list(names)
        unknown = [n for n in chosen if n not in self._params]
        if unknown:
            raise BackendError(f"grads: unknown parameter(s) {unknown[:3]} for this stage")
        return {n: _to_numpy(p.grad) if p.grad is not None else np.zeros(tuple(p.shape), np.float32)
                for n, p in ((n, self._params[n]) for n in chosen)}

    def set_grads(self, grads: Mapping[str, np.ndarray]) -> None:
        for name, t in self._named_tensors(grads, "grads").items():
            self._params[name].grad = t

    def zero_grad(self) -> None:
        self._check_loaded()
        for p in self._params.values():
            p.grad = None

    def step(self, grad_scale: float = 1.0) -> None:
        self._check_loaded()
        if not math.isfinite(grad_scale):
            raise BackendError(f"grad_scale must be finite, got {grad_scale!r}")
        if grad_scale != 1.0:
            for p in self._params.values():
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        if self._optimizer is None:
            raise BackendError("this stage was loaded for inference only (no optimiser)")
        self._optimizer.step()
        self.zero_grad()

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """AdamW state in the ``backends.optimizer_state`` format (never-stepped parameters: zeros, step 0)."""
        self._check_loaded()
        if self._optimizer is None:
            raise BackendError("this stage was loaded for inference only (no optimiser state)")
        moments = {}
        for name, p in self._params.items():
            s = self._optimizer.state.get(p)
            if not s:
                zeros = np.zeros(tuple(p.shape), np.float32)
                moments[name] = AdamWMoments(zeros, zeros, 0)
            else:
                moments[name] = AdamWMoments(_to_numpy(s["exp_avg"]), _to_numpy(s["exp_avg_sq"]), int(s["step"]))
        return pack(moments)

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the AdamW state with ``state`` (validated whole first: on error nothing changes)."""
        self._check_loaded()
        if self._optimizer is None:
            raise BackendError("this stage was loaded for inference only (no optimiser state)")
        moments = unpack(state, {n: tuple(p.shape) for n, p in self._params.items()})
        saved = self._optimizer.state_dict()  # param_groups index parameters in the order given to AdamW
        saved["state"] = {i: {"step": torch.tensor(float(m.step)), "exp_avg": torch.from_numpy(m.exp_avg),
                              "exp_avg_sq": torch.from_numpy(m.exp_avg_sq)}
                          for i, m in enumerate(moments[n] for n in self._params)}
        self._optimizer.load_state_dict(saved)  # casts the moments to each parameter's device and dtype

    def close(self) -> None:
        self._caches.clear()
        self._keys.clear()
        self._module, self._params, self._base_params, self._optimizer = None, {}, {}, None
        self._closed = True
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    # -- internals -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("this backend has been closed")

    def _check_loaded(self) -> None:
        self._check_open()
        if self._module is None:
            raise BackendError("no stage loaded yet (call load first)")

    def _check_new_key(self, key: str) -> None:
        if key in self._keys:
            raise BackendError(f"training key '{key}' is already in flight")

    def _keep(self, key: str, leaf: torch.Tensor, out: torch.Tensor) -> None:
        """Remember what ``backward(key)`` needs; the first stage's input (token ids) has no gradient."""
        self._keys[key] = (None if self.spec.is_first else leaf, out)

    def _layout_tensors(self, segments: Sequence[Sequence[int] | None] | None,
                        x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Packed rows' positions and attention mask on this device (None: plain causal rows)."""
        layout = segment_layout(segments, int(x.shape[0]), int(x.shape[1]))
        if layout is None:
            return None
        return torch.from_numpy(layout[0]).to(self._device), torch.from_numpy(layout[1]).to(self._device)

    def _token_tensor(self, array: np.ndarray, what: str) -> torch.Tensor:
        array = np.asarray(array)
        if array.ndim != 2 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
            raise BackendError(f"{what} must be a non-empty integer array [batch, seq], "
                               f"got {array.dtype} {list(array.shape)}")
        vocab = self._config.vocab_size
        if array.min() < 0 or array.max() >= vocab:
            raise BackendError(f"{what} hold ids outside the vocabulary [0, {vocab})")
        return torch.from_numpy(to_boundary(array, tokens=True)).to(self._device)

    def _input_tensor(self, inputs: np.ndarray, requires_grad: bool) -> torch.Tensor:
        if self.spec.is_first:
            return self._token_tensor(inputs, "token ids")
        array = np.asarray(inputs)
        hidden = self._config.hidden_size
        floating = array.dtype.kind == "f" or array.dtype.name == "bfloat16"
        if array.ndim != 3 or array.shape[0] == 0 or array.shape[1] == 0 or array.shape[2] != hidden or not floating:
            raise BackendError(f"hidden states must be float [batch, seq, {hidden}], "
                               f"got {array.dtype} {list(array.shape)}")
        return torch.tensor(to_boundary(array), device=self._device, requires_grad=requires_grad)

    def _named_tensors(self, arrays: Mapping[str, np.ndarray], what: str) -> dict[str, torch.Tensor]:
        """Validate names and shapes of all arrays before any is applied; return device tensors."""
        self._check_loaded()
        return {name: self._tensor(self._trainable, name, array, what) for name, array in arrays.items()}

    def _tensor(self, layout: StageLayout, name: str, array: np.ndarray, what: str) -> torch.Tensor:
        """A float32 copy of one named array on this device, after checking name, shape and dtype."""
        array = np.asarray(array)
        check_shapes(layout, {name: array.shape}, what=what)
        if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
            raise BackendError(f"{what}: '{name}' must be floating point, got dtype {array.dtype}")
        return torch.tensor(np.asarray(array, dtype=np.float32), device=self._device)
