"""A congestion window from the path's measured bottleneck rate and round trip (BBR-like, window only).

A Reno window grows by guessing (one segment a round trip) and halves on every loss:
at 200 ms that takes tens of seconds to fill a 20 Mbit/s line, random loss keeps it
far below, and slow start's doubling overshoots a queue of one round trip by up to
twice the line's capacity. :class:`BottleneckControl` instead *measures* the path,
as BBR does (Cardwell et al., 2016), and sets the window to what the path holds:

* **delivery rate** (draft-cheng-iccrg-delivery-rate-estimation): every packet is
  stamped when sent with the bytes delivered so far and when; its acknowledgement
  gives one sample, bytes delivered in between over the longer of the send and ack
  intervals. A sample taken while the sender had nothing more to send
  (*app-limited*) only counts if it beats the estimate;
* **bottleneck rate** ``bw``: the largest sample of the last ``BW_WINDOW_ROUNDS``
  round trips (a *round* ends when a packet sent after its start is acknowledged);
* **propagation round trip** ``min_rtt``: the least sample of the last
  ``MIN_RTT_WINDOW_S`` seconds;
* **window** = ``gain x bw x min_rtt`` + ``EXTRA_SEGMENTS``: the bandwidth-delay
  product with a margin. While the estimate is short of the line, a window ``gain``
  times the product makes the next rounds deliver ``gain`` times more, so the
  estimate climbs geometrically and never needs a loss to learn the line rate.

Phases: *startup* grows the window ``startup_gain`` times a round (each acknowledged
byte adds ``startup_gain - 1``; 1.5 keeps the overshoot of the last round inside a
queue of one round trip, where slow start's doubling overflows it) from
``INITIAL_SEGMENTS``, until the path shows a queue (the round's least RTT above
``min_rtt`` by ``max(STARTUP_QUEUE_MIN_S, min_rtt / 8)``: HyStart's delay exit) or the
rate stops growing by 25 % for three rounds; *drain* holds the window at one product
until what startup queued has left; *cruise* cycles ``CRUISE_GAINS``, one per round:
mostly ``cruise_gain`` (a small standing queue keeps the line busy despite bunched
acknowledgements), one round higher to probe for more, one round under one product
so the queue empties and ``min_rtt`` stays fresh. Rounds last at least half a round
trip (retransmissions acknowledged with older data end none early).

Loss is not a signal by itself: random loss (radio, a busy relay) leaves the window
alone. Loss *with* a queue is congestion (a full bottleneck, or another flow on it):
a round losing more than ``congestion_loss_fraction`` of its bytes (and at least
``CONGESTION_MIN_SEGMENTS`` segments) while its least RTT stays above ``min_rtt`` by
``congestion_delay_s`` (or ``min_rtt / 2``) caps the window at ``CONGESTION_BETA``
of the most that was in flight, and scales the rate estimate by as much (it was too
high, or the path is shared now); the cap grows back by an eighth each round
without congestion.

What it does not know: SCTP, packets' contents or which transport calls it (see
:mod:`engine.net.sctp_tuning`); it only turns sends, acknowledgements, losses and
round-trip samples into a window in bytes. Times are seconds, sizes bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: round trips over which the bottleneck rate is the largest sample
BW_WINDOW_ROUNDS = 10
#: seconds over which the propagation round trip is the least sample
MIN_RTT_WINDOW_S = 10.0
#: seconds a measured path rate (``path_rate``) is remembered unless a larger one replaces it
PATH_RATE_WINDOW_S = 60.0
#: rounds in a row the sender must have kept data waiting before ``bw`` counts as the path's rate
PATH_RATE_BUSY_ROUNDS = 3
#: segments added to every window target (delayed and bunched acknowledgements)
EXTRA_SEGMENTS = 4
#: fewest segments a window may hold
MIN_SEGMENTS = 4
#: segments of the first window (RFC 6928's initial window; aiortc starts with 3)
INITIAL_SEGMENTS = 10
#: least queueing delay that ends startup (seconds), or min_rtt / 8 when larger
STARTUP_QUEUE_MIN_S = 0.004
#: rounds without 25 % more rate after which startup ends
STARTUP_FULL_ROUNDS = 3
#: RTT samples a round needs before its least one may end startup
STARTUP_RTT_SAMPLES = 8
#: the window's gain per round while cruising, multiplied by ``cruise_gain`` except the low one
CRUISE_GAINS = (1.2, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
#: share of what was in flight a congested round leaves in the window
CONGESTION_BETA = 0.7
#: fewest segments a round must lose to count as congested (one random loss in a small window is not)
CONGESTION_MIN_SEGMENTS = 3

STARTUP, DRAIN, CRUISE = "startup", "drain", "cruise"


@dataclass(frozen=True)
class SendStamp:
    """The state of delivery when one packet left (kept with the packet until it is acknowledged)."""

    delivered: int  #: bytes delivered before it left
    delivered_time: float  #: when ``delivered`` last grew
    first_sent_time: float  #: send time of the packet that opened the current sampling interval
    sent_time: float
    app_limited: bool  #: the sender had nothing more to send


class BottleneckControl:
    """Window of one connection from its measured bottleneck rate and round trip (see the module)."""

    def __init__(self, mss: int, *, cruise_gain: float = 1.25, startup_gain: float = 1.5,
                 congestion_loss_fraction: float = 0.03, congestion_delay_s: float = 0.010) -> None:
        self.mss, self.cruise_gain, self.startup_gain = mss, cruise_gain, startup_gain
        self.congestion_loss_fraction, self.congestion_delay_s = congestion_loss_fraction, congestion_delay_s
        self.window = INITIAL_SEGMENTS * mss
        self.mode = STARTUP
        # delivery
        self.delivered = 0
        self.delivered_time = 0.0
        self._first_sent_time = 0.0
        self._app_limited_until = 0  #: delivered count up to which sends are app-limited (0: not now)
        # the newest acknowledged packet's stamp in the current acknowledgement
        self._sample: SendStamp | None = None
        self._acked = 0  #: bytes acknowledged in the current acknowledgement
        # estimates
        #: round -> its largest rate sample (bytes/s) and whether the path set it (not app-limited)
        self._bw_rounds: dict[int, tuple[float, bool]] = {}
        self._bw_best: tuple[float, bool] = (0.0, False)  #: the largest of them
        self.min_rtt = math.inf
        self._min_rtt_time = -math.inf
        # rounds
        self.round = 0
        self._next_round_delivered = 0
        self._round_start = -math.inf
        self._round_min_rtt = math.inf
        self._round_rtt_samples = 0
        self._round_max_in_flight = 0
        self._round_delivered = 0
        self._round_lost = 0
        self._full_bw, self._full_bw_rounds = 0.0, 0
        self._cycle = 0
        self._cap = math.inf  #: window ceiling after congestion
        self._path_rate, self._path_rate_time = 0.0, -math.inf
        self._round_app_limited = False  #: the sender ran out of data during the current round
        self._busy_rounds = 0  #: rounds in a row it did not
        self.congested_rounds = 0
        self.trace = None  #: called with this controller at every round's end (diagnostics)

    # ------------------------------------------------------------------ estimates
    @property
    def bw(self) -> float:
        """Bottleneck rate estimate, bytes per second (0 before the first sample)."""
        return self._bw_best[0]

    @property
    def bw_is_ceiling(self) -> bool:
        """Whether ``bw`` came from a sample where the path, not the sender, set the pace."""
        return self._bw_best[1]

    def path_rate(self, now: float) -> float | None:
        """The largest rate (bytes/s) measured while cruising with data waiting for ``PATH_RATE_BUSY_ROUNDS``
        rounds in a row (the estimate climbs a quarter a round while the window, not the sender,
        limits it), in the last ``PATH_RATE_WINDOW_S`` (None: none): what this path carries when
        pushed. ``bw`` itself forgets within ten round trips, and a mostly idle link rarely pushes."""
        return self._path_rate if now - self._path_rate_time <= PATH_RATE_WINDOW_S else None

    @property
    def bdp(self) -> float:
        """Estimated bandwidth-delay product, bytes (0 until rate and round trip are known)."""
        return self.bw * self.min_rtt if self.bw > 0 and math.isfinite(self.min_rtt) else 0.0

    # ------------------------------------------------------------------ events
    def on_send(self, now: float, in_flight_before: int) -> SendStamp:
        """A packet leaves now (``in_flight_before``: bytes in flight without it)."""
        if in_flight_before <= 0:
            self._first_sent_time = self.delivered_time = now
        return SendStamp(self.delivered, self.delivered_time, self._first_sent_time, now,
                         self._app_limited_until > 0)

    def on_app_limited(self, in_flight: int) -> None:
        """The sender ran out of data with room left in the window: the next samples say little."""
        self._app_limited_until = max(self.delivered + in_flight, 1)
        self._round_app_limited = True

    def on_delivered(self, stamp: SendStamp | None, nbytes: int, now: float) -> None:
        """A packet of ``nbytes`` was acknowledged (``stamp``: from its send; None if unknown)."""
        self.delivered += nbytes
        self.delivered_time = now
        self._round_delivered += nbytes
        self._acked += nbytes
        if stamp is not None and (self._sample is None or stamp.delivered >= self._sample.delivered):
            self._sample = stamp
            self._first_sent_time = stamp.sent_time

    def on_lost(self, nbytes: int) -> None:
        """A packet of ``nbytes`` was declared lost (it will be sent again)."""
        self._round_lost += nbytes

    def on_rtt(self, rtt_s: float, now: float) -> None:
        """One round-trip sample (of a packet sent once)."""
        if rtt_s <= 0:
            return
        if rtt_s <= self.min_rtt or now - self._min_rtt_time > MIN_RTT_WINDOW_S:
            self.min_rtt, self._min_rtt_time = rtt_s, now
        self._round_min_rtt = min(self._round_min_rtt, rtt_s)
        self._round_rtt_samples += 1
        if self.mode == STARTUP and self._round_rtt_samples >= STARTUP_RTT_SAMPLES \
                and self._round_min_rtt - self.min_rtt > max(STARTUP_QUEUE_MIN_S, self.min_rtt / 8):
            self.mode = DRAIN  # HyStart's delay exit: the path has started to queue

    def on_ack_done(self, now: float, in_flight: int) -> int:
        """After one acknowledgement's packets were reported: the new window, bytes."""
        sample, self._sample = self._sample, None
        if self._app_limited_until and self.delivered > self._app_limited_until:
            self._app_limited_until = 0
        self._round_max_in_flight = max(self._round_max_in_flight, in_flight)
        if self.mode == DRAIN and in_flight <= self.bdp + self.mss:
            self.mode, self._cycle = CRUISE, 0
        if sample is not None:
            self._take_rate_sample(sample)
            # a round ends when a packet sent after its start comes back, and lasts at least half a
            # round trip (retransmissions acknowledged together with older data end none early)
            if sample.delivered >= self._next_round_delivered and now - self._round_start >= self.min_rtt / 2:
                self._round_start = now
                self._end_round(in_flight)
                self._busy_rounds = 0 if self._round_app_limited else self._busy_rounds + 1
                self._round_app_limited = False
                if self.mode == CRUISE and self.bw_is_ceiling and self._busy_rounds >= PATH_RATE_BUSY_ROUNDS and \
                        (self.bw >= self._path_rate or now - self._path_rate_time > PATH_RATE_WINDOW_S):
                    self._path_rate, self._path_rate_time = self.bw, now
        acked, self._acked = self._acked, 0
        self.window = self._target(acked)
        return self.window

    def on_timeout(self) -> None:
        """The retransmission timer fired: the path may have changed; startup finds it again."""
        self._round_lost = self._round_delivered = 0

    # ------------------------------------------------------------------ internals
    def _take_rate_sample(self, sample: SendStamp) -> None:
        send_elapsed = sample.sent_time - sample.first_sent_time
        ack_elapsed = self.delivered_time - sample.delivered_time
        interval = max(send_elapsed, ack_elapsed)
        if interval <= 0 or (math.isfinite(self.min_rtt) and interval < self.min_rtt):
            return  # shorter than a round trip: bunched acknowledgements, not the path's rate
        rate = (self.delivered - sample.delivered) / interval
        if sample.app_limited and rate <= self.bw:
            return
        entry = (rate, not sample.app_limited)
        if rate > self._bw_rounds.get(self.round, (0.0, False))[0]:
            self._bw_rounds[self.round] = entry
        if rate > self._bw_best[0]:
            self._bw_best = entry

    def _end_round(self, in_flight: int) -> None:
        self.round += 1
        for old in [r for r in self._bw_rounds if r <= self.round - BW_WINDOW_ROUNDS]:
            del self._bw_rounds[old]
        self._bw_best = max(self._bw_rounds.values(), default=(0.0, False))
        self._next_round_delivered = self.delivered
        queue_s = self._round_min_rtt - self.min_rtt if math.isfinite(self._round_min_rtt) else 0.0
        sent = self._round_delivered + self._round_lost
        lossy = self._round_lost >= max(self.congestion_loss_fraction * sent, CONGESTION_MIN_SEGMENTS * self.mss)
        if lossy and queue_s > max(self.congestion_delay_s, self.min_rtt / 2):
            self._cap = max(MIN_SEGMENTS * self.mss, CONGESTION_BETA * self._round_max_in_flight)
            self.congested_rounds += 1
            # the rate estimate was too high (bunched acknowledgements) or the path is shared now
            self._bw_rounds = {r: (rate * CONGESTION_BETA, ceiling) for r, (rate, ceiling) in self._bw_rounds.items()}
            self._bw_best = (self._bw_best[0] * CONGESTION_BETA, self._bw_best[1])
            if self.mode == STARTUP:
                self.mode = DRAIN
        elif math.isfinite(self._cap):
            self._cap += self._cap / 8
            if self.bdp and self._cap > 4 * self.bdp:
                self._cap = math.inf
        if self.mode == STARTUP:
            bw = self.bw
            if bw >= 1.25 * self._full_bw:
                self._full_bw, self._full_bw_rounds = bw, 0
            else:
                self._full_bw_rounds += 1
            if self._full_bw_rounds >= STARTUP_FULL_ROUNDS:
                self.mode = DRAIN
        elif self.mode == CRUISE:
            self._cycle = (self._cycle + 1) % len(CRUISE_GAINS)
        self._round_min_rtt = math.inf
        self._round_rtt_samples = self._round_max_in_flight = 0
        self._round_delivered = self._round_lost = 0
        if self.trace is not None:
            self.trace(self)

    def _target(self, acked: int) -> int:
        bdp = self.bdp
        if self.mode == STARTUP:
            # slow start's doubling, but never past startup_gain products once the product is known
            grown = self.window + acked * (self.startup_gain - 1)
            target = grown if not bdp else min(grown, self.startup_gain * bdp + EXTRA_SEGMENTS * self.mss)
        elif self.mode == DRAIN:
            target = bdp
        else:
            gain = CRUISE_GAINS[self._cycle]
            gain = gain * self.cruise_gain if gain >= 1.0 else gain
            target = gain * bdp + EXTRA_SEGMENTS * self.mss
        return int(max(MIN_SEGMENTS * self.mss, min(target, self._cap)))
