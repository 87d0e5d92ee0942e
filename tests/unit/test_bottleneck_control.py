"""The bottleneck window: measures rate and round trip, ignores random loss, yields to congestion.

Most tests drive the controller over a simulated path (``tests.support.path_sim``): a bottleneck
of 1 MB/s with a router queue of one round trip, the emulated WAN's shape.
"""

import math

import pytest

from engine.net.bottleneck_control import CONGESTION_BETA, CRUISE, STARTUP, BottleneckControl, SendStamp
from tests.support.path_sim import MSS, simulate

RATE = 1e6  # bytes per second


def _run(rtt_s: float, loss: float = 0.0, **kwargs):
    control = BottleneckControl(MSS)
    result = simulate(control, rate_bytes_s=RATE, rtt_s=rtt_s, queue_bytes=RATE * rtt_s, loss=loss,
                      seconds=kwargs.pop("seconds", 20.0), count_after_s=kwargs.pop("count_after_s", 5.0), **kwargs)
    return control, result


def test_a_long_lossless_path_runs_near_its_line_without_overflowing_a_one_round_trip_queue():
    control, result = _run(0.2)
    assert result.rate_bytes_s >= 0.92 * RATE
    assert result.queue_drops == 0 and result.max_queue_bytes < RATE * 0.2  # slow start's overshoot stayed inside
    assert control.mode == CRUISE and control.bw == pytest.approx(RATE, rel=0.05)
    assert control.min_rtt == pytest.approx(0.2 + MSS / RATE, rel=0.02)


@pytest.mark.parametrize("rtt_s,loss", [(0.2, 0.001), (0.2, 0.01), (0.2, 0.02), (0.08, 0.01), (0.02, 0.02)])
def test_random_loss_leaves_the_window_alone_so_the_line_stays_full(rtt_s, loss):
    control, result = _run(rtt_s, loss)
    assert result.random_drops > 0
    assert result.rate_bytes_s >= 0.9 * RATE  # Reno would run at MSS / RTT x 1.22 / sqrt(loss): 5-22 % here
    assert control.congested_rounds == 0


def test_startup_reaches_the_line_of_a_200_ms_path_within_three_seconds():
    control, result = _run(0.2, seconds=3.0, count_after_s=2.5)
    assert control.mode == CRUISE and result.rate_bytes_s >= 0.85 * RATE


def test_the_window_cruises_at_its_gain_over_the_measured_bandwidth_delay_product():
    control, result = _run(0.08)
    bdp = control.bw * control.min_rtt
    steady = sorted(result.windows[-2000:])
    median = steady[len(steady) // 2]
    assert median == pytest.approx(control.cruise_gain * bdp + 4 * MSS, rel=0.05)
    assert min(steady) >= 0.7 * bdp  # the low round of the cycle, where the queue empties


def test_an_idle_sender_measures_only_a_lower_bound_and_says_so():
    control, result = _run(0.1, app_limit_bytes=20 * MSS)
    assert control.bw == pytest.approx(20 * MSS / 0.1, rel=0.1) and not control.bw_is_ceiling
    busy, _ = _run(0.1)
    assert busy.bw_is_ceiling


def _cruising(min_rtt=0.1, bw=RATE) -> BottleneckControl:
    control = BottleneckControl(MSS)
    control.mode = CRUISE
    control.min_rtt, control._min_rtt_time = min_rtt, 0.0
    control._bw_rounds = {0: (bw, True)}
    control._bw_best = (bw, True)
    return control


def _round(control: BottleneckControl, *, now: float, rtt_s: float, delivered: int, lost: int, in_flight: int) -> int:
    """One round's events: ``delivered`` bytes acknowledged at ``rtt_s``, ``lost`` bytes declared lost."""
    control.on_rtt(rtt_s, now)
    control.on_lost(lost)
    stamp = SendStamp(control.delivered, now - rtt_s, now - rtt_s, now - rtt_s, False)
    control.on_delivered(stamp, delivered, now)
    return control.on_ack_done(now, in_flight)


def test_loss_behind_a_queue_is_congestion_and_caps_the_window_below_what_was_in_flight():
    control = _cruising()
    window = _round(control, now=1.0, rtt_s=0.16, delivered=90_000, lost=10_000, in_flight=150_000)
    assert control.congested_rounds == 1
    assert window <= CONGESTION_BETA * 150_000 + 1
    assert control.bw <= CONGESTION_BETA * RATE * 1.01


def test_loss_without_a_queue_is_random_and_changes_nothing():
    def windows(lost: int) -> list[int]:
        control = _cruising()
        out = [_round(control, now=1.0 + 0.1 * k, rtt_s=0.1, delivered=100_000, lost=lost, in_flight=120_000)
               for k in range(4)]
        assert control.congested_rounds == 0
        return out
    assert windows(lost=10_000) == windows(lost=0)


def test_rate_samples_shorter_than_a_round_trip_are_ignored():
    control = _cruising(min_rtt=0.1, bw=1000.0)
    stamp = SendStamp(control.delivered, 0.95, 0.95, 0.95, False)
    control.on_delivered(stamp, 1_000_000, 1.0)  # 1 MB "in" 50 ms: bunched acknowledgements
    control.on_ack_done(1.0, 0)
    assert control.bw == 1000.0


def test_the_round_trip_estimate_forgets_old_minima_after_its_window():
    control = BottleneckControl(MSS)
    control.on_rtt(0.05, 0.0)
    control.on_rtt(0.08, 5.0)
    assert control.min_rtt == 0.05
    control.on_rtt(0.08, 11.0)
    assert control.min_rtt == 0.08
    assert control.mode == STARTUP and math.isinf(BottleneckControl(MSS).min_rtt)


def test_a_pushed_path_leaves_a_path_rate_that_outlives_the_rate_window_and_an_idle_one_none():
    control, result = _run(0.1, seconds=6.0)
    end = 6.0
    assert control.path_rate(end) == pytest.approx(RATE, rel=0.05)
    assert control.path_rate(end + 30) == pytest.approx(RATE, rel=0.05)
    assert control.path_rate(end + 120) is None
    idle, _ = _run(0.1, app_limit_bytes=20 * MSS, seconds=6.0)
    assert idle.path_rate(end) is None
