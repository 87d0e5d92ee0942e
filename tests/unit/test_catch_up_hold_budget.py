"""The steps wait for catch-ups at most a share of the run's time, however many nodes ask (issue 14).

A trainer that joined behind its stage and was outrun once more holds the next ``apply`` while it
catches up (``engine.swarm.node_reports``). A node can say ready behind on purpose, or go dark mid-load,
and identities are cheap: the step runner's hold credit bounds the cost of all of them together.
"""

from __future__ import annotations

import asyncio
import time

from engine.swarm import step_runner
from tests.support.recording_links import RecordingLinks
from tests.support.scheduling_parts import scheduling_parts


class ForeverCatchingUp(RecordingLinks):
    def catching_up(self) -> bool:
        return True  # some node always asks the steps to wait for it


def test_catch_up_holds_spend_a_credit_that_refills_at_a_share_of_the_run_time(tmp_path, monkeypatch):
    monkeypatch.setattr(step_runner, "CATCH_UP_HOLD_S", 0.4)
    monkeypatch.setattr(step_runner, "CATCH_UP_HOLD_SHARE", 0.5)
    steps = scheduling_parts(tmp_path / "run.db", ForeverCatchingUp(["s0", "s1"])).steps

    async def held_s() -> float:
        began = time.monotonic()
        await steps._wait_for_catch_ups()
        return time.monotonic() - began

    async def scenario() -> list[float]:
        first, second = await held_s(), await held_s()  # the credit, then nothing left
        await asyncio.sleep(0.4)  # the run goes on 0.4 s: 0.2 s of credit back
        return [first, second, await held_s()]

    first, second, third = asyncio.run(scenario())
    assert 0.35 <= first <= 0.6, first
    assert second <= 0.1, second
    assert 0.08 <= third <= 0.35, third  # less any overshoot of the first hold (it is owed)
