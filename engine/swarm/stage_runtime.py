"""What a node's compute thread does with its stage: generate, train, step, save.

A :class:`StageRuntime` wraps one ``StageBackend`` and is used only from the
node's compute thread (``engine.swarm.compute_thread``): every method is
synchronous and may take a while. It runs the same RL pieces as the in-process
trainer — ``backends.base.sample_from_logits`` for sampling with behaviour
log-probs, ``engine.rl.objective.compute_objective`` for the loss gradient on
the last stage — so the swarm learns with the very same maths.

It knows nothing about links, messages or the coordinator; inputs arrive as
validated numpy arrays and outputs leave as numpy arrays.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from backends import registry
from backends.base import OptimizerConfig, StageBackend, StageSpec, sample_from_logits
from engine.atomic_file import atomic_write_bytes
from engine.model.content_hash import METADATA_KEY, tensors_sha256
from engine.rl.objective import ObjectiveConfig, compute_objective
from engine.rl.update import clip_scale

if TYPE_CHECKING:
    from engine.model.config import ModelConfig

#: packed rows' layouts of a training micro-batch (``backends.base.segment_layout``), or None
Segments = Sequence[Sequence[int] | None] | None

log = logging.getLogger(__name__)


def optimizer_path(stage_file: str | Path) -> Path:
    """Where :meth:`StageRuntime.save_stage` keeps the optimiser state of ``stage_file``."""
    stage_file = Path(stage_file)
    return stage_file.with_name(stage_file.stem + ".optimizer.safetensors")


class StageRuntime:
    """One stage on this machine. Create, use and close on one thread."""

    def __init__(self, backend_name: str = "auto", device: str | None = None, cpu_threads: int | None = None):
        self.backend_name = backend_name
        self.device = device
        self.cpu_threads = cpu_threads
        self.backend: StageBackend | None = None
        self.spec: StageSpec | None = None
        self.model_config: Any = None
        self.optimizer: OptimizerConfig | None = None  #: the loaded stage's (for what save_stage records)
        self.base_dir: str | None = None  #: the base checkpoint the stage was cut from, when loaded from one
        self.version = 0
        #: whether the last :meth:`apply` skipped a non-finite aggregate (weights kept)
        self.last_step_skipped = False
        # Create the backend now: it detects the device (for the user) and is reused by the first load.
        self._fresh: StageBackend | None = self._create()
        self.device_description = self._fresh.device
        self.backend_name = self._fresh.name

    # -- loading --------------------------------------------------------------
    def _create(self) -> StageBackend:
        if self.cpu_threads:
            # read by the torch backend when it is created; harmless elsewhere
            os.environ["POLIS_TORCH_THREADS"] = str(self.cpu_threads)
        return registry.create(self.backend_name, device=self.device)

    def _new_backend(self) -> StageBackend:
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        if self._fresh is not None:
            fresh, self._fresh = self._fresh, None
            return fresh
        return self._create()

    def load_checkpoint(self, base_dir: str | Path, spec: StageSpec, optimizer: OptimizerConfig,
                        stage_file: str | Path | None = None, version: int | None = 0) -> None:
        """Load ``spec`` from the base checkpoint, then overlay a saved stage file if given.

        ``version``: the version to serve as; None = what the files hold (the stage file's
        version, else 0 for the base), for nodes whose rollouts must carry the true version.
        A version above 0 needs a stage file of exactly that version whose content hash
        checks out: base weights (or another version's) are never served labelled as it, so
        a missing, older or corrupt file raises ``ValueError``.
        """
        from engine.model.checkpoint import Checkpoint

        checkpoint = Checkpoint(base_dir)
        backend = self._new_backend()
        backend.load(spec, checkpoint.stage_weights(spec), checkpoint.config, optimizer)
        self.backend, self.spec, self.model_config = backend, spec, checkpoint.config
        self.optimizer, self.base_dir = optimizer, str(Path(base_dir).resolve())
        self.version = version or 0
        if version and (stage_file is None or not Path(stage_file).exists()):
            raise ValueError(f"the run is at version {version} but no checkpoint of it is on this machine "
                             f"({stage_file or 'none named'}); base weights would be mislabelled")
        if stage_file is not None:
            if Path(stage_file).exists():
                found = self.load_stage_file(stage_file)
                if version is None:
                    self.version = found
                elif version and found != version:
                    raise ValueError(f"stage checkpoint {stage_file} holds version {found}, not the run's {version}")
            else:
                log.warning("stage checkpoint %s is not on this machine; starting from the base weights", stage_file)

    def load_weights(self, spec: StageSpec, config_dict: Mapping[str, Any], weights: Mapping[str, np.ndarray],
                     optimizer: OptimizerConfig, version: int) -> None:
        """Build ``spec`` from weights received from a replica (no local checkpoint needed)."""
        from engine.model.config import ModelConfig

        self._install(spec, weights, ModelConfig.from_dict(config_dict, source="a replica's config"), optimizer,
                      version)

    def _install(self, spec: StageSpec, weights: Mapping[str, np.ndarray], config: ModelConfig,
                 optimizer: OptimizerConfig, version: int) -> None:
        """A new backend holding ``weights`` of ``spec`` with ``optimizer``, served as ``version``."""
        backend = self._new_backend()
        backend.load(spec, weights, config, optimizer)
        self.backend, self.spec, self.model_config = backend, spec, config
        self.optimizer = optimizer
        self.version = version

    def reload(self, optimizer: OptimizerConfig) -> None:
        """The loaded stage rebuilt with ``optimizer`` (an inference replica told to train): the same
        weights and version, fresh optimiser moments; under LoRA the frozen base again from its files."""
        weights, version, spec, config = self.state_dict(), self.version, self.spec, self.model_config
        if spec is None:
            raise RuntimeError("no stage loaded")
        if optimizer.lora.enabled:
            if self.base_dir is None:
                raise RuntimeError("a LoRA stage reloads its frozen base from files, and it was not loaded from any")
            self.load_checkpoint(self.base_dir, spec, optimizer, None, 0)
            self.set_weights(weights, version)
            return
        self._install(spec, weights, config, optimizer, version)

    @property
    def hidden_size(self) -> int:
        return int(self.model_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model_config.vocab_size)

    def _b(self) -> StageBackend:
        if self.backend is None:
            raise RuntimeError("no stage loaded")
        return self.backend

    # -- generation -------------------------------------------------------------
    def gen_forward(self, job: str, x: np.ndarray, expand: np.ndarray | None = None,
                    keep: np.ndarray | None = None) -> np.ndarray:
        """A generation step of ``job``; with ``expand``, ``x`` holds a prefill's distinct rows and
        the cache then holds the job's rows (row i a copy of ``x`` row ``expand[i]``); with ``keep``
        the cache first keeps only those rows (rows that finished are not computed any more)."""
        if keep is not None:
            self._b().expand_cache(job, keep)
        out = self._b().forward(x, cache_id=job)
        if expand is not None:
            self._b().expand_cache(job, expand)
        return out

    def gen_sample(self, job: str, x: np.ndarray, *, temperature: float, top_p: float,
                   seed: int, step: int, expand: np.ndarray | None = None, keep: np.ndarray | None = None,
                   job_rows: np.ndarray | None = None, of_rows: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Last stage: run the step, sample one token per row; returns (tokens, behaviour logprobs).

        Step ``step`` of a job draws one uniform per job row from ``(seed, step)``; ``job_rows``: the
        job row of each row computed (rows that finished were dropped), of ``of_rows`` in all."""
        if keep is not None:
            self._b().expand_cache(job, keep)
        logits = self._b().forward(x, cache_id=job, last_only=True)[:, -1, :]
        if expand is not None:
            self._b().expand_cache(job, expand)
            logits = logits[expand]
        rng = np.random.default_rng([seed, step])
        draws = None if job_rows is None else rng.random((of_rows, 1))[job_rows]
        return sample_from_logits(logits, rng, temperature=temperature, top_p=top_p, draws=draws)

    def drop(self, job: str) -> None:
        self._b().drop_cache(job)

    # -- training ---------------------------------------------------------------
    def train_forward(self, key: str, x: np.ndarray, segments: Segments = None) -> np.ndarray:
        """A training forward that keeps what backward needs (``segments``: packed rows)."""
        return self._b().forward(x, key=key, segments=segments)

    def forward_only(self, x: np.ndarray, segments: Segments = None) -> np.ndarray:
        """A forward pass that keeps nothing (proximal log-prob passes)."""
        return self._b().forward(x, segments=segments)

    def prox_logprobs(self, x: np.ndarray, targets: np.ndarray, temperature: float,
                      segments: Segments = None) -> np.ndarray:
        """Last stage: log-probs of ``targets`` under the current weights, nothing kept."""
        return self._b().token_logprobs(x, targets, temperature=temperature, segments=segments)

    def train_last(self, key: str, x: np.ndarray, targets: np.ndarray, mask: np.ndarray, behaviour: np.ndarray,
                   advantages: np.ndarray, normaliser: float, objective: ObjectiveConfig,
                   temperature: float, proximal: np.ndarray | None = None,
                   segments: Segments = None) -> tuple[np.ndarray | None, dict[str, float]]:
        """Last stage: log-probs, the decoupled objective's gradient, backward. Returns (input grad, stats).

        ``proximal``: log-probs under the weights at the start of the batch (recorded by a
        forward-only pass when a batch gets several updates); without it the batch gets one
        update, so the proximal policy is the current weights and ``p`` is these very log-probs.
        """
        backend = self._b()
        logp = backend.token_logprobs(x, targets, key=key, temperature=temperature, segments=segments)
        anchor = logp.copy() if proximal is None else proximal
        result = compute_objective(logp, anchor, behaviour, advantages, mask, objective, normaliser=normaliser)
        grad_in = backend.backward(key, result.grad)
        stats = {"loss": result.loss, "tokens": result.stats.num_tokens,
                 "masked_fraction": result.stats.masked_fraction, "ess": result.stats.ess,
                 "clipped_fraction": result.stats.clipped_fraction}
        return grad_in, stats

    def train_backward(self, key: str, grad: np.ndarray) -> np.ndarray | None:
        return self._b().backward(key, grad)

    def release(self, key: str) -> None:
        if self.backend is not None:
            self.backend.release(key)

    def grads(self) -> dict[str, np.ndarray]:
        return self._b().grads()

    @property
    def tied_names(self) -> tuple[str, ...]:
        """Trainable tensors another stage holds a copy of (the tied embedding), or ()."""
        return tuple(self.backend.tied_names) if self.backend is not None else ()

    def zero_grad(self) -> None:
        self._b().zero_grad()

    def apply(self, aggregated: Mapping[str, np.ndarray], max_grad_norm: float, version: int,
              unit_norm: float | None = None) -> float:
        """Install the aggregated gradient, clip its norm (the planner's per-stage rule,
        :func:`engine.rl.update.clip_scale`), AdamW step; returns the pre-clip norm.
        ``unit_norm``: the norm of the clipping unit this stage belongs to instead of its own
        (the first and last stage of a tied model, ``engine.swarm.tied_sync``).

        A non-finite aggregate (an overflowing or poisoned share) is not applied: the
        weights stay as they are, the step is logged as skipped and 0.0 is returned;
        every replica aggregates the same shares, so all of them skip it alike
        (``last_step_skipped`` says which happened)."""
        backend = self._b()
        norm = float(np.sqrt(sum(float(np.square(g, dtype=np.float64).sum()) for g in aggregated.values()))) \
            if unit_norm is None else float(unit_norm)
        if not math.isfinite(norm):
            log.warning("stage %d: aggregated gradient of version %d is not finite; step skipped, weights kept",
                        self.spec.stage_index if self.spec else -1, version)
            backend.zero_grad()
            self.version = version
            self.last_step_skipped = True
            return 0.0
        self.last_step_skipped = False
        backend.set_grads(aggregated)
        backend.step(clip_scale(norm, max_grad_norm))
        self.version = version
        return norm

    # -- weights ------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        return self._b().state_dict()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(a.shape) for name, a in self.state_dict().items()}

    def set_weights(self, weights: Mapping[str, np.ndarray], version: int) -> None:
        self._b().set_weights(weights)
        self.version = version

    def snapshot(self) -> tuple[dict[str, np.ndarray], int]:
        """The weights and the version they are, read together (nothing can step in between)."""
        return self.state_dict(), self.version

    def snapshot_with_moments(self) -> tuple[dict[str, np.ndarray], int, dict[str, np.ndarray]]:
        """The weights, their version and the AdamW state (``backends.optimizer_state`` format),
        read together: a trainer that installs all three takes the very step its source takes next."""
        return self.state_dict(), self.version, self._b().optimizer_state()

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the AdamW state (validated whole by the backend first: on error nothing changes)."""
        self._b().load_optimizer_state(state)

    def checksum(self) -> float:
        """A cheap fingerprint of the weights: replicas that agree have equal checksums."""
        from engine.swarm.tensor_bundle import checksum

        return checksum(self.state_dict())

    def save_stage(self, path: str | Path, version: int) -> None:
        """Write this stage's weights + version, and next to them its optimiser state
        (``optimizer_path``), each atomically: a stage restored from them continues with
        its AdamW moments instead of restarting them. The weights file's metadata also
        carries their content hash (``engine.model.content_hash``) and, for a LoRA stage,
        the adapter settings, which ``polis export`` checks and needs."""
        from safetensors.numpy import save

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(optimizer_path(path), save(
            {k: np.ascontiguousarray(v) for k, v in self._b().optimizer_state().items()},
            metadata={"polis_version": str(version)}))
        weights = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in self.state_dict().items()}
        # the content hash lets `polis export` prove these are the weights saved for this version
        atomic_write_bytes(path, save(weights, metadata={
            "polis_version": str(version), "stage": json.dumps(self.spec.__dict__),
            METADATA_KEY: tensors_sha256(weights), "polis_lora": json.dumps(self._lora_metadata()),
            "polis_base": self.base_dir or ""}))

    def _lora_metadata(self) -> dict[str, Any] | None:
        """The LoRA settings the saved tensors are adapters of (None: full fine-tuning)."""
        lora = getattr(self.optimizer, "lora", None)
        if lora is None or not getattr(lora, "enabled", False):
            return None
        return {"rank": lora.rank, "alpha": float(lora.alpha), "target_modules": list(lora.target_modules),
                "init_seed": lora.init_seed}

    def load_stage_file(self, path: str | Path) -> int:
        """Overlay weights from :meth:`save_stage`'s file; returns its version. The optimiser
        state is restored too when its file is there, of the same version and valid; otherwise
        the moments start fresh (logged), since the weights are what the run cannot lose."""
        from engine.model.safetensors_reader import SafetensorsFile

        f = SafetensorsFile(path)
        weights = f.read_many(f.names)
        version = int((f.metadata or {}).get("polis_version", "0"))
        recorded = (f.metadata or {}).get(METADATA_KEY)
        if recorded is not None and tensors_sha256(weights) != recorded:
            raise ValueError(f"stage checkpoint {path} does not match its content hash: refusing corrupt weights")
        self._b().set_weights(weights)
        moments = optimizer_path(path)
        if moments.exists():
            try:
                m = SafetensorsFile(moments)
                if int((m.metadata or {}).get("polis_version", "-1")) != version:
                    raise ValueError("it belongs to another version")
                self._b().load_optimizer_state(m.read_many(m.names))
            except Exception as exc:  # a bad moments file costs the moments only
                log.warning("optimiser state %s not restored (%s); AdamW moments start fresh", moments, exc)
        return version

    def close(self) -> None:
        if self._fresh is not None:
            self._fresh.close()
            self._fresh = None
        if self.backend is not None:
            self.backend.close()
            self.backend = None
