"""A loss-tolerant congestion controller for aiortc's SCTP association, by subclass.

aiortc's SCTP (1.16) is textbook Reno: one MSS (~1.1 KB of user data) more per
round trip, the window halved on every loss event, and a retransmission timeout
of at least one second (RFC 4960's ``RTO.min``) after which the window restarts
at one MSS. On a WAN with random (not congestion) loss that bounds one
association near ``MSS / RTT x 1.22 / sqrt(loss)`` whatever the line rate: about
0.4 MB/s at 50 ms and 0.5 %.

:class:`SctpTuning` makes the window tell random loss from congestion, the way
TCP Veno does, by the queueing delay it sees: the latest round trips against
the smallest seen. While that delay stays under ``congestion_delay_ms`` the
path's queue is (nearly) empty, so a loss is taken as random: the window
shrinks by only ``1 / (2 x virtual_flows)`` and grows by ``virtual_flows`` MSS
per round trip, like the aggregate of that many Reno flows (MulTCP) -- what
striping over as many associations would do, without their extra DTLS
handshakes, ICE consent checks, SACK streams and signalling. Once a queue has
built up, loss means congestion and the association is stock Reno again (one
MSS per round trip, halved on loss), so it does not flood a full bottleneck.
The retransmission timeout becomes Linux TCP's: smoothed RTT plus
``max(4 x RTT variation, rto_margin_s)``, instead of aiortc's one-second floor,
so a lost retransmission stalls the link for a round trip and a bit, not a
second, yet a queue building up on a long path does not fire spurious timeouts
(each one restarts the window at one MSS).

:func:`tune_sctp` installs it on a connection's SCTP transport by switching the
transport's class to :class:`TunedSctpTransport`, a subclass that wraps two
aiortc methods and touches only their congestion state; aiortc offers no public
hook. Call it after the connection's first data channel exists (that creates
the transport) and before the association starts.

What this module does not know: framing, peers, or what the links carry.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, cast

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SctpTuning:
    """Congestion control of one link's SCTP association.

    virtual_flows: while the path shows no queue, the association grows and backs
        off like this many Reno flows (1 = aiortc's stock behaviour).
    congestion_delay_ms: queueing delay (recent round trip minus the smallest seen)
        above which loss counts as congestion and stock Reno applies.
    rto_margin_s: least margin of the retransmission timeout over the smoothed
        round trip, seconds; None keeps aiortc's own (at least 1 s, RFC 4960).
    """

    virtual_flows: int = 8
    congestion_delay_ms: float = 10.0
    rto_margin_s: float | None = 0.2

    def __post_init__(self) -> None:
        if not 1 <= self.virtual_flows <= 64:
            raise ValueError("SctpTuning.virtual_flows must be in 1..64")
        if self.rto_margin_s is not None and not 0.01 <= self.rto_margin_s <= 1.0:
            raise ValueError("SctpTuning.rto_margin_s must be in [0.01, 1.0] seconds (or None)")
        if not 0 <= self.congestion_delay_ms <= 10_000:
            raise ValueError("SctpTuning.congestion_delay_ms must be in [0, 10000]")

    @property
    def is_stock(self) -> bool:
        return self.virtual_flows == 1 and self.rto_margin_s is None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: what aiortc does on its own
STOCK_SCTP = SctpTuning(virtual_flows=1, rto_margin_s=None)


def _transport_class():
    from aiortc.rtcsctptransport import SCTP_RTO_MAX, USERDATA_MAX_LENGTH, RTCSctpTransport

    class TunedSctpTransport(RTCSctpTransport):
        """RTCSctpTransport whose window reacts to SACKs per :class:`SctpTuning` (``_polis_tuning``).

        aiortc's ``_receive_sack_chunk`` adjusts ``_cwnd`` and then flushes queued
        data; the flush is where the adjustment is corrected, so data never leaves
        under the stock window.
        """

        _polis_tuning: SctpTuning = STOCK_SCTP
        _polis_before: tuple[int, Any, int] | None = None
        _polis_min_rtt_s: float = float("inf")
        _polis_recent_rtt_s: float = 0.0  # EWMA of the last few samples (weight 1/4)

        @property
        def _polis_queue_delay_s(self) -> float:
            return max(0.0, self._polis_recent_rtt_s - self._polis_min_rtt_s)

        async def _receive_sack_chunk(self, chunk) -> None:
            self._polis_before = (self._cwnd, self._fast_recovery_exit, self._ssthresh)
            try:
                await super()._receive_sack_chunk(chunk)
            finally:
                self._polis_before = None

        async def _data_channel_flush(self) -> None:
            before, self._polis_before = self._polis_before, None
            if before is not None:
                self._polis_adjust(*before)
            await super()._data_channel_flush()

        def _polis_adjust(self, cwnd: int, recovery_exit: Any, ssthresh: int) -> None:
            tuning = self._polis_tuning
            flows = tuning.virtual_flows
            if flows == 1 or recovery_exit is not None:
                return
            if self._polis_queue_delay_s * 1e3 > tuning.congestion_delay_ms:
                return  # a queue has built up: congestion, stock Reno applies
            if self._fast_recovery_exit is not None:  # this SACK reported a random loss: back off gently
                self._cwnd = self._ssthresh = max(int(cwnd * (1 - 1 / (2 * flows))), 4 * USERDATA_MAX_LENGTH)
            elif self._cwnd > cwnd and cwnd > ssthresh:  # congestion avoidance grew one MSS: grow N
                self._cwnd = cwnd + flows * USERDATA_MAX_LENGTH

        def _update_rto(self, R: float) -> None:
            super()._update_rto(R)
            self._polis_min_rtt_s = min(self._polis_min_rtt_s, R)
            recent = self._polis_recent_rtt_s
            self._polis_recent_rtt_s = R if recent == 0.0 else 0.75 * recent + 0.25 * R
            margin = self._polis_tuning.rto_margin_s
            srtt, rttvar = self._srtt, self._rttvar
            if margin is not None and srtt is not None and rttvar is not None:
                self._rto = min(srtt + max(4 * rttvar, margin), SCTP_RTO_MAX)

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
    cast(Any, sctp)._polis_tuning = tuning  # the tuned class reads it; aiortc's own never does
    return True
