import asyncio
import math
import random
import socket
import struct
import time

import pytest

from engine.net.wan_emulator import (
    DirectionCounters,
    ImpairmentProfile,
    PacketShaper,
    UdpImpairmentRelay,
    rewrite_sdp_candidates,
    sdp_host_candidates,
)


def _shaper(seed=0, **profile):
    counters = DirectionCounters()
    return PacketShaper(ImpairmentProfile(**profile), random.Random(seed), counters), counters


# ------------------------------------------------------------- shaper (no sockets)

def test_token_bucket_paces_a_burst_at_the_line_rate_after_the_bucket_empties():
    shaper, counters = _shaper(bandwidth_mbps=1.0, burst_bytes=2500, queue_limit_bytes=10 ** 9)
    rate = 1e6 / 8
    departures = [shaper.admit(1250, 0.0) for _ in range(100)]
    assert departures[:2] == [0.0, 0.0]  # the bucket's 2500 bytes go at once
    gaps = [b - a for a, b in zip(departures[2:], departures[3:])]
    assert all(math.isclose(g, 1250 / rate) for g in gaps)
    assert math.isclose(departures[-1], (100 * 1250 - 2500) / rate)
    assert counters.received == 100 and counters.dropped == 0


def test_token_bucket_refills_while_idle_but_never_beyond_its_depth():
    shaper, _ = _shaper(bandwidth_mbps=1.0, burst_bytes=2500, queue_limit_bytes=10 ** 9)
    for _ in range(10):
        shaper.admit(1250, 0.0)
    last = shaper.admit(1250, 0.0)
    later = last + 10.0  # a long idle spell refills 2500 bytes, not 1.25 MB
    assert [shaper.admit(1250, later) for _ in range(3)] == [later, later, later + 1250 / 125000]


def test_a_full_queue_tail_drops_and_recovers_once_drained():
    shaper, counters = _shaper(bandwidth_mbps=1.0, burst_bytes=1500, queue_limit_bytes=12_500)
    results = [shaper.admit(1250, 0.0) for _ in range(50)]
    admitted = [r for r in results if r is not None]
    assert counters.dropped_queue == 50 - len(admitted) > 0
    assert max(admitted) <= 12_500 / 125000 + 1e-9  # nobody waits longer than the queue allows
    assert shaper.admit(1250, 1.0) == 1.0  # drained: accepted at once


def test_delay_and_jitter_stay_within_bounds_and_keep_order_unless_reordering_is_allowed():
    ordered, _ = _shaper(seed=1, delay_ms=40, jitter_ms=10)
    times = [i * 1e-4 for i in range(2000)]
    deliveries = [ordered.admit(100, t) for t in times]
    assert all(b >= a for a, b in zip(deliveries, deliveries[1:]))
    assert all(0.030 - 1e-9 <= d - t <= 0.050 + 1e-4 for d, t in zip(deliveries, times))
    reordering, _ = _shaper(seed=1, delay_ms=40, jitter_ms=10, allow_reorder=True)
    free = [reordering.admit(100, t) for t in times]
    assert any(b < a for a, b in zip(free, free[1:]))
    assert all(0.030 - 1e-9 <= d - t <= 0.050 + 1e-9 for d, t in zip(free, times))


def test_loss_rate_matches_the_profile_within_statistical_tolerance():
    n, p = 20_000, 0.05
    shaper, counters = _shaper(seed=2, loss_percent=100 * p)
    for i in range(n):
        shaper.admit(100, float(i))
    assert abs(counters.dropped_loss - n * p) < 5 * math.sqrt(n * p * (1 - p))


def test_profiles_reject_nonsense():
    for bad in ({"delay_ms": -1}, {"loss_percent": 101}, {"bandwidth_mbps": 0}, {"burst_bytes": 100}):
        with pytest.raises(ValueError):
            ImpairmentProfile(**bad)


# ------------------------------------------------------------------------- SDP

_SDP = "\r\n".join([
    "v=0", "o=- 1 1 IN IP4 0.0.0.0", "s=-", "t=0 0",
    "m=application 40001 UDP/DTLS/SCTP webrtc-datachannel", "c=IN IP4 192.0.2.2", "a=mid:0",
    "a=candidate:1 1 udp 2130706431 192.0.2.2 40001 typ host",
    "a=candidate:2 1 udp 2130706431 fd00::2 40002 typ host",
    "a=candidate:3 1 udp 1694498815 203.0.113.9 50000 typ srflx raddr 192.0.2.2 rport 40001",
    "a=end-of-candidates", "a=setup:actpass", ""])


def test_sdp_rewrite_points_host_candidates_at_the_relay_and_drops_every_other_path():
    assert sdp_host_candidates(_SDP) == [("192.0.2.2", 40001)]
    out = rewrite_sdp_candidates(_SDP, {("192.0.2.2", 40001): ("127.0.0.1", 5555)})
    lines = out.split("\r\n")
    assert [line for line in lines if line.startswith("a=candidate")] == [
        "a=candidate:1 1 udp 2130706431 127.0.0.1 5555 typ host"]
    assert "c=IN IP4 127.0.0.1" in lines
    assert "m=application 5555 UDP/DTLS/SCTP webrtc-datachannel" in lines
    assert "fd00::2" not in out and "203.0.113.9" not in out and out.endswith("\r\n")


# ---------------------------------------------------------- real UDP sockets

class _Sink(asyncio.DatagramProtocol):
    def __init__(self):
        self.packets = []

    def datagram_received(self, data, addr):
        self.packets.append((time.monotonic(), data, addr))


async def _endpoint():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    sock.bind(("127.0.0.1", 0))
    transport, sink = await asyncio.get_running_loop().create_datagram_endpoint(_Sink, sock=sock)
    return transport, sink, sock.getsockname()


async def _wait_for(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


@pytest.mark.network
def test_packets_cross_the_relay_with_the_configured_delay_and_see_only_stand_in_addresses():
    async def scenario():
        a_tr, a_sink, a_addr = await _endpoint()
        b_tr, b_sink, b_addr = await _endpoint()
        async with UdpImpairmentRelay(ImpairmentProfile(delay_ms=40), ImpairmentProfile(delay_ms=10)) as relay:
            a_standin = await relay.add_endpoint(a_addr, "a")
            b_standin = await relay.add_endpoint(b_addr, "b")
            for _ in range(20):
                a_tr.sendto(struct.pack("!d", time.monotonic()), b_standin)
                await asyncio.sleep(0.005)
            await _wait_for(lambda: len(b_sink.packets) == 20, 5)
            b_tr.sendto(b"reply", b_sink.packets[0][2])
            await _wait_for(lambda: a_sink.packets, 5)
            stats = relay.stats()
        a_tr.close()
        b_tr.close()
        return a_standin, b_standin, a_sink.packets, b_sink.packets, stats

    a_standin, b_standin, at_a, at_b, stats = asyncio.run(scenario())
    one_way = sorted(t - struct.unpack("!d", data)[0] for t, data, _ in at_b)
    assert len(one_way) == 20 and one_way[0] >= 0.040 and one_way[10] < 0.040 + 0.100
    assert {addr for _, _, addr in at_b} == {a_standin}
    assert [(data, addr) for _, data, addr in at_a] == [(b"reply", b_standin)]
    assert stats["a_to_b"]["forwarded"] == 20 and stats["b_to_a"]["forwarded"] == 1


@pytest.mark.network
def test_relay_respects_the_rate_limit_and_drops_the_configured_share():
    async def scenario(profile, count, size):
        a_tr, _, a_addr = await _endpoint()
        b_tr, b_sink, b_addr = await _endpoint()
        async with UdpImpairmentRelay(profile, seed=3) as relay:
            await relay.add_endpoint(a_addr, "a")
            target = await relay.add_endpoint(b_addr, "b")
            for i in range(count):
                a_tr.sendto(bytes(size), target)
                if i % 50 == 49:
                    await asyncio.sleep(0)
            await _wait_for(lambda: relay.counters["a_to_b"].received == count, 5)
            expected = relay.counters["a_to_b"].received - relay.counters["a_to_b"].dropped
            await _wait_for(lambda: len(b_sink.packets) >= expected, 10)
            stats = relay.stats()
        a_tr.close()
        b_tr.close()
        return b_sink.packets, stats

    limit_mbps = 4.0
    packets, stats = asyncio.run(scenario(ImpairmentProfile(bandwidth_mbps=limit_mbps, queue_limit_bytes=10 ** 6),
                                          300, 1000))
    assert len(packets) == 300 and stats["a_to_b"]["dropped"] == 0
    span = packets[-1][0] - packets[0][0]
    measured_mbps = 299 * 1000 * 8 / span / 1e6
    assert 0.5 * limit_mbps < measured_mbps < 1.1 * limit_mbps

    n, p = 1000, 0.2
    packets, stats = asyncio.run(scenario(ImpairmentProfile(loss_percent=100 * p), n, 200))
    counters = stats["a_to_b"]
    assert counters["received"] == n and counters["forwarded"] == len(packets) == n - counters["dropped_loss"]
    assert abs(counters["dropped_loss"] - n * p) < 5 * math.sqrt(n * p * (1 - p))


@pytest.mark.network
def test_datagrams_from_unregistered_sources_are_dropped():
    async def scenario():
        a_tr, _, a_addr = await _endpoint()
        stranger_tr, _, _ = await _endpoint()
        b_tr, b_sink, b_addr = await _endpoint()
        async with UdpImpairmentRelay(ImpairmentProfile()) as relay:
            await relay.add_endpoint(a_addr, "a")
            target = await relay.add_endpoint(b_addr, "b")
            stranger_tr.sendto(b"let me in", target)
            a_tr.sendto(b"hello", target)
            await _wait_for(lambda: b_sink.packets and relay.dropped_unknown, 5)
            stats = relay.stats()
        for tr in (a_tr, stranger_tr, b_tr):
            tr.close()
        return b_sink.packets, stats

    packets, stats = asyncio.run(scenario())
    assert [data for _, data, _ in packets] == [b"hello"]
    assert stats["unknown"]["dropped"] == 1


@pytest.mark.network
def test_relay_pair_learns_both_peers_from_traffic_and_shows_each_the_address_it_was_told():
    from engine.net.wan_relay_pair import UdpRelayPair

    async def scenario():
        a_tr, a_sink, _ = await _endpoint()
        b_tr, b_sink, _ = await _endpoint()
        async with UdpRelayPair(ImpairmentProfile(delay_ms=20)) as pair:
            a_tr.sendto(b"too early", pair.a_sends_to)  # B not known yet: nowhere to go
            await _wait_for(lambda: pair.waiting_for_peer, 5)
            b_tr.sendto(b"hello a", pair.b_sends_to)
            await _wait_for(lambda: a_sink.packets, 5)
            a_tr.sendto(b"hello b", pair.a_sends_to)
            await _wait_for(lambda: b_sink.packets, 5)
            stats = pair.stats()
            advertised = pair.advertised_by("a"), pair.advertised_by("b")
        a_tr.close()
        b_tr.close()
        return pair, a_sink.packets, b_sink.packets, stats, advertised

    pair, at_a, at_b, stats, (by_a, by_b) = asyncio.run(scenario())
    assert [(d, addr) for _, d, addr in at_a] == [(b"hello a", pair.a_sends_to)]
    assert [(d, addr) for _, d, addr in at_b] == [(b"hello b", pair.b_sends_to)]
    assert (by_a, by_b) == (pair.b_sends_to, pair.a_sends_to)
    assert stats["unknown"]["dropped"] == 1 and stats["a_to_b"]["forwarded"] == 1


def test_static_sdp_filter_keeps_one_candidate_pointed_at_the_relay():
    from engine.net.wan_relay_pair import static_sdp_filter

    out = static_sdp_filter(("127.0.0.1", 7777))(_SDP)
    assert sdp_host_candidates(out) == [("127.0.0.1", 7777)]
    assert out.count("a=candidate") == 1


@pytest.mark.network
def test_a_paused_relay_drops_both_ways_including_packets_in_flight_and_carries_again_once_resumed():
    async def scenario():
        a_tr, a_sink, a_addr = await _endpoint()
        b_tr, b_sink, b_addr = await _endpoint()
        async with UdpImpairmentRelay(ImpairmentProfile(delay_ms=200)) as relay:
            await relay.add_endpoint(a_addr, "a")
            to_b = await relay.add_endpoint(b_addr, "b")
            to_a = relay.stand_in(a_addr)
            a_tr.sendto(b"in flight", to_b)
            await _wait_for(lambda: relay.counters["a_to_b"].received == 1, 5)
            relay.pause()  # the packet is still on its 200 ms way: it is lost with the line
            a_tr.sendto(b"while paused", to_b)
            b_tr.sendto(b"while paused too", to_a)
            await _wait_for(lambda: relay.counters["b_to_a"].received + relay.counters["a_to_b"].dropped_paused >= 3, 5)
            await asyncio.sleep(0.3)
            during = (len(a_sink.packets), len(b_sink.packets), relay.paused)
            relay.resume()
            a_tr.sendto(b"after", to_b)
            await _wait_for(lambda: b_sink.packets, 5)
            stats = relay.stats()
        a_tr.close()
        b_tr.close()
        return during, b_sink.packets, stats

    during, at_b, stats = asyncio.run(scenario())
    assert during == (0, 0, True)
    assert [data for _, data, _ in at_b] == [b"after"]
    assert stats["a_to_b"]["dropped_paused"] == 2 and stats["b_to_a"]["dropped_paused"] == 1
    assert stats["a_to_b"]["dropped"] == 2 and stats["a_to_b"]["forwarded"] == 1


@pytest.mark.network
def test_a_paused_relay_pair_drops_everything_until_resumed():
    from engine.net.wan_relay_pair import UdpRelayPair

    async def scenario():
        a_tr, a_sink, _ = await _endpoint()
        b_tr, b_sink, _ = await _endpoint()
        async with UdpRelayPair(ImpairmentProfile()) as pair:
            b_tr.sendto(b"hello a", pair.b_sends_to)
            await _wait_for(lambda: pair.waiting_for_peer, 5)
            a_tr.sendto(b"hello b", pair.a_sends_to)
            await _wait_for(lambda: b_sink.packets, 5)
            pair.pause()
            b_tr.sendto(b"lost", pair.b_sends_to)
            await _wait_for(lambda: pair.counters["b_to_a"].dropped_paused, 5)
            pair.resume()
            b_tr.sendto(b"found", pair.b_sends_to)
            await _wait_for(lambda: a_sink.packets, 5)
            stats = pair.stats()
        a_tr.close()
        b_tr.close()
        return a_sink.packets, stats

    at_a, stats = asyncio.run(scenario())
    assert [data for _, data, _ in at_a] == [b"found"]
    assert stats["b_to_a"]["dropped_paused"] == 1 and stats["b_to_a"]["forwarded"] == 1
