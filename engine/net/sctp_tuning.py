"""Congestion control for aiortc's SCTP association that measures the path, by subclass.

aiortc's SCTP (1.16) is textbook Reno: one MSS (~1.1 KB of user data) more per
round trip, the window halved on every loss event, and a retransmission timeout
of at least one second (RFC 4960's ``RTO.min``) after which the window restarts
at one MSS. On a WAN with random (not congestion) loss that bounds one
association near ``MSS / RTT x 1.22 / sqrt(loss)`` whatever the line rate: about
0.4 MB/s at 50 ms and 0.5 %; at 200 ms the window takes tens of seconds to grow
to the line, and slow start's doubling overshoots a router queue of one round trip.

:class:`SctpTuning` (``controller="bottleneck"``) hands the window to
:class:`~engine.net.bottleneck_control.BottleneckControl`: the window is the
measured bottleneck rate times the measured propagation round trip, with a small
gain; random loss leaves it alone, loss behind a queue (congestion) caps it. The
transport stamps every DATA chunk it sends, reports each acknowledged or lost chunk
and each round-trip sample to the controller, and after every SACK sets ``_cwnd`` to
the controller's window before sending. The retransmission timeout becomes Linux
TCP's: smoothed RTT plus ``max(4 x RTT variation, rto_margin_s)``, instead of
aiortc's one-second floor, so a lost retransmission stalls the link for a round
trip and a bit, not a second.

The controller's rate estimate is also what a link reports as its measured send
rate (:func:`send_rate`): bytes per second, and whether the path (not an idle
sender) set it; the swarm places nodes on slow uplinks by it.

:func:`tune_sctp` installs it on a connection's SCTP transport by switching the
transport's class to :class:`TunedSctpTransport`, a subclass that wraps a few
aiortc methods and touches only their congestion state; aiortc offers no public
hook. Call it after the connection's first data channel exists (that creates
the transport) and before the association starts.

What this module does not know: framing, peers, or what the links carry.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal, cast

from engine.net.bottleneck_control import BottleneckControl

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SctpTuning:
    """Congestion control of one link's SCTP association.

    controller: "bottleneck" (the window from the measured rate and round trip, see
        ``engine.net.bottleneck_control``) or "stock" (aiortc's Reno).
    cruise_gain: the window over the estimated bandwidth-delay product while cruising.
    startup_gain: growth of the window per round in startup, and the most bandwidth-delay
        products it reaches there.
    congestion_loss_percent: share of a round's bytes lost above which, with a queue,
        the round counts as congested.
    congestion_delay_ms: least queueing delay (the round's least RTT over the path's)
        that makes a lossy round congestion (or half the path's RTT, if larger).
    rto_margin_s: least margin of the retransmission timeout over the smoothed
        round trip, seconds; None keeps aiortc's own (at least 1 s, RFC 4960).
    """

    controller: Literal["bottleneck", "stock"] = "bottleneck"
    cruise_gain: float = 1.25
    startup_gain: float = 1.5
    congestion_loss_percent: float = 3.0
    congestion_delay_ms: float = 10.0
    rto_margin_s: float | None = 0.2

    def __post_init__(self) -> None:
        if self.controller not in ("bottleneck", "stock"):
            raise ValueError("SctpTuning.controller must be 'bottleneck' or 'stock'")
        if not 1.0 <= self.cruise_gain <= 4.0 or not 1.0 <= self.startup_gain <= 4.0:
            raise ValueError("SctpTuning.cruise_gain and startup_gain must be in [1, 4]")
        if not 0 < self.congestion_loss_percent <= 100:
            raise ValueError("SctpTuning.congestion_loss_percent must be in (0, 100]")
        if self.rto_margin_s is not None and not 0.01 <= self.rto_margin_s <= 1.0:
            raise ValueError("SctpTuning.rto_margin_s must be in [0.01, 1.0] seconds (or None)")
        if not 0 <= self.congestion_delay_ms <= 10_000:
            raise ValueError("SctpTuning.congestion_delay_ms must be in [0, 10000]")

    @property
    def is_stock(self) -> bool:
        return self.controller == "stock" and self.rto_margin_s is None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def control(self, mss: int) -> BottleneckControl | None:
        """A fresh controller for one association (None: aiortc keeps the window)."""
        if self.controller != "bottleneck":
            return None
        return BottleneckControl(mss, cruise_gain=self.cruise_gain,
                                 startup_gain=self.startup_gain,
                                 congestion_loss_fraction=self.congestion_loss_percent / 100,
                                 congestion_delay_s=self.congestion_delay_ms / 1e3)


#: what aiortc does on its own
STOCK_SCTP = SctpTuning(controller="stock", rto_margin_s=None)


def _transport_class() -> type:
    from aiortc.rtcsctptransport import SCTP_RTO_MAX, USERDATA_MAX_LENGTH, DataChunk, RTCSctpTransport

    class TunedSctpTransport(RTCSctpTransport):
        """RTCSctpTransport whose window follows a :class:`BottleneckControl` (``_polis_cc``).

        aiortc's ``_receive_sack_chunk`` counts acknowledged chunks out of the flight
        (``_flight_size_decrease``), adjusts ``_cwnd``, then flushes queued data and
        transmits; the flush is where the controller's window replaces aiortc's, so
        data never leaves under the stock window.
        """

        _polis_tuning: SctpTuning = STOCK_SCTP
        _polis_cc: BottleneckControl | None = None
        _polis_in_sack: bool = False

        async def _receive_sack_chunk(self, chunk) -> None:
            self._polis_in_sack = True
            try:
                await super()._receive_sack_chunk(chunk)
            finally:
                self._polis_in_sack = False

        def _flight_size_decrease(self, chunk) -> None:
            cc = self._polis_cc
            if chunk._in_flight and self._polis_in_sack and cc is not None:
                if chunk._retransmit or chunk._abandoned:
                    cc.on_lost(chunk._book_size)
                else:
                    now, stamp = time.monotonic(), getattr(chunk, "_polis_stamp", None)
                    cc.on_delivered(stamp, chunk._book_size, now)
                    if stamp is not None and chunk._sent_count == 1:  # Karn: only chunks sent once
                        cc.on_rtt(now - stamp.sent_time, now)
            super()._flight_size_decrease(chunk)

        async def _data_channel_flush(self) -> None:
            cc = self._polis_cc
            if cc is not None and self._polis_in_sack:
                self._polis_in_sack = False  # once per SACK: later decreases are T3's or abandonments
                self._cwnd = self._ssthresh = cc.on_ack_done(time.monotonic(), self._flight_size)
            await super()._data_channel_flush()

        async def _send_chunk(self, chunk) -> None:
            cc = self._polis_cc
            if cc is not None and type(chunk) is DataChunk:
                in_flight = self._flight_size - chunk._book_size
                cast(Any, chunk)._polis_stamp = cc.on_send(time.monotonic(), in_flight)
                if chunk._sent_count > 1:
                    # a retransmission is struck only by SACKs of chunks sent after it (as RACK
                    # does): aiortc strikes it again for every SACK of the chunks already in
                    # flight ahead of it, one per packet, and would resend it many times a round
                    chunk._misses = -(in_flight // USERDATA_MAX_LENGTH)
            await super()._send_chunk(chunk)

        async def _transmit(self) -> None:
            await super()._transmit()
            cc = self._polis_cc
            if cc is not None and not self._outbound_queue and not self._data_channel_queue \
                    and self._flight_size + USERDATA_MAX_LENGTH < self._cwnd:
                cc.on_app_limited(self._flight_size)

        def _t3_expired(self) -> None:
            super()._t3_expired()  # marks every chunk not cumulatively acknowledged for retransmission
            cc = self._polis_cc
            if cc is None:
                return
            # as RACK's timeout: only chunks sent more than a round trip ago count as lost; younger
            # ones and those the peer reported in gap blocks stay where they are (no go-back-N)
            horizon = time.monotonic() - 1.25 * (self._srtt or self._rto)
            for chunk in self._sent_queue:
                stamp = getattr(chunk, "_polis_stamp", None)
                if chunk._acked or (chunk._retransmit and stamp is not None and stamp.sent_time > horizon):
                    chunk._retransmit = False
                    if not chunk._acked:
                        self._flight_size_increase(chunk)
            cc.on_timeout()

        def _update_rto(self, R: float) -> None:
            super()._update_rto(R)
            margin = self._polis_tuning.rto_margin_s
            srtt, rttvar = self._srtt, self._rttvar
            if margin is not None and srtt is not None and rttvar is not None:
                self._rto = min(srtt + max(4 * rttvar, margin), SCTP_RTO_MAX)

    TunedSctpTransport._polis_mss = USERDATA_MAX_LENGTH  # type: ignore[attr-defined]
    return TunedSctpTransport


_TUNED_CLASS: type | None = None


def tune_sctp(pc, tuning: SctpTuning) -> bool:
    """Give ``pc``'s SCTP transport ``tuning``; False (and stock behaviour) where it cannot."""
    global _TUNED_CLASS
    if tuning.is_stock:
        return False
    sctp = getattr(pc, "sctp", None)
    if sctp is None:
        log.warning("no SCTP transport yet: create a data channel before tuning; stock SCTP is used")
        return False
    if _TUNED_CLASS is None:
        _TUNED_CLASS = _transport_class()
    if type(sctp) is not _TUNED_CLASS:
        if type(sctp) is not _TUNED_CLASS.__mro__[1]:  # only aiortc's own class is switched
            log.warning("unexpected SCTP transport %s; stock SCTP is used", type(sctp).__name__)
            return False
        sctp.__class__ = _TUNED_CLASS
    tuned = cast(Any, sctp)  # the tuned class reads these; aiortc's own never does
    tuned._polis_tuning = tuning
    tuned._polis_cc = cc = tuning.control(tuned._polis_mss)
    if cc is not None:
        tuned._cwnd = cc.window
    return True


def send_rate(pc) -> tuple[float, bool] | None:
    """``pc``'s measured send rate: (bytes per second, True) when the path set it (``path_rate``), else
    (the most it has sent, False: a lower bound), or None (nothing measured, or stock SCTP)."""
    cc = getattr(getattr(pc, "sctp", None), "_polis_cc", None)
    if not isinstance(cc, BottleneckControl):
        return None
    rate = cc.path_rate(time.monotonic())
    if rate is not None:
        return rate, True
    return (cc.bw, False) if cc.bw > 0 else None
