import asyncio
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from engine.net.discovery import LOOPBACK_ONLY, DiscoveryConfig, LanAdvertiser, ServiceAdvert, browse, find_coordinator
from engine.net.errors import ProtocolViolation

pytestmark = pytest.mark.network

_ADVERTISE = textwrap.dedent("""
    import asyncio, sys
    from engine.net.discovery import LOOPBACK_ONLY, DiscoveryConfig, LanAdvertiser, ServiceAdvert

    async def main():
        advert = ServiceAdvert(role="coordinator", peer_id=sys.argv[1],
                               signalling_url="ws://127.0.0.1:8765/signal", version="0.1.0")
        async with LanAdvertiser(advert, DiscoveryConfig(interfaces=LOOPBACK_ONLY, service_type=sys.argv[2])):
            print("READY", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(main())
""")


def _service_type():
    return f"_pt{secrets.token_hex(4)}._tcp.local."  # one per test: concurrent runs stay apart


def test_a_coordinator_advertised_by_another_process_is_found_within_seconds():
    peer_id, stype = secrets.token_hex(8), _service_type()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", _ADVERTISE, peer_id, stype], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "READY"
        started = time.monotonic()
        found = asyncio.run(find_coordinator(10.0, DiscoveryConfig(interfaces=LOOPBACK_ONLY, service_type=stype)))
        elapsed = time.monotonic() - started
    finally:
        proc.stdin.close()
        proc.wait(timeout=20)
    assert found is not None and elapsed < 5.0
    assert found.advert == ServiceAdvert("coordinator", peer_id, "ws://127.0.0.1:8765/signal", "0.1.0")
    assert found.addresses == ("127.0.0.1",) and found.port == 8765


async def _register_raw(zc, stype, label, properties):
    info = AsyncServiceInfo(stype, f"{label}.{stype}", port=9000, properties=properties,
                            addresses=[socket.inet_aton("127.0.0.1")], server=f"{label}.local.")
    await zc.async_register_service(info)
    return info


def test_browse_ignores_services_with_hostile_txt_records_and_filters_by_role():
    stype = _service_type()
    config = DiscoveryConfig(interfaces=LOOPBACK_ONLY, service_type=stype, resolve_timeout_s=2.0)
    node = ServiceAdvert("node", secrets.token_hex(8), "ws://127.0.0.1:9000/s", "0.1.0")
    coordinator = ServiceAdvert("coordinator", secrets.token_hex(8), "wss://127.0.0.1:9443/s", "0.1.0")

    async def scenario():
        rogue_zc = AsyncZeroconf(interfaces=list(LOOPBACK_ONLY))
        advertisers = [LanAdvertiser(node, config), LanAdvertiser(coordinator, config)]
        registered = await asyncio.gather(
            _register_raw(rogue_zc, stype, "rogue-role", {"role": "admin", "peer": "ab" * 8,
                                                           "url": "ws://127.0.0.1:1/", "ver": "1"}),
            _register_raw(rogue_zc, stype, "rogue-url", {"role": "node", "peer": "ab" * 8,
                                                          "url": "javascript:alert(1)", "ver": "1"}),
            _register_raw(rogue_zc, stype, "rogue-bin", {b"role": b"\xff\xfe", b"peer": b"x"}),
            *(a.start() for a in advertisers))
        try:
            everything = await browse(2.0, config=config)
            only_nodes = await browse(2.0, role="node", config=config)
        finally:
            await asyncio.gather(*(a.close() for a in advertisers))
            for info in registered[:3]:
                await rogue_zc.async_unregister_service(info)
            await rogue_zc.async_close()
        return everything, only_nodes

    everything, only_nodes = asyncio.run(scenario())
    assert sorted(s.advert.peer_id for s in everything) == sorted([node.peer_id, coordinator.peer_id])
    assert [s.advert for s in only_nodes] == [node]


def test_nothing_found_returns_empty_after_the_timeout():
    config = DiscoveryConfig(interfaces=LOOPBACK_ONLY, service_type=_service_type())
    started = time.monotonic()
    assert asyncio.run(find_coordinator(1.0, config)) is None
    assert 0.9 < time.monotonic() - started < 4.0


def test_advert_fields_are_validated():
    for role, peer, url, ver in (("boss", "ab" * 8, "ws://h:1/", "1"), ("node", "XYZ", "ws://h:1/", "1"),
                                 ("node", "ab" * 8, "ftp://h/", "1"), ("node", "ab" * 8, "ws://h:99999/", "1"),
                                 ("node", "ab" * 8, "ws://h:1/", "1 2"),
                                 ("node", "ab" * 8, "ws://h/" + "a" * 300, "1")):
        with pytest.raises(ProtocolViolation):
            ServiceAdvert(role, peer, url, ver)
    with pytest.raises(ProtocolViolation, match="lacks"):
        ServiceAdvert.from_properties({b"role": b"node"})
