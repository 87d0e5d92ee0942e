"""The swarm over emulated internet links: real WebRTC through the hub, signalling through the TCP proxy."""

import asyncio
import json
import subprocess
import time

import pytest

from engine.net.identity import Identity
from engine.net.peer_manager import PeerManager
from engine.net.signalling import SignallingClient, start_signalling_server
from engine.net.tcp_delay_proxy import TcpDelayProxy
from engine.net.wan_emulator import sdp_host_candidates
from engine.net.wan_hub import WanHub, hub_sdp_filter
from engine.net.wan_profiles import BUILTIN, coordinator_impairment
from engine.self_command import polis_command

pytestmark = pytest.mark.network


def test_two_peers_on_different_profiles_link_only_through_the_hub_with_their_combined_delay():
    async def body():
        srv = await start_signalling_server()
        host, port = srv.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        hub = WanHub(BUILTIN)
        control = await hub.start()
        proxy = TcpDelayProxy((host, int(port)), *coordinator_impairment(BUILTIN["metro"]))
        proxy_host, proxy_port = await proxy.start()
        url = srv.url.replace(f"{host}:{port}", f"{proxy_host}:{proxy_port}")
        a = SignallingClient(url, Identity.generate())
        b = SignallingClient(url, Identity.generate())
        seen = []

        def spy(inner):
            async def hook(sdp):
                out = await inner(sdp)
                seen.append(out)
                return out
            return hook
        manager_a = PeerManager(a, sdp_filter=spy(hub_sdp_filter(control, "home")))
        manager_b = PeerManager(b, sdp_filter=spy(hub_sdp_filter(control, "metro")))
        try:
            await a.connect()
            await b.connect()
            link_a = await manager_a.connect(b.peer_id, timeout_s=30)
            link_b = await manager_b.accept(10)
            stand_ins = {s.local for s in hub._by_real.values()}
            assert len(seen) == 2 and all(set(sdp_host_candidates(s)) <= stand_ins for s in seen)
            t0 = time.monotonic()
            await link_a.send({"type": "ping"})
            await asyncio.wait_for(link_b.recv(), 10)
            await link_b.send({"type": "pong"})
            await asyncio.wait_for(link_a.recv(), 10)
            rtt_s = time.monotonic() - t0
            assert rtt_s >= (150 + 20) / 2 / 1e3 - 0.01  # one home end, one metro end
            stats = hub.stats()
            assert stats["kinds"]["home->metro"]["forwarded"] > 0 and stats["kinds"]["metro->home"]["forwarded"] > 0
            assert stats["dropped_unknown"] <= 4  # only the answerer's first checks, before its answer was registered
            assert proxy.counters.connections == 2 and proxy.counters.bytes_down > 0  # signalling crossed the proxy
        finally:
            await manager_a.close()
            await manager_b.close()
            for c in (a, b):
                await c.close()
            await proxy.close()
            await hub.close()
            await srv.close()
    asyncio.run(asyncio.wait_for(body(), 90))


@pytest.mark.slow
def test_the_demo_swarm_trains_over_a_mix_with_one_home_node_and_loses_no_rollout(tmp_path):
    argv = polis_command("demo", "--json", "--quiet", "--minutes", "3", "--max-versions", "4",
                         "--wan", "home:1,continental", "--run-dir", str(tmp_path / "run"))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["eval_after"] is not None and summary["versions"] >= 1
    assert summary["rollouts_lost"] == 0
    wan = summary["wan"]
    assert wan["profiles"] == ["continental", "home", "continental", "continental"]
    kinds = wan["relay"]["kinds"]
    assert kinds["home->continental"]["forwarded"] > 0 and kinds["continental->home"]["forwarded"] > 0
    assert kinds["continental->continental"]["forwarded"] > 0
    paced = [r for r in summary["in_flight"] if "cycle_ms" in r]  # the nodes' reports reached the pacer
    assert paced and all(r["network_ms"] > 40 and 1 <= r["limit"] <= r["ceiling"] for r in paced)
