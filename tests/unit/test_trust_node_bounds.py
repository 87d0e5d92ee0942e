"""Finding 9 of issue 14, node side: far-future share slots, forgotten last-stage jobs, floods of
tasks and compute calls are bounded (each used to grow or jam without limit)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from engine.net.errors import ProtocolViolation
from engine.swarm.compute_thread import ComputeBusy, ComputeThread
from engine.swarm.generation import Generation, _LastStageJob
from engine.swarm.messages import Share
from engine.swarm.node_context import MAX_TASKS, TaskSpawner
from engine.swarm.replica_step import MAX_SHARE_STEPS, ReplicaStep


def _replica_step(version: int) -> ReplicaStep:
    ctx = SimpleNamespace(stage=SimpleNamespace(rt=SimpleNamespace(version=version)),
                          stage_members=lambda: {"peer-honest", "peer-hostile"})

    async def release(step):
        return None
    return ReplicaStep(ctx, share_timeout_s=1.0, data_dir=None, release_through=release, after_step=lambda m: None)


def test_shares_for_far_future_or_past_steps_are_refused_and_cannot_jam_the_exchange():
    rs = _replica_step(version=7)
    for step in (10**9, 10**9 + 1, 10**9 + 2, 10**9 + 3, 10**9 + 4, 6):
        with pytest.raises(ProtocolViolation, match="outside"):
            rs.on_share("peer-hostile", Share(step=step, tensors=[]), b"")
    rs.on_share("peer-honest", Share(step=7, tensors=[]), b"")  # our next step still gets through
    rs.on_share("peer-honest", Share(step=7 + MAX_SHARE_STEPS - 1, tensors=[]), b"")
    assert sorted(rs._shares) == [7, 7 + MAX_SHARE_STEPS - 1]


def test_a_last_stage_job_whose_first_stage_vanished_expires():
    dropped = []
    ctx = SimpleNamespace(compute=SimpleNamespace(submit_background=lambda fn, job: dropped.append(job)),
                          stage=SimpleNamespace(rt=SimpleNamespace(drop=None)))
    gen = Generation(ctx)
    gen._last["j1"] = _LastStageJob(rows=1, tokens=[[]], logprobs=[[]], finished=np.zeros(1, bool), versions=[0])
    gen.expire(time.monotonic() - 60)
    assert "j1" in gen._last  # touched just now: kept
    gen.expire(time.monotonic() + 1)
    assert "j1" not in gen._last and dropped == ["j1"]


def test_the_task_spawner_refuses_past_its_bound_and_closes_the_refused_coroutine():
    async def main():
        spawner, gate = TaskSpawner(), asyncio.Event()
        for i in range(MAX_TASKS):
            spawner.spawn(gate.wait(), f"t{i}")
        extra = gate.wait()
        with pytest.raises(ProtocolViolation, match="tasks already running"):
            spawner.spawn(extra, "one-too-many")
        assert extra.cr_frame is None  # closed, never left un-awaited
        gate.set()
        await asyncio.gather(*spawner.pending())
        spawner.spawn(asyncio.sleep(0), "after")  # room again
        await asyncio.gather(*spawner.pending())
    asyncio.run(main())


def test_the_compute_queue_refuses_past_its_bound_and_still_stops():
    ct, gate = ComputeThread(max_pending=3), threading.Event()
    running = ct.submit(gate.wait)  # occupies the thread
    while not running.running():
        time.sleep(0.001)
    queued = [ct.submit(lambda i=i: i) for i in range(3)]
    with pytest.raises(ComputeBusy):
        ct.submit(lambda: None)
    gate.set()
    assert [f.result(timeout=5) for f in queued] == [0, 1, 2]
    ct.stop()
