import asyncio
import socket
import time

import pytest

from engine.net.tcp_delay_proxy import TcpDelayProxy
from engine.net.wan_emulator import ImpairmentProfile
from engine.net.wan_hub import HubStats, Refused, StatsRequest, WanHub, ask_hub, relay_sdp
from engine.net.wan_profiles import WanProfile

pytestmark = pytest.mark.network

PROFILES = {
    "near": WanProfile(rtt_ms=0, up_mbps=1000, down_mbps=1000),
    "far": WanProfile(rtt_ms=200, up_mbps=1000, down_mbps=1000),
    "lossy": WanProfile(rtt_ms=0, loss_percent=50, up_mbps=1000, down_mbps=1000),
}

SDP = ("v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\nm=application {port} UDP/DTLS/SCTP webrtc-datachannel\r\n"
       "c=IN IP4 127.0.0.1\r\na=candidate:1 1 udp 2130706431 127.0.0.1 {port} typ host\r\n")


def _udp() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.setblocking(False)
    return s


async def _recv(sock: socket.socket, timeout_s: float = 2.0) -> tuple[bytes, tuple]:
    return await asyncio.wait_for(asyncio.get_running_loop().sock_recvfrom(sock, 2048), timeout_s)


def test_each_link_is_shaped_by_its_two_ends_profiles_and_seen_at_the_stand_in():
    async def main():
        async with WanHub(PROFILES) as hub:
            a, b, c = _udp(), _udp(), _udp()
            [sa] = await hub.register("near", [a.getsockname()])
            [sb] = await hub.register("near", [b.getsockname()])
            [sc] = await hub.register("far", [c.getsockname()])
            a.sendto(b"to-b", sb)
            t0 = time.monotonic()
            data, src = await _recv(b)
            near_s = time.monotonic() - t0
            assert data == b"to-b" and src == sa  # b sees a only at a's stand-in
            a.sendto(b"to-c", sc)
            t0 = time.monotonic()
            data, src = await _recv(c)
            far_s = time.monotonic() - t0
            assert data == b"to-c" and src == sa
            assert near_s < 0.04 and far_s >= 0.05 - 0.005  # (0 + 200) / 4 ms one way
            stats = hub.stats()
            assert stats["kinds"]["near->near"]["forwarded"] == 1
            assert stats["kinds"]["near->far"]["forwarded"] == 1
            assert stats["endpoints"] == 3
            for s in (a, b, c):
                s.close()
    asyncio.run(main())


def test_loss_of_a_lossy_end_applies_and_unknown_senders_are_dropped():
    async def main():
        async with WanHub(PROFILES, seed=3) as hub:
            a, b, stranger = _udp(), _udp(), _udp()
            await hub.register("lossy", [a.getsockname()])
            [sb] = await hub.register("lossy", [b.getsockname()])
            for i in range(200):
                a.sendto(b"x%d" % i, sb)
            stranger.sendto(b"nope", sb)
            await asyncio.sleep(0.3)
            stats = hub.stats()
            assert 60 < stats["total"]["dropped_loss"] < 140  # 50 % of 200
            assert stats["total"]["forwarded"] + stats["total"]["dropped_loss"] == 200
            assert stats["dropped_unknown"] == 1
            for s in (a, b, stranger):
                s.close()
    asyncio.run(main())


def test_a_node_rewrites_its_sdp_through_the_control_address_and_bad_requests_are_refused():
    async def main():
        async with WanHub(PROFILES) as hub:
            a = _udp()
            port = a.getsockname()[1]
            sdp = await relay_sdp(hub.control_address, "far", SDP.format(port=port))
            stand_in = hub._by_real[("127.0.0.1", port)].local
            assert f"127.0.0.1 {stand_in[1]} typ host" in sdp and f" {port} typ host" not in sdp
            assert f"m=application {stand_in[1]} " in sdp
            with pytest.raises(OSError, match="unknown WAN profile 'mars'"):
                await relay_sdp(hub.control_address, "mars", SDP.format(port=port))
            reader, writer = await asyncio.open_connection(*hub.control_address)
            writer.write(b'{"type": "register", "profile": "far", "endpoints": [["127.0.0.1", 0]]}\n')
            answer = await reader.readline()
            assert b"refused" in answer  # port 0 is out of bounds
            writer.close()
            stats = await ask_hub(hub.control_address, StatsRequest())
            assert isinstance(stats, HubStats) and stats.stats["refused_requests"] == 2
            assert not isinstance(stats, Refused)
            a.close()
    asyncio.run(main())


def test_the_tcp_proxy_delays_each_direction_and_paces_at_the_line_rate():
    async def main():
        async def echo(reader, writer):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        target = server.sockets[0].getsockname()[:2]
        proxy = TcpDelayProxy(target, ImpairmentProfile(delay_ms=40), ImpairmentProfile(delay_ms=40,
                                                                                         bandwidth_mbps=8))
        host, port = await proxy.start()
        reader, writer = await asyncio.open_connection(host, port)
        t0 = time.monotonic()
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        rtt = time.monotonic() - t0
        assert 0.08 <= rtt < 0.3
        blob = b"y" * 200_000  # 1.6 Mbit at 8 Mbit/s down: >= 0.2 s, plus the round trip
        t0 = time.monotonic()
        writer.write(blob)
        assert await reader.readexactly(len(blob)) == blob
        assert time.monotonic() - t0 >= 0.2 + 0.08 - 0.01
        writer.close()
        await proxy.close()
        server.close()
        assert proxy.counters.bytes_up == proxy.counters.bytes_down == len(blob) + 4
    asyncio.run(main())


def test_the_tcp_proxy_refuses_loss():
    with pytest.raises(ValueError, match="loss"):
        TcpDelayProxy(("127.0.0.1", 1), ImpairmentProfile(loss_percent=1))
