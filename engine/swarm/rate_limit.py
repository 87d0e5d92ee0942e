"""A token bucket that paces bytes to a bandwidth cap, for asyncio senders.

``await bucket.consume(n)`` returns at once while the bucket has credit and
otherwise sleeps just long enough to keep the long-run rate at the cap (with a
burst of a quarter second's worth). A rate of ``None`` means no cap. It knows
nothing about what is being sent.
"""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    """Bytes-per-second pacing at ``rate_mbps`` megabits per second (None = unlimited)."""

    def __init__(self, rate_mbps: float | None, burst_s: float = 0.25) -> None:
        self.burst_s = burst_s
        self._credit = 0.0
        self._last = time.monotonic()
        self.rate_bytes_s: float | None = None
        self.waited_s = 0.0  #: total time senders were held back
        self.set_rate(rate_mbps)

    def set_rate(self, rate_mbps: float | None) -> None:
        if rate_mbps is not None and rate_mbps <= 0:
            raise ValueError("a bandwidth cap must be > 0 Mbit/s (or None for no cap)")
        self.rate_bytes_s = None if rate_mbps is None else rate_mbps * 1e6 / 8.0
        self._credit = 0.0 if self.rate_bytes_s is None else self.rate_bytes_s * self.burst_s
        self._last = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        assert self.rate_bytes_s is not None
        self._credit = min(self._credit + (now - self._last) * self.rate_bytes_s, self.rate_bytes_s * self.burst_s)
        self._last = now

    async def consume(self, nbytes: int) -> None:
        if self.rate_bytes_s is None or nbytes <= 0:
            return
        self._refill()
        self._credit -= nbytes
        if self._credit < 0:
            wait = -self._credit / self.rate_bytes_s
            self.waited_s += wait
            await asyncio.sleep(wait)
