"""Resumable learning state of a ``Trainer`` in a run directory (safetensors + JSON).

Layout of ``run_dir``::

    state.json                  step, per-stage versions, RNG states, config, queued rollouts, logs
    stage{i}.safetensors        weights of stage i (HF names, fp32)
    stage{i}.optimizer.safetensors   AdamW state of stage i (``backends.optimizer_state`` format)

For a ``LocalPipeline`` every stage's optimiser state is saved and restored through
``StageBackend.optimizer_state`` / ``load_optimizer_state``, so a resumed run continues
exactly (same weights, moments, step counts, RNG streams and queue); the format is shared
by the backends, so a run saved on torch may resume on MLX and back. ``state.json`` lists
the stages saved with their optimiser state (``optimizer_state_saved_for_stages``): a stage
missing from it (a state written before backends exported it, or a pipeline without local
backends) resumes with fresh AdamW moments, and ``restore_run`` logs a warning saying so.

Files are written to a temporary name and renamed, so a crash never leaves a half-written
file behind. ``restore_run`` reads every file before changing the trainer, and loads the
optimiser states (validated by each backend) before the weights; an error raises
``RunStateError``. A restore that fails part-way (a later stage's optimiser state refused)
can leave earlier stages restored: discard that trainer.

What it does not know: how the weights are used, transports.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from backends.base import BackendError
from engine.atomic_file import atomic_write_bytes
from engine.rl.rollout import Group, Sample
from engine.rl.staleness import LaggedQueue
from engine.rl.step_log import EvalLog, StepLog

log = logging.getLogger(__name__)



class Resumable(Protocol):
    """What is saved of a trainer (``engine.rl.trainer.Trainer`` has all of it)."""

    pipeline: Any  #: a ``StagePipeline``; its ``backends`` (when local) hold the optimiser states
    config: Any  #: a ``TrainerConfig`` (``to_dict()``)
    step_count: int
    prompt_rng: np.random.Generator
    sample_rng: np.random.Generator
    shuffle_rng: np.random.Generator
    queue: LaggedQueue
    steps: list[StepLog]
    evals: list[EvalLog]


STATE_FILE = "state.json"
FORMAT_VERSION = 1
#: largest state.json read back (queued rollouts of a small model are a few MB)
MAX_STATE_BYTES = 256 * 1024 * 1024


class RunStateError(RuntimeError):
    """A run directory is missing, corrupt, or belongs to a different configuration."""


def _group_to_json(g: Group) -> dict[str, Any]:
    return {"prompt": g.prompt, "prompt_ids": g.prompt_ids.tolist(), "samples": [
        {"ids": s.completion_ids.tolist(), "logprobs": s.behaviour_logprobs.astype(float).tolist(),
         "versions": s.versions.tolist(), "finished": s.finished, "reward": s.reward} for s in g.samples]}


def _group_from_json(d: dict[str, Any]) -> Group:
    samples = [Sample(completion_ids=np.asarray(s["ids"], dtype=np.int64),
                      behaviour_logprobs=np.asarray(s["logprobs"], dtype=np.float32),
                      versions=np.asarray(s["versions"], dtype=np.int64).reshape(len(s["ids"]), -1),
                      finished=bool(s["finished"]), reward=s["reward"]) for s in d["samples"]]
    return Group(prompt=d["prompt"], prompt_ids=np.asarray(d["prompt_ids"], dtype=np.int64), samples=samples)


def _save_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save

    data = save({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, metadata={"format": "pt"})
    atomic_write_bytes(path, data)


def _load_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise RunStateError(f"{path}: missing") from None
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise RunStateError(f"{path}: unreadable ({exc})") from None


def save_run(run_dir: str | Path, trainer: "Resumable") -> Path:
    """Write everything needed to continue ``trainer`` later; returns the directory."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    pipeline = trainer.pipeline
    for i, weights in enumerate(pipeline.state_dicts()):
        _save_tensors(run_dir / f"stage{i}.safetensors", weights)
    optimizer_saved = []
    for i, backend in enumerate(getattr(pipeline, "backends", [])):  # remote pipelines hold no backends here
        _save_tensors(run_dir / f"stage{i}.optimizer.safetensors", backend.optimizer_state())
        optimizer_saved.append(i)
    state = {
        "format": FORMAT_VERSION,
        "config": trainer.config.to_dict(),
        "step": trainer.step_count,
        "versions": list(pipeline.versions()),
        "rng": {"prompt": trainer.prompt_rng.bit_generator.state, "sample": trainer.sample_rng.bit_generator.state,
                "shuffle": trainer.shuffle_rng.bit_generator.state},
        "queue": [[_group_to_json(g) for g in batch] for batch in trainer.queue.pending()],
        "steps": [asdict(s) for s in trainer.steps],
        "evals": [asdict(e) for e in trainer.evals],
        "optimizer_state_saved_for_stages": optimizer_saved,
    }
    atomic_write_bytes(run_dir / STATE_FILE, json.dumps(state).encode("utf-8"))
    return run_dir


def read_state(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / STATE_FILE
    try:
        if path.stat().st_size > MAX_STATE_BYTES:
            raise RunStateError(f"{path}: larger than {MAX_STATE_BYTES} bytes")
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunStateError(f"{path}: missing (not a run directory)") from None
    except (OSError, ValueError) as exc:
        raise RunStateError(f"{path}: unreadable ({exc})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise RunStateError(f"{path}: not a format-{FORMAT_VERSION} run state")
    return state


def restore_run(run_dir: str | Path, trainer: "Resumable") -> None:
    """Load a saved state into ``trainer`` (built with the same config and stage layout)."""
    run_dir = Path(run_dir)
    state = read_state(run_dir)
    # compared as configs, not dicts: a state saved before a field with a default existed
    # (e.g. the task's newer options) still belongs to a run with that default
    try:
        saved = type(trainer.config).from_dict(state["config"])
    except (TypeError, ValueError, KeyError) as exc:
        raise RunStateError(f"{run_dir}: its trainer configuration is unreadable ({exc})") from exc
    if saved != trainer.config:
        raise RunStateError(f"{run_dir}: saved with a different trainer configuration")
    pipeline = trainer.pipeline
    if len(state["versions"]) != pipeline.num_stages:
        raise RunStateError(f"{run_dir}: saved with {len(state['versions'])} stages, "
                            f"this pipeline has {pipeline.num_stages}")
    weights = [_load_tensors(run_dir / f"stage{i}.safetensors") for i in range(pipeline.num_stages)]
    optimizer = _read_optimizer_states(run_dir, state, pipeline)
    try:
        for i, tensors in optimizer.items():
            pipeline.backends[i].load_optimizer_state(tensors)
        pipeline.set_weights(weights)
        pipeline.set_versions(state["versions"])
        trainer.step_count = int(state["step"])
        trainer.prompt_rng.bit_generator.state = state["rng"]["prompt"]
        trainer.sample_rng.bit_generator.state = state["rng"]["sample"]
        trainer.shuffle_rng.bit_generator.state = state["rng"]["shuffle"]
        trainer.queue.clear()
        for batch in state["queue"]:
            trainer.queue.push([_group_from_json(g) for g in batch])
        trainer.steps = [StepLog(**{**s, "versions": tuple(s["versions"]),
                                    "staleness_histogram": {int(k): v for k, v in s["staleness_histogram"].items()}})
                         for s in state["steps"]]
        trainer.evals = [EvalLog(**{**e, "versions": tuple(e["versions"])}) for e in state["evals"]]
    except BackendError as exc:
        raise RunStateError(f"{run_dir}: saved state refused by the backend ({exc})") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise RunStateError(f"{run_dir}: corrupt run state ({exc})") from None
    log.info("restored %s at step %d (optimiser state for stages %s)", run_dir, trainer.step_count,
             sorted(optimizer) or "none")


def _read_optimizer_states(run_dir: Path, state: dict[str, Any], pipeline: Any) -> dict[int, dict[str, np.ndarray]]:
    """The saved optimiser state of each stage that has one and a local backend to take it."""
    saved = state.get("optimizer_state_saved_for_stages", [])
    if not isinstance(saved, list) or not all(isinstance(i, int) and 0 <= i < pipeline.num_stages for i in saved):
        raise RunStateError(f"{run_dir}: corrupt run state (optimizer_state_saved_for_stages = {saved!r})")
    backends = getattr(pipeline, "backends", None)
    if backends is None:
        if saved:
            log.warning("%s: this pipeline has no local backends; AdamW moments restart", run_dir)
        return {}
    restart = [i for i in range(pipeline.num_stages) if i not in saved]
    if restart:
        log.warning("%s: no optimiser state saved for stages %s; their AdamW moments restart", run_dir, restart)
    return {i: _load_tensors(run_dir / f"stage{i}.optimizer.safetensors") for i in saved}
