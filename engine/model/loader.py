"""``load_stage``: from a checkpoint directory and a StageSpec to a ready StageBackend.

Opens the checkpoint lazily, checks the stage fits the model, creates the backend
through ``backends.registry`` (on the calling thread, which becomes the backend's
compute thread) and hands it the stage's tensors as a lazy mapping, so only this
stage's bytes are ever read and peak memory stays near the stage's own size.
This module knows nothing about the maths inside a backend.
"""

from __future__ import annotations

import logging
from pathlib import Path

from backends import registry
from backends.base import OptimizerConfig, StageBackend, StageSpec
from engine.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)


def load_stage(checkpoint_dir: str | Path | Checkpoint, spec: StageSpec, backend_name: str = "auto",
               device: str | None = None, optimizer: OptimizerConfig | None = None) -> StageBackend:
    """Create backend ``backend_name`` on ``device`` holding stage ``spec`` of the checkpoint.

    Raises ``CheckpointError`` (naming the file) for checkpoint problems and
    ``BackendUnavailable`` when the backend cannot run here.
    """
    checkpoint = checkpoint_dir if isinstance(checkpoint_dir, Checkpoint) else Checkpoint(checkpoint_dir)
    weights = checkpoint.stage_weights(spec)  # validates names and shapes before anything heavy
    backend = registry.create(backend_name, device=device)
    try:
        backend.load(spec, weights, checkpoint.config, optimizer)
    except BaseException:
        backend.close()
        raise
    log.info("stage %d of %d (%s) on %s [%s]", spec.stage_index + 1, spec.num_stages,
             spec.describe(checkpoint.config.num_hidden_layers), backend.name, backend.device)
    return backend
