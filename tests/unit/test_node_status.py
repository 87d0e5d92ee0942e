"""A node's reports: swarm figures polled over one reused HTTP session, status events."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiohttp import web

from backends.base import StageSpec
from engine.swarm.node_context import HeldStage, NodeContext
from engine.swarm.node_status import NodeStatus

STATS = {"version": 7, "evals": [{"version": 5, "accuracy": 0.5}], "versions": [{"version": 7, "reward": None}],
         "stages": [{"stage": 0, "layers": "0-1", "replicas": ["me000000"], "inference": ["other000"]}],
         "steps": [{"version": 6, "staleness_mean": 1.0}, {"version": 7, "staleness_mean": 2.5}]}


def test_swarm_figures_come_over_one_reused_http_session_and_status_names_the_stage():
    events: list[tuple[str, dict]] = []
    peers_seen: list[tuple[str, int]] = []

    async def scenario():
        async def stats(request: web.Request) -> web.Response:
            peers_seen.append(request.transport.get_extra_info("peername"))
            return web.json_response(STATS)

        app = web.Application()
        app.router.add_get("/api/stats", stats)
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
            await status.emit_swarm()
            assert status._http is first and not first.closed
        finally:
            await status.close()
            await runner.cleanup()
        assert first.closed
        status.emit_status()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    swarm = [fields for event, fields in events if event == "swarm"]
    assert len(swarm) == 2 and swarm[0]["policy_version"] == 7 and swarm[0]["reward"] == [{"version": 7, "reward": 0.0}]
    assert swarm[0]["stages"] == [{"stage": 0, "layers": "0-1", "replicas": 2, "mine": True}]
    assert swarm[0]["staleness_mean"] == 2.5  # the swarm's last step, so the window's Staleness is filled
    assert len(set(peers_seen)) == 1  # both polls on one keep-alive connection
    status = [fields for event, fields in events if event == "status"][-1]
    assert (status["stage"], status["num_stages"], status["peers"], status["policy_version"]) == (0, 2, 2, 3)
