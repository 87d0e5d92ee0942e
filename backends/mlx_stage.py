"""``MLXStage``: the StageBackend protocol on Apple's MLX (Metal on Apple silicon, CPU elsewhere).

It owns one stage's parameters (HF names, fp32), its per-sequence KV caches, the
inputs kept for pending training keys, accumulated gradients and an AdamW
optimiser (``mlx.optimizers.AdamW`` with bias correction, the same update as
``torch.optim.AdamW``). Its state exports and loads in the shared
``backends.optimizer_state`` format; MLX keeps one step count for the whole stage
(not one per parameter), so every exported ``.step`` is that count and a loaded
state must give all parameters the same step. MLX builds no stored autograd graph,
so a keyed forward keeps its inputs and a reference to the parameter arrays it
used; ``backward`` recomputes the stage under ``mx.vjp`` against exactly those arrays.

LoRA (``OptimizerConfig.lora``): the base parameters are kept apart, frozen (no
gradients, no optimiser state); the trainable parameters the protocol speaks of are
the adapters (``backends.lora``), which ``backends.mlx_decoder`` adds to their weights.

Threading: the backend runs on the MLX stream of the thread that constructs it
and refuses calls from any other thread (MLX streams belong to their thread).
Everything is evaluated (``mx.eval``) before a method returns, so all work
happens on that thread. Every array crossing the boundary goes through
``backends.base.to_boundary``.

What it does not know: the maths of the decoder (``backends.mlx_decoder``),
which tensors a stage holds (``backends.stage_layout``), networking, RL.
"""

from __future__ import annotations

import logging
import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from backends.base import (
    BackendError,
    BackendUnavailable,
    LoraConfig,
    ModelConfigLike,
    OptimizerConfig,
    StageSpec,
    check_expand_rows,
    segment_layout,
    to_boundary,
)
from backends.lora import adapter_layout, initial_adapters, merge
from backends.mlx_decoder import LayerKV, PackedLayout, StageDims, gather_logprobs, rope_periods, stage_forward
from backends.optimizer_state import AdamWMoments, pack, unpack
from backends.stage_layout import StageLayout, check_shapes, plan_stage

log = logging.getLogger(__name__)


@dataclass
class _KVCache:
    batch: int
    length: int
    layers: list[LayerKV]


@dataclass
class _Pending:
    """What ``backward(key)`` needs: the forward's inputs and the parameter arrays it used."""

    params: dict[str, mx.array]
    inputs: mx.array
    out_shape: tuple[int, ...]
    targets: mx.array | None = None  #: set for token_logprobs keys
    temperature: float = 1.0
    layout: PackedLayout | None = None  #: packed rows' positions and mask (``segments``)


def _resolve_device(device: str | None) -> mx.Device:
    gpu_ok = mx.is_available(mx.gpu)
    if device is None or device.lower() == "auto":
        return mx.gpu if gpu_ok else mx.cpu
    name = device.lower()
    if name == "cpu":
        return mx.cpu
    if name in ("gpu", "metal", "mps") or name.startswith("gpu:"):
        if not gpu_ok:
            raise BackendUnavailable("MLX has no GPU on this machine (Metal needs Apple silicon); use device 'cpu'")
        return mx.gpu
    raise BackendUnavailable(f"MLX cannot use device {device!r} (choose 'cpu' or 'gpu')")


def _describe_device(device: mx.Device) -> str:
    kind = "gpu" if device == mx.gpu else "cpu"
    try:
        info = mx.device_info(device)
    except Exception:  # older MLX or a backend without device info
        return kind
    parts = [str(info[k]) for k in ("device_name",) if info.get(k)] or \
        [str(info[k]) for k in ("architecture",) if info.get(k)]
    memory = info.get("memory_size") or info.get("total_memory")
    if kind == "gpu" and isinstance(memory, int) and memory > 0:
        parts.append(f"{memory / 2 ** 30:.1f} GiB")
    return f"{kind} ({', '.join(parts)})" if parts else kind


def _as_float32(name: str, array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
        raise BackendError(f"{name}: expected a floating-point array, got dtype {array.dtype}")
    return to_boundary(array)


class MLXStage:
    """One decoder stage on MLX. Create, use and close it on one thread."""

    name = "mlx"

    def __init__(self, device: str | None = None) -> None:
        self._mx_device = _resolve_device(device)
        # the creating thread's own default stream: usable only here, and shared by every
        # backend of this thread (a new stream per backend would cost an OS thread each)
        self._stream = mx.default_stream(self._mx_device)
        self._thread = threading.get_ident()
        self.device = _describe_device(self._mx_device)
        self.spec: StageSpec | None = None
        self._closed = False
        self._reset()

    def _reset(self) -> None:
        self._layout: StageLayout | None = None
        self._trainable: StageLayout | None = None  # names and shapes of _params
        self._dims: StageDims | None = None
        self._vocab_size = 0
        self._lora = LoraConfig()
        self.tied_names: tuple[str, ...] = ()
        self._params: dict[str, mx.array] = {}  # the trainable tensors: all, or the LoRA adapters
        self._frozen: dict[str, mx.array] = {}  # the base parameters under LoRA (else empty)
        self._grads: dict[str, mx.array] = {}
        self._caches: dict[str, _KVCache] = {}
        self._pending: dict[str, _Pending] = {}
        self._optimizer: optim.AdamW | None = None

    # -- plumbing --------------------------------------------------------------
    @contextmanager
    def _on_stream(self, *, loaded: bool = True) -> Iterator[None]:
        if self._closed:
            raise BackendError("this MLX stage is closed")
        if threading.get_ident() != self._thread:
            raise BackendError("MLXStage called from a thread other than the one that created it "
                               "(MLX streams belong to their thread)")
        if loaded and self._dims is None:
            raise BackendError("no stage loaded: call load() first")
        with mx.stream(self._stream):
            yield

    def _stage_input(self, inputs: np.ndarray) -> mx.array:
        array = np.asarray(inputs)
        if self._dims.is_first:
            if array.ndim != 2 or array.dtype.kind not in "iu" or 0 in array.shape:
                raise BackendError(f"first stage expects int token ids [B, T], got {array.dtype} {array.shape}")
            if array.min() < 0 or array.max() >= self._vocab_size:
                raise BackendError(f"token ids must lie in [0, {self._vocab_size})")
            return mx.array(to_boundary(array, tokens=True).astype(np.int32))
        hidden = self._dims.hidden_size
        if array.ndim != 3 or array.shape[-1] != hidden or 0 in array.shape:
            raise BackendError(f"expected hidden states [B, T, {hidden}], got shape {array.shape}")
        return mx.array(_as_float32("hidden states", array))

    def _check_new_key(self, key: str) -> None:
        if key in self._pending:
            raise BackendError(f"training key {key!r} is already in flight")

    # -- weights ---------------------------------------------------------------
    def load(self, spec: StageSpec, weights: Mapping[str, np.ndarray], config: ModelConfigLike,
             optimizer: OptimizerConfig | None = None) -> None:
        with self._on_stream(loaded=False):
            layout = plan_stage(spec, config, weights.keys())
            params: dict[str, mx.array] = {}
            for name in layout.names:  # one tensor at a time: peak memory ~ the stage plus one tensor
                array = _as_float32(name, weights[name])
                check_shapes(layout, {name: array.shape})
                params[name] = mx.array(array)
                mx.eval(params[name])
                del array
            self._reset()
            opt = optimizer or OptimizerConfig()
            self.spec = spec
            self._layout, self._lora = layout, opt.lora
            self._trainable = adapter_layout(layout, opt.lora) if opt.lora.enabled else layout
            self.tied_names = self._trainable.tied_names
            self._dims = StageDims.from_layout(layout, config, opt.lora.scaling if opt.lora.enabled else 0.0)
            self._vocab_size = config.vocab_size
            if opt.lora.enabled:
                self._frozen = params
                self._params = {n: mx.array(v) for n, v in initial_adapters(layout, opt.lora).items()}
                mx.eval(self._params)
            else:
                self._params = params
            self._optimizer = None
            if opt.trainable:
                self._optimizer = optim.AdamW(learning_rate=opt.lr, betas=[opt.beta1, opt.beta2], eps=opt.eps,
                                              weight_decay=opt.weight_decay, bias_correction=True)
                self._optimizer.init(self._params)
                mx.eval(self._params, self._optimizer.state)
            log.info("loaded %s on mlx %s: %d tensors, %d parameters", spec.describe(config.num_hidden_layers),
                     self.device, len(params), sum(a.size for a in params.values()))

    def state_dict(self) -> dict[str, np.ndarray]:
        with self._on_stream():
            return {n: to_boundary(np.array(p)) for n, p in self._params.items()}

    def merged_state_dict(self) -> dict[str, np.ndarray]:
        with self._on_stream():
            if not self._lora.enabled:
                return self.state_dict()
            base = {n: to_boundary(np.array(p)) for n, p in self._frozen.items()}
            return merge(base, self.state_dict(), self._lora)

    def _all_params(self, trainable: Mapping[str, mx.array] | None = None) -> dict[str, mx.array]:
        """What the decoder maths reads: the frozen base (under LoRA) and the trainable tensors."""
        return {**self._frozen, **(self._params if trainable is None else trainable)}

    def _checked(self, tensors: Mapping[str, np.ndarray], what: str) -> dict[str, mx.array]:
        arrays = {n: _as_float32(f"{what} {n}", a) for n, a in tensors.items()}
        check_shapes(self._trainable, {n: a.shape for n, a in arrays.items()}, what=what)
        return {n: mx.array(a) for n, a in arrays.items()}

    def apply_delta(self, delta: Mapping[str, np.ndarray]) -> None:
        with self._on_stream():
            for name, value in self._checked(delta, "delta").items():
                self._params[name] = self._params[name] + value
            mx.eval(self._params)

    def set_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        with self._on_stream():
            self._params.update(self._checked(weights, "weights"))
            mx.eval(self._params)

    # -- forward ---------------------------------------------------------------
    def forward(self, inputs: np.ndarray, *, cache_id: str | None = None,
                key: str | None = None, last_only: bool = False,
                segments: Sequence[Sequence[int] | None] | None = None) -> np.ndarray:
        if cache_id is not None and key is not None:
            raise BackendError("forward takes cache_id or key, not both")
        if last_only and key is not None:
            raise BackendError("last_only is for inference: a training forward keeps every position")
        if segments is not None and cache_id is not None:
            raise BackendError("packed rows (segments) are for training passes, not cached decoding")
        with self._on_stream():
            x = self._stage_input(inputs)
            if cache_id is not None:
                return to_boundary(np.array(self._cached_forward(x, cache_id, last_only)))
            if key is not None:
                self._check_new_key(key)
            layout = self._packed(segments, x)
            out, _ = stage_forward(self._all_params(), x, self._dims, last_only=last_only, layout=layout)
            mx.eval(out)
            if key is not None:
                self._pending[key] = _Pending(params=dict(self._params), inputs=x, out_shape=tuple(out.shape),
                                              layout=layout)
            return to_boundary(np.array(out))

    def _packed(self, segments: Sequence[Sequence[int] | None] | None, x: mx.array) -> PackedLayout | None:
        layout = segment_layout(segments, int(x.shape[0]), int(x.shape[1]))
        if layout is None:
            return None
        return PackedLayout.build(*layout, rope_periods(self._dims.head_dim, self._dims.rope_theta))

    def _cached_forward(self, x: mx.array, cache_id: str, last_only: bool) -> mx.array:
        cache = self._caches.get(cache_id)
        if cache is not None and cache.batch != x.shape[0]:
            raise BackendError(f"cache {cache_id!r} holds {cache.batch} rows, got a batch of {x.shape[0]}")
        offset = 0 if cache is None else cache.length
        out, present = stage_forward(self._all_params(), x, self._dims, offset=offset,
                                     past=None if cache is None else cache.layers, last_only=last_only)
        mx.eval(out, present)
        self._caches[cache_id] = _KVCache(batch=x.shape[0], length=offset + x.shape[1], layers=present)
        return out

    def expand_cache(self, cache_id: str, rows: np.ndarray) -> None:
        with self._on_stream():
            cache = self._caches.get(cache_id)
            if cache is None:
                raise BackendError(f"unknown cache {cache_id!r}")
            index = mx.array(check_expand_rows(rows, cache.batch).astype(np.int32))
            layers = [(mx.take(k, index, axis=0), mx.take(v, index, axis=0)) for k, v in cache.layers]
            mx.eval(layers)
            self._caches[cache_id] = _KVCache(batch=int(index.shape[0]), length=cache.length, layers=layers)

    def drop_cache(self, cache_id: str) -> None:
        with self._on_stream(loaded=False):
            self._caches.pop(cache_id, None)

    def token_logprobs(self, inputs: np.ndarray, targets: np.ndarray, *,
                       key: str | None = None, temperature: float = 1.0,
                       segments: Sequence[Sequence[int] | None] | None = None) -> np.ndarray:
        with self._on_stream():
            if not self._dims.is_last:
                raise BackendError("token_logprobs is only available on the last stage")
            if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
                raise BackendError(f"temperature must be a positive finite number, got {temperature!r}")
            x = self._stage_input(inputs)
            tgt = np.asarray(targets)
            if tgt.shape != tuple(x.shape[:2]) or tgt.dtype.kind not in "iu":
                raise BackendError(f"targets must be int [B, T] = {tuple(x.shape[:2])}, got {tgt.dtype} {tgt.shape}")
            if tgt.min() < 0 or tgt.max() >= self._vocab_size:
                raise BackendError(f"target ids must lie in [0, {self._vocab_size})")
            if key is not None:
                self._check_new_key(key)
            tgt_mx = mx.array(to_boundary(tgt, tokens=True).astype(np.int32))
            layout = self._packed(segments, x)
            logits, _ = stage_forward(self._all_params(), x, self._dims, layout=layout)
            logprobs = gather_logprobs(logits, tgt_mx, float(temperature))
            mx.eval(logprobs)
            if key is not None:
                self._pending[key] = _Pending(params=dict(self._params), inputs=x, out_shape=tuple(logprobs.shape),
                                              targets=tgt_mx, temperature=float(temperature), layout=layout)
            return to_boundary(np.array(logprobs))

    # -- backward / optimiser ----------------------------------------------------
    def backward(self, key: str, grad_output: np.ndarray) -> np.ndarray | None:
        with self._on_stream():
            pending = self._pending.get(key)
            if pending is None:
                raise BackendError(f"unknown training key {key!r} (never forwarded, or already consumed)")
            grad = np.asarray(grad_output)
            if grad.shape != pending.out_shape:
                raise BackendError(f"grad_output for {key!r} has shape {grad.shape}, expected {pending.out_shape}")
            cotangent = mx.array(_as_float32("grad_output", grad))
            del self._pending[key]
            names = list(pending.params)
            dims = self._dims

            def run(*arrays: mx.array) -> mx.array:
                if dims.is_first:
                    x, values = pending.inputs, arrays
                else:
                    x, values = arrays[0], arrays[1:]
                out, _ = stage_forward(self._all_params(dict(zip(names, values))), x, dims, layout=pending.layout)
                if pending.targets is not None:
                    out = gather_logprobs(out, pending.targets, pending.temperature)
                return out

            primals = [pending.params[n] for n in names]
            if not dims.is_first:
                primals.insert(0, pending.inputs)
            _, vjps = mx.vjp(run, primals, [cotangent])
            param_grads = vjps if dims.is_first else vjps[1:]
            for name, g in zip(names, param_grads):
                previous = self._grads.get(name)
                self._grads[name] = g if previous is None else previous + g
            input_grad = None if dims.is_first else vjps[0]
            mx.eval(self._grads, *([] if input_grad is None else [input_grad]))
            return None if input_grad is None else to_boundary(np.array(input_grad))

    def release(self, key: str) -> None:
        with self._on_stream(loaded=False):
            self._pending.pop(key, None)

    def grads(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        with self._on_stream():
            chosen = list(self._params) if names is None else list(names)
            unknown = [n for n in chosen if n not in self._params]
            if unknown:
                raise BackendError(f"grads: unknown parameter(s) {unknown[:3]} for this stage")
            out = {}
            for name in chosen:
                param, g = self._params[name], self._grads.get(name)
                out[name] = np.zeros(param.shape, np.float32) if g is None else to_boundary(np.array(g))
            return out

    def set_grads(self, grads: Mapping[str, np.ndarray]) -> None:
        with self._on_stream():
            self._grads.update(self._checked(grads, "grads"))
            mx.eval(self._grads)

    def zero_grad(self) -> None:
        with self._on_stream(loaded=False):
            self._grads = {}

    def step(self, grad_scale: float = 1.0) -> None:
        """AdamW on every parameter that has a gradient, after scaling by ``grad_scale``; zero grads.

        With no gradients at all this is a no-op (like torch, which skips
        parameters whose ``.grad`` is None).
        """
        with self._on_stream():
            if not math.isfinite(grad_scale):
                raise BackendError(f"grad_scale must be finite, got {grad_scale!r}")
            if self._optimizer is None:
                raise BackendError("this stage was loaded for inference only (no optimiser)")
            if not self._grads:
                log.debug("step() with no gradients: nothing to do")
                return
            scaled = self._grads if grad_scale == 1.0 else {n: g * grad_scale for n, g in self._grads.items()}
            self._params.update(self._optimizer.apply_gradients(scaled, self._params))
            mx.eval(self._params, self._optimizer.state)
            self._grads = {}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """AdamW state in the ``backends.optimizer_state`` format; every ``.step`` is the stage's step count."""
        with self._on_stream():
            if self._optimizer is None:
                raise BackendError("this stage was loaded for inference only (no optimiser state)")
            state = self._optimizer.state
            step = int(state["step"].item())
            return pack({n: AdamWMoments(to_boundary(np.array(state[n]["m"])), to_boundary(np.array(state[n]["v"])),
                                         step) for n in self._params})

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the AdamW state with ``state`` (validated whole first: on error nothing changes)."""
        with self._on_stream():
            if self._optimizer is None:
                raise BackendError("this stage was loaded for inference only (no optimiser state)")
            moments = unpack(state, {n: tuple(p.shape) for n, p in self._params.items()})
            steps = {m.step for m in moments.values()}
            if len(steps) > 1:
                raise BackendError(f"optimizer state: MLX keeps one step count per stage, got steps {sorted(steps)}")
            opt_state = self._optimizer.state
            for name, m in moments.items():
                opt_state[name] = {"m": mx.array(m.exp_avg), "v": mx.array(m.exp_avg_sq)}
            opt_state["step"] = mx.array(steps.pop() if steps else 0, mx.uint64)
            mx.eval(opt_state)

    def close(self) -> None:
        if self._closed:
            return
        if threading.get_ident() != self._thread:
            raise BackendError("MLXStage.close() called from a thread other than the one that created it")
        self._reset()
        self._closed = True
        mx.clear_cache()
