"""The SCTP tuning hook: a link's own association follows the bottleneck window; stock config leaves aiortc alone."""

import asyncio
import time

import pytest

from engine.net.bottleneck_control import BottleneckControl
from engine.net.link_config import LinkConfig
from engine.net.peer_link import PeerLink
from engine.net.sctp_tuning import STOCK_SCTP, SctpTuning, send_rate


def _with_transport(config: LinkConfig, check):
    async def scenario():
        link = PeerLink.create("peer", config)
        try:
            result = check(link.pc.sctp)
            return await result if asyncio.iscoroutine(result) else result
        finally:
            await link.close()
    return asyncio.run(scenario())


def _mss():
    from aiortc.rtcsctptransport import USERDATA_MAX_LENGTH

    return USERDATA_MAX_LENGTH


def _chunk(tsn: int, *, sent_ago_s: float | None = None, acked: bool = False, sent_count: int = 1):
    from aiortc.rtcsctptransport import DataChunk

    from engine.net.bottleneck_control import SendStamp

    chunk = DataChunk()
    chunk.tsn, chunk.user_data = tsn, b"x" * _mss()
    chunk._abandoned, chunk._acked, chunk._book_size, chunk._expiry = False, acked, _mss(), None
    chunk._in_flight, chunk._max_retransmits, chunk._misses = not acked, None, 0
    chunk._retransmit, chunk._sent_count, chunk._sent_time = False, sent_count, time.time()
    if sent_ago_s is not None:
        sent = time.monotonic() - sent_ago_s
        chunk._polis_stamp = SendStamp(0, sent, sent, sent, False)
    return chunk


def test_links_get_the_tuned_transport_and_stock_config_leaves_aiortc_alone():
    tuned = _with_transport(LinkConfig(), lambda sctp: (type(sctp).__name__, sctp._polis_tuning,
                                                        type(sctp._polis_cc).__name__, sctp._cwnd))
    assert tuned == ("TunedSctpTransport", SctpTuning(), "BottleneckControl", 10 * _mss())
    stock = _with_transport(LinkConfig(sctp=STOCK_SCTP), lambda sctp: type(sctp).__name__)
    assert stock == "RTCSctpTransport"
    reno_with_rto = _with_transport(LinkConfig(sctp=SctpTuning(controller="stock")),
                                    lambda sctp: (type(sctp).__name__, sctp._polis_cc))
    assert reno_with_rto == ("TunedSctpTransport", None)  # Linux's RTO over aiortc's own window


def test_after_each_sack_the_window_is_the_controllers_and_acknowledged_chunks_feed_it():
    async def check(sctp):
        cc: BottleneckControl = sctp._polis_cc
        acked, lost = _chunk(1, sent_ago_s=0.05), _chunk(2, sent_ago_s=0.05)
        sctp._flight_size = 2 * _mss()
        sctp._cwnd = 999  # what aiortc's Reno just did
        sctp._polis_in_sack = True
        sctp._flight_size_decrease(acked)
        lost._retransmit = True
        sctp._flight_size_decrease(lost)
        counted = cc.delivered, cc._round_lost
        await sctp._data_channel_flush()
        return *counted, cc.min_rtt, sctp._cwnd, cc.window, sctp._polis_in_sack
    delivered, lost, min_rtt, cwnd, window, in_sack = _with_transport(LinkConfig(), check)
    assert delivered == lost == _mss() and min_rtt == pytest.approx(0.05, abs=0.01)
    assert cwnd == window and window > 999 and not in_sack


def test_chunks_leaving_the_flight_outside_a_sack_say_nothing_about_the_path():
    def check(sctp):
        sctp._flight_size = _mss()
        sctp._flight_size_decrease(_chunk(1, sent_ago_s=0.05))  # e.g. marked by a timeout
        return sctp._polis_cc.delivered, sctp._flight_size
    assert _with_transport(LinkConfig(), check) == (0, 0)


def test_a_retransmission_is_struck_only_by_sacks_of_chunks_sent_after_it(monkeypatch):
    from aiortc.rtcsctptransport import RTCSctpTransport

    async def no_wire(self, chunk):
        return None
    monkeypatch.setattr(RTCSctpTransport, "_send_chunk", no_wire)

    async def check(sctp):
        first, again = _chunk(1), _chunk(2, sent_count=2)
        sctp._flight_size = 50 * _mss()
        await sctp._send_chunk(first)
        await sctp._send_chunk(again)
        return first._misses, again._misses, again._polis_stamp.sent_time > 0
    assert _with_transport(LinkConfig(), check) == (0, -49, True)


def test_a_timeout_resends_only_chunks_older_than_a_round_trip_and_never_reported_ones():
    async def check(sctp):
        old, young, reported = _chunk(1, sent_ago_s=2.0), _chunk(2, sent_ago_s=0.01), _chunk(3, acked=True)
        sctp._sent_queue.extend([old, young, reported])
        sctp._flight_size = 2 * _mss()
        sctp._srtt = 0.1
        sctp._t3_expired()
        await asyncio.sleep(0)
        return old._retransmit, young._retransmit, reported._retransmit, young._in_flight, sctp._flight_size
    old, young, reported, young_in_flight, flight = _with_transport(LinkConfig(), check)
    assert old and not young and not reported
    assert young_in_flight and flight == _mss()  # the young chunk is still on its way


def test_the_retransmission_timeout_keeps_its_margin_over_the_round_trip():
    def check(sctp):
        for sample in (0.200, 0.190, 0.195):
            sctp._update_rto(sample)
        return sctp._rto, sctp._srtt, sctp._rttvar
    rto, srtt, rttvar = _with_transport(LinkConfig(sctp=SctpTuning(rto_margin_s=0.15)), check)
    assert 4 * rttvar > 0.15 and rto == pytest.approx(srtt + 4 * rttvar)
    steady = _with_transport(LinkConfig(sctp=SctpTuning(rto_margin_s=0.15)),
                             lambda s: [s._update_rto(0.2) for _ in range(60)] and (s._rto, s._srtt))
    assert steady[0] == pytest.approx(steady[1] + 0.15)  # a steady path: the margin, not a second
    stock_rto = _with_transport(LinkConfig(sctp=STOCK_SCTP), lambda s: (s._update_rto(0.03), s._rto)[1])
    assert stock_rto == pytest.approx(1.0)


def test_a_links_send_rate_is_the_controllers_estimate_once_it_has_one():
    async def scenario(config):
        link = PeerLink.create("peer", config)
        try:
            before = send_rate(link.pc)
            cc = getattr(link.pc.sctp, "_polis_cc", None)
            if cc is None:
                return before, send_rate(link.pc)
            cc._bw_best = (1.5e6, False)
            lower_bound = send_rate(link.pc)
            cc._path_rate, cc._path_rate_time = 2.0e6, time.monotonic()
            return before, lower_bound, send_rate(link.pc)
        finally:
            await link.close()
    assert asyncio.run(scenario(LinkConfig())) == (None, (1.5e6, False), (2.0e6, True))
    assert asyncio.run(scenario(LinkConfig(sctp=STOCK_SCTP))) == (None, None)


def test_tuning_settings_are_validated():
    for bad in ({"controller": "cubic"}, {"cruise_gain": 0.5}, {"startup_gain": 5.0}, {"rto_margin_s": 0.001},
                {"rto_margin_s": 2.0}, {"congestion_delay_ms": -1}, {"congestion_loss_percent": 0}):
        with pytest.raises(ValueError):
            SctpTuning(**bad)
