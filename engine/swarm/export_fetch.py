"""Every stage's weights of one policy version from a running swarm, verified: ``polis export --coordinator``.

:func:`fetch_run` is a peer outside the swarm with its own (fresh) identity:

1. it posts its peer id to the coordinator's ``/api/export`` with the admin token and reads the
   :class:`~engine.swarm.export_api.ExportPlan` (size-capped, typed); the coordinator grants each
   stage leader an ``export_permit`` for it;
2. per stage, it takes the stage checkpoint of exactly that version when the plan names one and
   the file is readable here and passes its SHA-256 (``stage_files``); otherwise it registers with
   the run's signalling relay, opens a WebRTC link to the stage's leader and asks for its full
   weights (``weights_req`` / ``weights``, the message replicas resync with);
3. every stage's tensors must hash (``weights_digest``) to the digest the swarm agreed on at that
   version (:func:`verify_stage`): weights that miss it, or of another version, are refused with an
   error naming the stage and what to do; a stage with no way to its weights is an error too,
   never a base copy.

Every await has a deadline (``plan_timeout_s``, ``stage_timeout_s``). The result goes to
``engine.model.export.hf_export.write_export``, the writer of the local export. What it does not
know: output formats, the model card, the node side (``engine.swarm.export_permits``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from engine.model.errors import CheckpointError
from engine.model.export.run_record import RunRecord
from engine.model.export.stage_files import StageFile, StageMissing, StageWeights
from engine.net.errors import NetError, ProtocolViolation
from engine.net.identity import Identity, split_pinned_url
from engine.swarm import messages, tensor_bundle
from engine.swarm.export_api import MAX_PLAN_BYTES, ExportPlan, ExportRequest, ExportStage
from engine.swarm.weight_votes import weights_digest

log = logging.getLogger(__name__)

#: longest the coordinator may take to plan the export (seconds)
PLAN_TIMEOUT_S = 30.0
#: longest one stage's weights may take over WebRTC: link set-up, request, transfer (seconds)
STAGE_TIMEOUT_S = 180.0
#: what a fetched stage's hash is (``StageWeights.hash_kind``)
DIGEST_KIND = "blake2b-128"


class WeightsRefused(CheckpointError):
    """A stage's weights were fetched but are not the swarm's weights of the version asked for."""


async def request_plan(url: str, admin_token: str, peer_id: str, version: int | None, *,
                       timeout_s: float = PLAN_TIMEOUT_S) -> ExportPlan:
    """The coordinator's export plan (raises CheckpointError saying what to do when it cannot be had)."""
    import aiohttp

    body = msgspec.json.encode(ExportRequest(peer_id=peer_id, version=version))
    where = Path(url)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.post(url.rstrip("/") + "/api/export", data=body,
                                 headers={"Authorization": f"Bearer {admin_token}",
                                          "Content-Type": "application/json"}) as response:
                if response.content_length is not None and response.content_length > MAX_PLAN_BYTES:
                    raise CheckpointError(where, f"the export plan is over {MAX_PLAN_BYTES} bytes")
                raw = await response.content.read(MAX_PLAN_BYTES + 1)
                status = response.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise CheckpointError(where, f"the coordinator did not answer ({exc or type(exc).__name__}); check the "
                                     "URL (the one `polis coordinator` printed) and that it is running") from None
    if len(raw) > MAX_PLAN_BYTES:
        raise CheckpointError(where, f"the export plan is over {MAX_PLAN_BYTES} bytes")
    if status == 401:
        raise CheckpointError(where, "the coordinator refused the admin token; pass the file the coordinator "
                                     "wrote with --admin-token-file (--admin-token-file here too)")
    if status != 200:
        try:
            reason = msgspec.json.decode(raw).get("error", "")
        except (msgspec.DecodeError, AttributeError):
            reason = raw[:200].decode("utf-8", "replace")
        hint = "; is it a Polis coordinator of this version?" if status == 404 else ""
        raise CheckpointError(where, f"the coordinator refused the export (HTTP {status}: {reason}){hint}")
    try:
        return msgspec.json.decode(raw, type=ExportPlan)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise CheckpointError(where, f"the coordinator's export plan is not valid ({exc})") from None


def run_lora(record: RunRecord) -> dict[str, Any] | None:
    """The run's adapter settings as a stage checkpoint records them (None: full fine-tuning)."""
    lora = record.run.get("lora") or {}
    if not lora.get("enabled"):
        return None
    return {"rank": int(lora["rank"]), "alpha": float(lora["alpha"]), "target_modules": list(lora["target_modules"]),
            "init_seed": int(lora.get("init_seed", 0))}


def verify_stage(stage: ExportStage, version: int, got_version: int, tensors: dict[str, np.ndarray], *,
                 source: str, lora: dict[str, Any] | None, base: str | None) -> StageWeights:
    """``tensors`` as stage ``stage.stage``'s weights of ``version``, or WeightsRefused saying why not:
    another version, no agreed digest to check against, or a digest other than the agreed one."""
    where = Path(source)
    s = stage.stage
    if got_version != version:
        raise WeightsRefused(where, f"stage {s}: {source} holds version {got_version}, not {version} (the swarm "
                                    f"moved on, or that replica fell behind); export version {got_version} "
                                    "(omit --version for the newest) or a version the stage has checkpointed")
    if stage.weights_hash is None:
        raise WeightsRefused(where, f"stage {s}: the coordinator holds no agreed digest of its weights at version "
                                    f"{version} (it keeps the last few versions), so weights fetched from a peer "
                                    "cannot be verified; export the current version, or one the stage checkpointed")
    digest = weights_digest(tensors)
    if digest != stage.weights_hash:
        raise WeightsRefused(where, f"stage {s}: the weights from {source} hash to {digest}, not {stage.weights_hash}, "
                                    f"the digest the stage's replicas agreed on at version {version}; refused, "
                                    "nothing written. Try again later (the coordinator names another leader once "
                                    "this one is outvoted), or export from the run directory")
    return StageWeights(stage=s, version=version, source=source, sha256=digest, lora=lora, base=base,
                        layers=(stage.layer_start, stage.layer_end), tensors=tensors, hash_kind=DIGEST_KIND)


def from_checkpoint(stage: ExportStage, version: int, num_stages: int) -> tuple[StageWeights | None, str]:
    """The stage's checkpoint of ``version`` when the plan names one readable here (else None and why)."""
    if stage.checkpoint_path is None:
        return None, f"the coordinator knows no checkpoint of stage {stage.stage} at version {version}"
    path = Path(stage.checkpoint_path)
    if not path.is_file():
        return None, f"its checkpoint {path} is not on this machine"
    try:
        found = StageFile.read_header(path)
        if (found.stage, found.num_stages, found.version) != (stage.stage, num_stages, version):
            return None, (f"{path} is stage {found.stage} of {found.num_stages} at version {found.version}, "
                          f"not stage {stage.stage} of {num_stages} at version {version}")
        weights = found.read_weights()
    except CheckpointError as exc:
        return None, str(exc)
    if stage.weights_hash is not None and weights_digest(weights.tensors) != stage.weights_hash:
        return None, f"{path} passes its own hash but is not the weights the stage's replicas agreed on"
    return weights, ""


async def _fetch_from_leader(pm: Any, stage: ExportStage, deadline: float) -> tuple[int, dict[str, np.ndarray]]:
    """Stage ``stage``'s full weights from its leader, by ``deadline`` (monotonic seconds)."""
    leader = stage.leader
    assert leader is not None
    link = None
    while link is None:  # the leader may hear of our permit a moment after the plan came back
        try:
            link = await pm.ensure_link(leader, max(0.5, deadline - time.monotonic()))
        except (NetError, OSError, asyncio.TimeoutError) as exc:
            if time.monotonic() + 1.0 >= deadline:
                raise asyncio.TimeoutError(f"no link to the leader ({exc})") from None
            log.info("no link to %s yet (%s); retrying", leader, exc)
            await asyncio.sleep(1.0)
    await asyncio.wait_for(link.send(messages.WeightsReq(stage=stage.stage)), max(0.1, deadline - time.monotonic()))
    while True:
        header, payload = await asyncio.wait_for(link.recv(), max(0.1, deadline - time.monotonic()))
        if isinstance(header, messages.Weights) and header.stage == stage.stage:
            break
        log.debug("ignored %s from %s while waiting for weights", type(header).__name__, leader)
    shapes = {e.name: tuple(e.tensor.get("shape", ())) for e in header.tensors}  # the digest checks content
    tensors = await asyncio.to_thread(tensor_bundle.unpack, header.tensors, payload, shapes, require_all=True)
    return int(header.version), tensors


async def fetch_run(url: str, admin_token: str, *, version: int | None = None, identity: Identity | None = None,
                    plan_timeout_s: float = PLAN_TIMEOUT_S,
                    stage_timeout_s: float = STAGE_TIMEOUT_S) -> tuple[RunRecord, list[StageWeights]]:
    """The run record and every stage's verified weights of ``version`` (None: the run's current one)."""
    url = split_pinned_url(url)[0]
    identity = identity or Identity.generate()
    plan = await request_plan(url, admin_token, identity.peer_id, version, timeout_s=plan_timeout_s)
    record = RunRecord.from_dict(plan.record, origin=url)
    lora, base = run_lora(record), record.base_checkpoint
    got: dict[int, StageWeights] = {}
    why: dict[int, str] = {}
    for stage in plan.stages:
        weights, reason = await asyncio.to_thread(from_checkpoint, stage, plan.version, plan.num_stages)
        if weights is not None:
            got[stage.stage] = weights
        else:
            why[stage.stage] = reason
    wanted = [st for st in plan.stages if st.stage not in got]
    if wanted:
        got.update(await _fetch_stages(plan, wanted, why, identity, lora, base, stage_timeout_s))
    log.info("stages of version %d: %s", plan.version, {s: w.source for s, w in sorted(got.items())})
    return record, [got[s] for s in range(plan.num_stages)]


async def _fetch_stages(plan: ExportPlan, wanted: list[ExportStage], why: dict[int, str], identity: Identity,
                        lora: dict[str, Any] | None, base: str | None,
                        stage_timeout_s: float) -> dict[int, StageWeights]:
    from engine.net.peer_link import LinkConfig
    from engine.net.peer_manager import PeerManager, PeerManagerConfig
    from engine.net.signalling import SignallingClient

    out: dict[int, StageWeights] = {}
    signal = SignallingClient(plan.signal_url, identity)
    pm = None
    try:
        try:
            await asyncio.wait_for(signal.connect(), stage_timeout_s)
        except (NetError, OSError, asyncio.TimeoutError) as exc:
            raise StageMissing(Path(plan.signal_url), f"stage {wanted[0].stage}: {why[wanted[0].stage]}, and the "
                                                      f"run's signalling relay did not answer ({exc}); export on "
                                                      "the coordinator's machine, or from its run directory") from None
        pm = PeerManager(signal, PeerManagerConfig(link=LinkConfig()), validator=messages.decode_peer_header,
                         accept_peer=lambda peer: False)  # we dial; nobody dials us
        for stage in wanted:
            s = stage.stage
            if stage.leader is None:
                raise StageMissing(Path(f"stage{s}"), f"stage {s} has no reachable weights of version {plan.version}: "
                                                      f"{why[s]}, and no trainer holds the stage now. Bring back "
                                                      "a node that held it, or export a version it checkpointed "
                                                      "(from the run directory, where the checkpoints are)")
            source = f"peer {stage.leader} (WebRTC)"
            try:
                got_version, tensors = await _fetch_from_leader(pm, stage, time.monotonic() + stage_timeout_s)
            except (NetError, OSError, asyncio.TimeoutError, ProtocolViolation) as exc:
                raise StageMissing(Path(source), f"stage {s} has no reachable weights of version {plan.version}: "
                                                 f"{why[s]}, and its leader {stage.leader} did not send them within "
                                                 f"{stage_timeout_s:.0f} s ({exc or type(exc).__name__}). Check that "
                                                 "the node is up and reachable (polis node logs), then export "
                                                 "again") from None
            out[s] = await asyncio.to_thread(verify_stage, stage, plan.version, got_version, tensors,
                                             source=source, lora=lora, base=base)
            log.info("stage %d of version %d from %s, digest verified", s, plan.version, stage.leader)
    finally:
        if pm is not None:
            await pm.close()
        await signal.close()
    return out
