"""A packet-level simulation of one path (bottleneck rate, queue, delay, random loss) driven by a
:class:`~engine.net.bottleneck_control.BottleneckControl`, for unit tests of the controller.

The sender always has data (unless ``app_limit_bytes`` caps what it may keep in flight); it sends
whenever the bytes in flight are under the controller's window. Each packet waits for the
bottleneck (FIFO, ``rate_bytes_s``; tail-dropped when the queue would exceed ``queue_bytes``),
may be lost at random (``loss``), and is acknowledged one round trip later. A packet counts as
lost when three packets sent after it have been acknowledged (as SACK-based recovery does), and
is sent again. Acknowledgements are never lost and never bunched.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from engine.net.bottleneck_control import BottleneckControl

MSS = 1200


@dataclass
class PathResult:
    delivered_bytes: int
    seconds: float
    queue_drops: int
    random_drops: int
    max_queue_bytes: float
    windows: list[int] = field(default_factory=list)  #: the window after each acknowledgement

    @property
    def rate_bytes_s(self) -> float:
        return self.delivered_bytes / self.seconds


def simulate(control: BottleneckControl, *, rate_bytes_s: float, rtt_s: float, queue_bytes: float,
             loss: float = 0.0, seconds: float = 10.0, count_after_s: float = 0.0, seed: int = 0,
             app_limit_bytes: int | None = None) -> PathResult:
    """Run the path for ``seconds``; bytes delivered after ``count_after_s`` are counted."""
    rng = random.Random(seed)
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, packet id)
    seq = 0
    now = 0.0
    link_free = 0.0
    in_flight = 0
    next_id = 0
    stamps: dict[int, object] = {}
    sent_once: dict[int, bool] = {}
    sent_at: dict[int, float] = {}
    outstanding: list[int] = []  # packet ids in send order, not yet acknowledged or declared lost
    acked_after: dict[int, int] = {}  # packet id -> acknowledged packets sent after it
    resend: list[int] = []
    result = PathResult(0, seconds - count_after_s, 0, 0, 0.0)

    def push(t: float, kind: str, pid: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, pid))
        seq += 1

    def send_more() -> None:
        nonlocal in_flight, next_id, link_free
        limit = control.window if app_limit_bytes is None else min(control.window, app_limit_bytes)
        while in_flight + MSS <= limit:
            if resend:
                pid = resend.pop(0)
                sent_once[pid] = False
            else:
                pid, next_id = next_id, next_id + 1
                sent_once[pid] = True
            stamps[pid] = control.on_send(now, in_flight)
            sent_at[pid] = now
            in_flight += MSS
            outstanding.append(pid)
            acked_after[pid] = 0
            start = max(now, link_free)
            queued = (start - now) * rate_bytes_s
            result.max_queue_bytes = max(result.max_queue_bytes, queued)
            if queued > queue_bytes:
                result.queue_drops += 1
                continue  # tail drop: it never arrives
            link_free = start + MSS / rate_bytes_s
            if rng.random() < loss:
                result.random_drops += 1
                continue
            push(link_free + rtt_s, "ack", pid)
        if app_limit_bytes is not None and in_flight + MSS > app_limit_bytes:
            control.on_app_limited(in_flight)

    send_more()
    while True:
        if not events:  # every packet in flight was lost: a retransmission timeout
            if not outstanding or now > seconds:
                break
            now += 2 * rtt_s
            for lost in outstanding:
                del acked_after[lost]
                control.on_lost(MSS)
            resend.extend(outstanding)
            outstanding.clear()
            in_flight = 0
            control.on_timeout()
            send_more()
            continue
        now, _, kind, pid = heapq.heappop(events)
        if now > seconds:
            break
        if pid not in acked_after:
            continue  # declared lost already and sent again; this late copy changes nothing
        position = outstanding.index(pid)
        for earlier in outstanding[:position]:
            acked_after[earlier] += 1
        outstanding.pop(position)
        del acked_after[pid]
        in_flight -= MSS
        control.on_delivered(stamps.pop(pid), MSS, now)
        if sent_once[pid]:
            control.on_rtt(now - sent_at[pid], now)
        if now >= count_after_s:
            result.delivered_bytes += MSS
        for lost in [p for p in outstanding if acked_after[p] >= 3]:
            outstanding.remove(lost)
            del acked_after[lost]
            in_flight -= MSS
            control.on_lost(MSS)
            resend.append(lost)
        result.windows.append(control.on_ack_done(now, in_flight))
        send_more()
    return result
