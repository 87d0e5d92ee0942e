"""The coordinator's export API: ``POST /api/export`` (admin token) plans a ``polis export --coordinator``.

The exporter (``engine.swarm.export_fetch``) is a peer outside the swarm with its own identity.
It posts an :class:`ExportRequest` (its peer id, the version it wants) and gets an
:class:`ExportPlan`: per stage, the stage checkpoint of exactly that version when the coordinator
knows one, the stage's leader and the version it last reported, and the digest of the stage's
weights the swarm agreed on at that version (``WeightAuthority.decided``: a lone replica's, or a
strict majority's; the last ``KEEP_VERSIONS`` versions); the run's signalling URL; and the run
record (``RunRecord.to_dict``, read from the coordinator's own database) the model card is made
from. Before answering, the coordinator sends each stage leader an ``export_permit`` naming the
exporter, so the leader accepts its link and answers its ``weights_req``
(``engine.swarm.export_permits``).

Both bodies are typed and size-capped: a request of at most ``MAX_REQUEST_BYTES``, a plan the
exporter reads up to ``MAX_PLAN_BYTES``. What it does not know: tensors, links, how the export
is written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Annotated, Any, Protocol

import msgspec
from msgspec import Meta

from engine.swarm.messages import (
    Digest,
    ExportPermit,
    FilePath,
    LayerIndex,
    PeerId,
    RunId,
    StageCount,
    StageIndex,
    Version,
)

log = logging.getLogger(__name__)

#: most bytes of an export request
MAX_REQUEST_BYTES = 4096
#: most bytes of an export plan the exporter reads (the run record grows with the versions)
MAX_PLAN_BYTES = 32 * 1024 * 1024
#: how long a permit lets the exporter fetch weights (seconds)
PERMIT_TTL_S = 600


class ExportRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``polis export --coordinator`` asks for."""

    peer_id: PeerId  # the exporter's peer id (its signalling identity); stage leaders let it fetch
    version: Version | None = None  # the policy version wanted; None: the run's current version


class ExportStage(msgspec.Struct, frozen=True):
    """Where one stage's weights of the plan's version can be had, and the hash they must have."""

    stage: StageIndex  # the stage
    layer_start: LayerIndex  # first decoder layer it holds
    layer_end: LayerIndex  # one past its last decoder layer
    leader: PeerId | None  # its leader trainer (None: no trainer holds the stage now)
    leader_version: Version | None  # the version the leader last reported holding
    weights_hash: Digest | None  # the swarm's agreed digest of its weights at the version (None: unknown)
    checkpoint_path: FilePath | None  # its stage checkpoint of exactly the version (None: none known)


class ExportPlan(msgspec.Struct, frozen=True):
    """The coordinator's answer to an :class:`ExportRequest`."""

    version: Version  # the version to export
    run_id: RunId  # the run
    num_stages: StageCount  # how many stages the model is cut into
    signal_url: Annotated[str, Meta(max_length=2048)]  # the run's signalling relay (ws://.../signal)
    permit_expires_s: Annotated[int, Meta(ge=0, le=1 << 40)]  # unix seconds the leaders' permits last
    stages: Annotated[list[ExportStage], Meta(min_length=1, max_length=256)]  # stage order
    record: dict[str, Any]  # the run record (``RunRecord.to_dict``), checked by ``RunRecord.from_dict``


class ExportSource(Protocol):
    """What the plan reads of the coordinator (``engine.swarm.coordinator.Coordinator`` is one)."""

    book: Any  # RunBook: the run's version
    members: Any  # Membership: leaders, the weight authority, sends to nodes
    steps: Any  # StepRunner: the stage checkpoints reported
    specs: list  # the stages' StageSpecs
    sessions: dict  # peer id -> NodeSession
    config: Any  # CoordinatorConfig: db_path
    run_id: str
    num_stages: int
    url: str


class ExportRefused(ValueError):
    """The request cannot be planned (bad body, or a version the run does not have)."""


async def plan_export(coordinator: ExportSource, body: bytes) -> ExportPlan:
    """Plan an export for ``body`` (an :class:`ExportRequest`) and grant the leaders' permits."""
    from engine.model.export.run_record import RunRecord

    if len(body) > MAX_REQUEST_BYTES:
        raise ExportRefused(f"export request over {MAX_REQUEST_BYTES} bytes")
    try:
        request = msgspec.json.decode(body, type=ExportRequest)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ExportRefused(f"not an export request: {exc}") from None
    current = coordinator.book.version
    version = current if request.version is None else request.version
    if version > current:
        raise ExportRefused(f"the run is at version {current}; it has no version {version} yet")
    expires = int(time.time()) + PERMIT_TTL_S
    authority, steps = coordinator.members.authority, coordinator.steps
    stages = []
    for spec in coordinator.specs:
        s = spec.stage_index
        leader = coordinator.members.leader(s)
        session = coordinator.sessions.get(leader) if leader else None
        if session is not None:
            await coordinator.members.send(leader, ExportPermit(peer=request.peer_id, stage=s, expires_s=expires))
        stages.append(ExportStage(stage=s, layer_start=spec.layer_start, layer_end=spec.layer_end,
                                  leader=leader if session is not None else None,
                                  leader_version=session.version if session is not None else None,
                                  weights_hash=authority.decided(s, version),
                                  checkpoint_path=steps.checkpoint_of(s, version)))
    record = await asyncio.to_thread(lambda: RunRecord.open(Path(coordinator.config.db_path)).to_dict())
    log.info("export of version %d planned for %s (leaders: %s)", version, request.peer_id,
             [st.leader for st in stages])
    return ExportPlan(version=version, run_id=coordinator.run_id, num_stages=coordinator.num_stages,
                      signal_url=coordinator.url.replace("http://", "ws://", 1) + "/signal",
                      permit_expires_s=expires, stages=stages, record=record)
