"""Loading the stage a welcome assigns: from checkpoint files, or from a replica's weights.

* :func:`base_dir`: the base checkpoint directory (the run's model, the configured one, or the shipped one).
* :func:`load_from_files`: the base checkpoint's layers of the stage, or a stage checkpoint.
* :func:`load_token_table`: the base's input embeddings, for token-predicted activation schemes.
* :func:`load_from_peer`: asks a replica for its trainable weights (``weights_req``; under LoRA
  only the adapters travel: the frozen base comes from this machine's files; with
  ``stream`` an inference replica also starts following that replica's weight stream),
  checks them against the model config they come with, and loads them.

What it does not know: what happens around a load (streams, states, readiness: the node's).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from backends.base import OptimizerConfig, StageSpec
from engine.net.codec_predictor import TokenTable
from engine.net.errors import ProtocolViolation
from engine.swarm import adamw_transfer, tensor_bundle
from engine.swarm.messages import Weights, WeightsReq
from engine.swarm.node_context import NodeContext
from engine.swarm.replica_step import WEIGHTS_TIMEOUT_S

log = logging.getLogger(__name__)


def base_dir(configured: str | None, model: str = "") -> Path:
    """The base checkpoint directory: the run's ``model`` (a name: the base imported under it in this
    machine's user data dir; else a path), else ``configured``, else the shipped one.

    A named model that is not imported here raises ``FileNotFoundError`` saying how to import it."""
    if model:
        if is_model_name(model):
            from engine.paths import imported_model_dir

            path = imported_model_dir(model)
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"the run trains {model!r}, which is not imported on this machine: "
                                        f"run `polis import {model} --out {path}` (polis demo does it by itself)")
            return path
        return Path(model)
    if configured:
        return Path(configured)
    from engine.paths import base_checkpoint_dir

    return base_checkpoint_dir()


def load_token_table(base: Path) -> TokenTable:
    """The base checkpoint's input embeddings as the token table of predicted activation schemes
    (every node of a run reads the same base, whatever training does to its stage's copy)."""
    from backends.stage_layout import EMBED
    from engine.model.checkpoint import Checkpoint

    return TokenTable(Checkpoint(base).read([EMBED])[EMBED])


def is_model_name(model: str) -> bool:
    """Whether a run's ``model`` is a name (``smollm2-135m``) rather than a directory path."""
    return "/" not in model and "\\" not in model and model not in (".", "..")


async def load_from_files(ctx: NodeContext, base: Path, spec: StageSpec, optimizer: OptimizerConfig,
                          stage_checkpoint: str | None, version: int) -> None:
    """Load ``spec`` from the base checkpoint (or ``stage_checkpoint``) on the compute thread."""
    # an inference replica serves as the version its files hold (rollouts carry it)
    await ctx.compute.run(ctx.stage.rt.load_checkpoint, base, spec, optimizer, stage_checkpoint or None,
                          None if ctx.role == "inference" else version)


async def load_from_peer(ctx: NodeContext, spec: StageSpec, peer: str, optimizer: OptimizerConfig,
                         base: Path | None = None, moments: bool = False) -> tuple[Weights, dict]:
    """Load ``spec`` from ``peer``'s weights; ``(weights header, weights)`` as they arrived.

    Under LoRA (``optimizer.lora.enabled``) the peer sends its adapters only: the frozen base
    of the stage is read from ``base`` (this machine's copy of the run's model) first. With
    ``moments`` (a trainer syncing every step) the peer's AdamW moments come along and are
    installed too (``engine.swarm.adamw_transfer``), so this replica's next step is the peer's."""
    from backends.stage_layout import plan_stage
    from engine.model.config import ModelConfig

    waiter = ctx.weights.expect(peer)
    # an inference replica also follows the weight stream that starts from these weights
    await ctx.peers.send(peer, WeightsReq(stage=spec.stage_index, stream=ctx.role == "inference",
                                          optimizer_state=moments))
    header, payload = await asyncio.wait_for(waiter, WEIGHTS_TIMEOUT_S)
    rt = ctx.stage.rt
    if optimizer.lora.enabled:
        if base is None:
            raise ValueError("a LoRA stage loads its frozen base from files; no base checkpoint given")
        # the frozen base as version 0; the adapters that follow carry the peer's version
        await ctx.compute.run(rt.load_checkpoint, base, spec, optimizer, None, 0)
        shapes = await ctx.compute.run(rt.shapes)
        weights, adamw = _unpack(header, payload, shapes, moments, peer)
        await ctx.compute.run(rt.set_weights, weights, header.version)
        log.info("loaded stage %d (version %d): base from %s, adapters from replica %s", spec.stage_index,
                 header.version, base, peer)
    else:
        config = ModelConfig.from_dict(header.config, source=f"replica {peer}")
        names = [e.name for e in header.tensors if not e.name.startswith(adamw_transfer.PREFIX)]
        weights, adamw = _unpack(header, payload, plan_stage(spec, config, names).shapes, moments, peer)
        await ctx.compute.run(rt.load_weights, spec, header.config, weights, optimizer, header.version)
        log.info("loaded stage %d (version %d) from replica %s", spec.stage_index, header.version, peer)
    if adamw is not None:
        await ctx.compute.run(rt.load_optimizer_state, adamw)
    elif moments:
        log.info("replica %s sent no AdamW moments (too large for one message); ours start fresh", peer)
    return header, weights


def _unpack(header: Weights, payload: bytes, shapes: dict[str, tuple[int, ...]], moments: bool,
            peer: str) -> tuple[dict, dict | None]:
    """``(weights, AdamW moments or None)`` of a ``weights`` message: every weight must be there."""
    expected = dict(shapes)
    if moments:
        expected.update(adamw_transfer.expected_shapes(shapes))
    received = tensor_bundle.unpack(header.tensors, payload, expected)
    weights, adamw = adamw_transfer.split(received, shapes, peer)
    if len(weights) != len(shapes):
        missing = sorted(set(shapes) - set(weights))
        raise ProtocolViolation(f"weights from {peer} lack {len(missing)} tensors, e.g. {missing[:3]}")
    return weights, adamw
