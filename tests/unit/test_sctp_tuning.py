"""The SCTP tuning hook: installed on a link's own association, backs off gently on random loss only."""

import asyncio

import pytest

from engine.net.link_config import LinkConfig
from engine.net.peer_link import PeerLink
from engine.net.sctp_tuning import STOCK_SCTP, SctpTuning


def _with_transport(config: LinkConfig, check):
    async def scenario():
        link = PeerLink.create("peer", config)
        try:
            return check(link.pc.sctp)
        finally:
            await link.close()
    return asyncio.run(scenario())


def _mss():
    from aiortc.rtcsctptransport import USERDATA_MAX_LENGTH

    return USERDATA_MAX_LENGTH


def test_links_get_the_tuned_transport_and_stock_config_leaves_aiortc_alone():
    tuned = _with_transport(LinkConfig(), lambda sctp: (type(sctp).__name__, sctp._polis_tuning))
    assert tuned == ("TunedSctpTransport", SctpTuning())
    stock = _with_transport(LinkConfig(sctp=STOCK_SCTP), lambda sctp: type(sctp).__name__)
    assert stock == "RTCSctpTransport"


def _after_loss(queue_delay_s: float, flows: int = 8):
    def check(sctp):
        sctp._polis_min_rtt_s, sctp._polis_recent_rtt_s = 0.080, 0.080 + queue_delay_s
        before = 100 * _mss()
        sctp._cwnd = sctp._ssthresh = before // 2  # what aiortc's Reno just did on a loss report
        sctp._fast_recovery_exit = 1234
        sctp._polis_adjust(before, None, 10 * _mss())
        return before, sctp._cwnd, sctp._ssthresh
    return _with_transport(LinkConfig(sctp=SctpTuning(virtual_flows=flows)), check)


def test_a_random_loss_with_an_empty_queue_shrinks_the_window_by_one_over_two_n():
    before, cwnd, ssthresh = _after_loss(queue_delay_s=0.002)
    assert cwnd == ssthresh == int(before * (1 - 1 / 16))


def test_a_loss_behind_a_built_up_queue_is_congestion_and_halves_like_reno():
    before, cwnd, ssthresh = _after_loss(queue_delay_s=0.030)
    assert cwnd == ssthresh == before // 2


def test_congestion_avoidance_grows_n_segments_per_round_trip_without_a_queue_and_one_with_it():
    def grow(queue_delay_s):
        def check(sctp):
            sctp._polis_min_rtt_s, sctp._polis_recent_rtt_s = 0.050, 0.050 + queue_delay_s
            before = 40 * _mss()
            sctp._cwnd, sctp._ssthresh, sctp._fast_recovery_exit = before + _mss(), 20 * _mss(), None
            sctp._polis_adjust(before, None, 20 * _mss())
            return (sctp._cwnd - before) // _mss()
        return _with_transport(LinkConfig(sctp=SctpTuning(virtual_flows=6)), check)

    assert grow(0.001) == 6
    assert grow(0.050) == 1


def test_slow_start_and_fast_recovery_are_left_to_aiortc():
    def check(sctp):
        sctp._polis_min_rtt_s = sctp._polis_recent_rtt_s = 0.05
        sctp._cwnd, sctp._ssthresh, sctp._fast_recovery_exit = 11 * _mss(), 64 * _mss(), None
        sctp._polis_adjust(10 * _mss(), None, 64 * _mss())  # slow start: one MSS per acked MSS, as stock
        slow_start = sctp._cwnd
        sctp._cwnd, sctp._fast_recovery_exit = 30 * _mss(), 99
        sctp._polis_adjust(60 * _mss(), 42, 30 * _mss())  # already recovering: no second back-off
        return slow_start, sctp._cwnd
    assert _with_transport(LinkConfig(), check) == (11 * _mss(), 30 * _mss())


def test_the_retransmission_timeout_keeps_its_margin_over_the_round_trip_and_rtt_samples_are_kept():
    def check(sctp):
        for sample in (0.200, 0.190, 0.195):
            sctp._update_rto(sample)
        return sctp._rto, sctp._srtt, sctp._rttvar, sctp._polis_min_rtt_s
    rto, srtt, rttvar, min_rtt = _with_transport(LinkConfig(sctp=SctpTuning(rto_margin_s=0.15)), check)
    assert 4 * rttvar > 0.15 and rto == pytest.approx(srtt + 4 * rttvar) and min_rtt == pytest.approx(0.190)
    steady = _with_transport(LinkConfig(sctp=SctpTuning(rto_margin_s=0.15)),
                             lambda s: [s._update_rto(0.2) for _ in range(60)] and (s._rto, s._srtt))
    assert steady[0] == pytest.approx(steady[1] + 0.15)  # a steady path: the margin, not a second
    stock_rto = _with_transport(LinkConfig(sctp=STOCK_SCTP), lambda s: (s._update_rto(0.03), s._rto)[1])
    assert stock_rto == pytest.approx(1.0)


def test_tuning_settings_are_validated():
    for bad in ({"virtual_flows": 0}, {"virtual_flows": 65}, {"rto_margin_s": 0.001}, {"rto_margin_s": 2.0},
                {"congestion_delay_ms": -1}):
        with pytest.raises(ValueError):
            SctpTuning(**bad)
