"""Generation requests from outside the run (the OpenAI-compatible endpoint), queued for the swarm.

A :class:`ServeRequest` is a prompt's token ids, ``n`` samples, sampling settings, a deadline and
the future its caller awaits. :class:`ServeQueue` holds those not yet dispatched, at most
``max_queued`` (``submit`` refuses more with :class:`ServeRefused`, HTTP 429); the generation
scheduler (``engine.swarm.scheduler``) takes them before evals and training jobs
(``next_request``), runs each as one generation job of kind ``serve`` (its ``n`` rows share the
prompt's prefill), and hands back the sampled ids (``finished``) or the failure (``failed``): a
failed job is queued again, first in line, while its deadline and ``max_attempts`` allow, else its
caller gets a 503. A request past its deadline leaves the queue and its caller gets a 504; one
whose caller stopped waiting (``abandon``) is dropped where it is (a late result of it is
discarded). Nothing here is a rollout: serve results are never scored, stored or trained on.

What it does not know: OpenAI's JSON, chat templates, routes, nodes, HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

log = logging.getLogger(__name__)

#: requests waiting for a route (dispatched ones are bounded by the routes' in-flight budget)
MAX_QUEUED = 32
#: generation jobs one request may take (a job whose route fails or times out is retried)
MAX_ATTEMPTS = 3


class ServeRefused(Exception):
    """A request the swarm will not (or could no longer) serve: an HTTP status and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class ServeResult:
    """A served request's samples: per row the ids as sampled (the stop id included when one
    ended it), the policy version of each stage of its route, and the seconds from submit."""

    tokens: list[list[int]]
    versions: list[int]
    seconds: float


@dataclass(eq=False)
class ServeRequest:
    """One external request: ``n`` samples after ``prompt_ids``."""

    prompt_ids: tuple[int, ...]
    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None  #: None: the scheduler derives one from the job id
    deadline: float  #: ``time.monotonic()`` past which nobody waits for it
    future: asyncio.Future = field(repr=False)
    submitted: float = field(default_factory=time.monotonic)
    attempts: int = 0
    job: str | None = None  #: the generation job running it, while one does


class ServeQueue:
    """External requests between the HTTP handler and the generation scheduler (one event loop)."""

    def __init__(self, *, max_queued: int = MAX_QUEUED, max_attempts: int = MAX_ATTEMPTS) -> None:
        self.max_queued, self.max_attempts = max_queued, max_attempts
        self._waiting: deque[ServeRequest] = deque()
        self._running: dict[str, ServeRequest] = {}  #: job id -> request (a hedged twin is found by the original)
        self.served = 0
        self.refused_full = 0
        self.expired = 0
        self.failed_requests = 0

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def submit(self, request: ServeRequest) -> None:
        """Queue ``request``, or ``ServeRefused`` (429) when ``max_queued`` already wait."""
        if len(self._waiting) >= self.max_queued:
            self.refused_full += 1
            raise ServeRefused(429, f"{len(self._waiting)} requests are already waiting for the swarm; "
                                    "retry in a few seconds")
        self._waiting.append(request)

    def next_request(self, now: float | None = None) -> ServeRequest | None:
        """The oldest request still wanted (expired ones are answered 504 on the way), or None."""
        self.expire(now)
        while self._waiting:
            request = self._waiting.popleft()
            if not request.future.done():
                request.attempts += 1
                return request
        return None

    def dispatched(self, job: str, request: ServeRequest) -> None:
        request.job = job
        self._running[job] = request

    def request_of(self, job: str) -> ServeRequest | None:
        """The request a serve job runs (its sampling settings), or None."""
        return self._running.get(job)

    def finished(self, job: str, tokens: Sequence[Sequence[int]], versions: Sequence[int]) -> None:
        """Job ``job`` returned its checked rows: its caller gets them."""
        request = self._running.pop(job, None)
        if request is None:
            return
        request.job = None
        if not request.future.done():
            self.served += 1
            request.future.set_result(ServeResult([list(map(int, t)) for t in tokens], list(map(int, versions)),
                                                  time.monotonic() - request.submitted))

    def failed(self, job: str, reason: str) -> None:
        """Job ``job`` failed: queue its request again, first, or tell its caller (503)."""
        request = self._running.pop(job, None)
        if request is None or request.future.done():
            return
        request.job = None
        if request.attempts < self.max_attempts and time.monotonic() < request.deadline:
            log.info("serve job %s failed (%s); its request is queued again", job, reason)
            self._waiting.appendleft(request)
            return
        self.failed_requests += 1
        request.future.set_exception(ServeRefused(503, f"the swarm failed to generate it {request.attempts} "
                                                       f"times (last: {reason})"))

    def expire(self, now: float | None = None) -> None:
        """Answer 504 to waiting requests past their deadline and forget them."""
        now = time.monotonic() if now is None else now
        keep: deque[ServeRequest] = deque()
        for request in self._waiting:
            if request.future.done():
                continue
            if now >= request.deadline:
                self.expired += 1
                request.future.set_exception(ServeRefused(504, "no route of the swarm took it before its deadline"))
            else:
                keep.append(request)
        self._waiting = keep

    def abandon(self, request: ServeRequest) -> None:
        """Its caller stopped waiting: drop it wherever it is (a result that still comes is discarded)."""
        if request in self._waiting:
            self._waiting.remove(request)
        if request.job is not None:
            self._running.pop(request.job, None)
        if not request.future.done():
            request.future.cancel()

    def stats(self) -> dict[str, int]:
        return {"queued": len(self._waiting), "in_flight": len(self._running), "served": self.served,
                "refused_full": self.refused_full, "expired": self.expired, "failed": self.failed_requests}
