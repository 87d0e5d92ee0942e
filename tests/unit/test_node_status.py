"""A node's reports: swarm figures polled over one reused HTTP session, status events."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiohttp import web

from backends.base import StageSpec
from engine.control_protocol import encode_event, parse_event
from engine.swarm.node_context import HeldStage, NodeContext
from engine.swarm.node_status import MAX_SAMPLES, MAX_VERSIONS, NodeStatus

STATS = {"version": 7, "evals": [{"version": 5, "accuracy": 0.5}], "versions": [{"version": 7, "reward": None}],
         "stages": [{"stage": 0, "layers": "0-1", "replicas": ["me000000"], "inference": ["other000"]}],
         "steps": [{"version": 6, "staleness_mean": 1.0}, {"version": 7, "staleness_mean": 2.5}],
         "model": "smollm2-135m", "model_parameters": 134515008, "task": "reasoning_gym:chain_sum",
         "samples": [{"prompt": "What is 3 + 4?", "answer": "3 + 4 = 7. <answer>7</answer>" + "x" * 2000,
                      "reward": 1.05, "version": 6}] * 9}


async def _polled(stats: dict, polls: int, events: list, requests: list) -> None:
    """Serve ``stats`` as the coordinator's public stats API; let a node's status poll it ``polls`` times,
    then emit a status event. Records the events and each request (its peer address and query)."""
    async def answer(request: web.Request) -> web.Response:
        requests.append((request.transport.get_extra_info("peername"), dict(request.query)))
        return web.json_response(stats)

    app = web.Application()
    app.router.add_get("/api/stats", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    rt = SimpleNamespace(version=3, backend=object())
    ctx = NodeContext(peer_id="me000000", role="trainer", compute=None, peers=None, coordinator=None,
                      stage=HeldStage(rt=rt, spec=StageSpec(0, 2, 0, 1), num_layers=2))
    status = NodeStatus(ctx, coordinator_url=f"http://127.0.0.1:{port}", report_every_s=1.0,
                        emit=lambda event, **fields: events.append((event, fields)),
                        bytes_moved=lambda: (0.0, 0.0), link_count=lambda: 2, expire=lambda cutoff: None,
                        limits={"upload_mbps": None})
    try:
        await status.emit_swarm()
        first = status._http
        for _ in range(polls - 1):
            await status.emit_swarm()
        assert status._http is first and not first.closed
    finally:
        await status.close()
        await runner.cleanup()
    assert first.closed
    status.emit_status()


def test_swarm_figures_come_over_one_reused_http_session_and_status_names_the_stage():
    events: list[tuple[str, dict]] = []
    requests: list[tuple] = []
    asyncio.run(asyncio.wait_for(_polled(STATS, 2, events, requests), 30))
    peers_seen = [peer for peer, _ in requests]
    swarm = [fields for event, fields in events if event == "swarm"]
    assert len(swarm) == 2 and swarm[0]["policy_version"] == 7 and swarm[0]["reward"] == [{"version": 7, "reward": 0.0}]
    assert swarm[0]["stages"] == [{"stage": 0, "layers": "0-1", "replicas": 2, "mine": True}]
    assert swarm[0]["staleness_mean"] == 2.5  # the swarm's last step, so the window's Staleness is filled
    # what is being trained and what it writes now: the latest few samples, text capped to the protocol's bounds
    assert (swarm[0]["model"], swarm[0]["model_parameters"], swarm[0]["task"]) == \
        ("smollm2-135m", 134515008, "reasoning_gym:chain_sum")
    assert len(swarm[0]["samples"]) == MAX_SAMPLES and swarm[0]["samples"][-1]["version"] == 6
    assert parse_event(encode_event("swarm", **swarm[0]))["samples"][0]["answer"].startswith("3 + 4 = 7.")
    assert len(set(peers_seen)) == 1  # both polls on one keep-alive connection
    status = [fields for event, fields in events if event == "status"][-1]
    assert (status["stage"], status["num_stages"], status["peers"], status["policy_version"]) == (0, 2, 2, 3)


def test_the_swarm_event_carries_the_credit_the_coordinator_verified_for_this_node():
    events: list[tuple[str, dict]] = []
    requests: list[tuple] = []
    credit = {"role": "trainer", "tokens_generated": 1234, "microbatches_trained": 5, "microbatches_forward": 2,
              "steps_applied": 1, "self_reported": {"bytes_sent": 9e9}}
    asyncio.run(asyncio.wait_for(_polled({**STATS, "credit": credit}, 1, events, requests), 30))
    assert requests[0][1] == {"limit": str(MAX_VERSIONS), "peer": "me000000"}  # its own row, the reward curve's page
    swarm = [fields for event, fields in events if event == "swarm"][0]
    assert swarm["credit"] == {"tokens_generated": 1234, "microbatches_trained": 5, "microbatches_forward": 2,
                               "steps_applied": 1}  # verified figures only: the node's own claims stay out
    assert parse_event(encode_event("swarm", **swarm))["credit"]["tokens_generated"] == 1234
    asyncio.run(asyncio.wait_for(_polled(STATS, 1, events, requests), 30))  # a coordinator that has none for it
    assert [fields for event, fields in events if event == "swarm"][-1]["credit"] is None
