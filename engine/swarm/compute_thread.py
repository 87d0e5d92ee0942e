"""A dedicated compute thread that owns a StageBackend, driven from asyncio.

The node's asyncio loop must never run tensor maths, and MLX streams / CUDA
contexts belong to the thread that created them. So the backend is *created*
on this thread and every call to it runs there, one at a time, in submission
order within a priority: *background* calls (``run_background``: generation steps)
run only when no other call waits, so a training micro-batch or an optimiser step
never queues behind the decoding steps of several jobs (training is the run's
critical path; generation runs ahead of it and fills the gaps). The loop awaits
results without blocking. Exceptions raised on the
compute thread propagate to the awaiting coroutine. The queue is bounded
(``MAX_PENDING_CALLS``): past it ``submit`` raises :class:`ComputeBusy` instead of
letting a flood of peer messages queue work forever.

It knows nothing about what the calls do (generation, training, loading).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_STOP = object()
#: call priorities (lower runs first): everything else, then generation steps, then the stop
URGENT, BACKGROUND, LAST = 0, 1, 2
#: most calls waiting for the compute thread; past it ``submit`` refuses (a flood must not queue forever)
MAX_PENDING_CALLS = 8192


class ComputeBusy(RuntimeError):
    """The compute thread's queue is full; the call was not queued."""


class ComputeThread:
    """One thread, a FIFO of calls per priority. ``await ct.run(fn, *args)`` runs ``fn`` there."""

    def __init__(self, name: str = "polis-compute", max_pending: int = MAX_PENDING_CALLS):
        self._calls: queue.PriorityQueue[Any] = queue.PriorityQueue(maxsize=max_pending + 1)  # +1: the stop
        self._order = itertools.count()  # FIFO within a priority
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._busy_s = 0.0
        self._thread.start()

    def _main(self) -> None:
        import time

        while True:
            *_, item = self._calls.get()
            if item is _STOP:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # delivered to the awaiting coroutine
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                self._busy_s += time.perf_counter() - start

    @property
    def busy_seconds(self) -> float:
        """Total seconds spent running calls (for utilisation figures)."""
        return self._busy_s

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> "Future[T]":
        return self._submit(URGENT, fn, args, kwargs)

    def submit_background(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> "Future[T]":
        """``submit`` at background priority: after every other waiting call."""
        return self._submit(BACKGROUND, fn, args, kwargs)

    def _submit(self, priority: int, fn: Callable[..., T], args: tuple, kwargs: dict) -> "Future[T]":
        if not self._thread.is_alive():
            raise RuntimeError("compute thread has stopped")
        future: Future[T] = Future()
        if self._calls.qsize() >= self._calls.maxsize - 1:
            raise ComputeBusy(f"{self._calls.maxsize - 1} calls already wait for the compute thread")
        self._calls.put_nowait((priority, next(self._order), (future, fn, args, kwargs)))
        return future

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the compute thread and await its result."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    async def run_background(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``run`` at background priority (generation steps)."""
        return await asyncio.wrap_future(self.submit_background(fn, *args, **kwargs))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish queued calls, then end the thread."""
        if self._thread.is_alive():
            self._calls.put((LAST, next(self._order), _STOP))
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("compute thread did not stop within %.1f s", timeout_s)
