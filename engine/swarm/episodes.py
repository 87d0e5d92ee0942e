"""The coordinator's turn driver: every rollout is an episode, stepped turn by turn.

A generation job's rows are episodes (``engine.rl.run_task.EpisodeRun``), grouped in
:class:`EpisodeBatch` es that finish together: a training group (G episodes of one prompt, whose
rewards make the advantages) or the prompts of one eval job. When a job's turn comes back,
:meth:`TurnDriver.on_turn` steps each row's episode (tools run off the event loop, on a small
bounded thread pool, under a deadline of the episode's tool time). An episode that goes on is
continued as a one-row job:

* the first turn of a batch ran its rows together and dropped its caches (rows of one cache must
  have one length, and observations differ), so the continuation recomputes its prefix: a new
  job id, the whole context, ``keep_cache`` on;
* from then on the job keeps its id, its route and its caches: the next turn sends only the ids
  the caches lack (the last sampled id and the observation) and says how many they hold. If the
  route is gone, or a stage answers ``cache miss``, the turn is sent again with the whole prefix
  (on the least loaded route).

An episode that ends frees its kept caches (``gen_release``). A continuation that fails is
retried (``MAX_TURN_ATTEMPTS`` failures per episode); past that the batch is given up (its prompts go back
to the queue, an eval job's to the eval queue) and counted. Limits (turns, context tokens, tool
seconds) are the episode's own; a context with no room for one more token is a recorded cut.

What it does not know: how results are checked or scored into advantages, the store, evals
(the scheduler's callbacks do that), websockets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
from msgspec.structs import replace

from engine.rl.episode_outcome import EpisodeRun
from engine.swarm import messages
from engine.swarm.run_book import NodeLinks

log = logging.getLogger(__name__)

#: failed turns of one episode before its batch is given up
MAX_TURN_ATTEMPTS = 3
#: seconds a step of a turn's episodes may take beyond their tool time (decoding, rendering)
STEP_MARGIN_S = 5.0
#: threads that step episodes with tools (tools themselves are bounded by the episode's limits)
TOOL_THREADS = 2


@dataclass
class EpisodeBatch:
    """Episodes that finish together: a training group, or the prompts of one eval job."""

    key: str  #: group id (train) or the eval job's id (eval)
    kind: str  #: "train" or "eval"
    prompts: list[str]  #: train: the group's prompt; eval: one prompt per episode
    episodes: list[EpisodeRun]
    versions: list[list[int] | None]  #: per episode, the oldest version of each stage over its turns
    #: per episode, the node that sampled its turns (a route's last stage); "" once two nodes did
    generators: list[str | None] = field(default_factory=list)
    open: int = 0
    failures: list[int] = field(default_factory=list)  #: failed turns per episode
    closed: bool = False

    def __post_init__(self) -> None:
        self.open = len(self.episodes)
        self.failures = [0] * len(self.episodes)
        self.generators = [None] * len(self.episodes)


@dataclass
class TurnJob:
    """One generation job in flight: a turn of one or more episodes."""

    job: str
    route: list[str]
    kind: str
    rows: list[tuple[EpisodeBatch, int]]  #: (batch, episode index) per row
    turn: int = 0
    keep: bool = False  #: the stages keep their caches after this turn
    prompts: list[str] = field(default_factory=list)  #: a first turn: its prompts (re-queued if it fails)
    dispatched: float = field(default_factory=time.monotonic)
    hedged: bool = False  #: a duplicate was started once (a job is hedged at most once)


@dataclass
class _Kept:
    job: str
    route: list[str]
    cached: int  #: tokens the route's caches hold
    turn: int


class TurnDriver:
    """Steps episodes between turns and dispatches their continuations (see the module docstring)."""

    def __init__(self, links: NodeLinks, jobs: dict[str, TurnJob], counters: Counter[str], *,
                 params: Callable[[str, str, int], messages.GenParams],
                 on_batch_done: Callable[[EpisodeBatch], None],
                 on_batch_failed: Callable[[EpisodeBatch], None]) -> None:
        self.links, self.jobs, self.counters = links, jobs, counters
        self._params = params  #: (kind, job id, max_new_tokens) -> sampling settings
        self._done, self._failed = on_batch_done, on_batch_failed
        self._kept: dict[tuple[str, int], _Kept] = {}
        self._tasks: set[asyncio.Task] = set()
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ results
    def on_turn(self, job: TurnJob, tokens: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]],
                versions: Sequence[int], stop_ids: frozenset[int]) -> None:
        """A checked turn of ``job`` (already out of ``jobs``): step its episodes, then go on."""
        live = [(r, b, i) for r, (b, i) in enumerate(job.rows) if not b.closed]
        if job.keep and len(job.rows) == 1:
            b, i = job.rows[0]
            self._kept[(b.key, i)] = _Kept(job.job, job.route, len(b.episodes[i].context_ids) + len(tokens[0]) - 1,
                                           job.turn)
        for _, b, i in live:
            old = b.versions[i]
            b.versions[i] = list(versions) if old is None else [min(x, y) for x, y in zip(old, versions)]
            seen = b.generators[i]
            b.generators[i] = job.route[-1] if seen in (None, job.route[-1]) else ""
        work = [(b, i, tokens[r], logprobs[r], bool(tokens[r]) and int(tokens[r][-1]) in stop_ids)
                for r, b, i in live]
        if not any(b.episodes[i].runs_tools for b, i, *_ in work):
            self._after(job, work, [self._step(*w) for w in work])
            return
        task = asyncio.get_running_loop().create_task(self._step_off_loop(job, work), name=f"polis-steps-{job.job}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _step(batch: EpisodeBatch, i: int, ids: Sequence[int], lps: Sequence[float],
              finished: bool) -> tuple[int, ...] | None:
        return batch.episodes[i].step(ids, lps, finished)

    async def _step_off_loop(self, job: TurnJob, work: list) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="polis-tools")
        loop = asyncio.get_running_loop()
        deadline = sum(b.episodes[i].tool_s_left for b, i, *_ in work) + STEP_MARGIN_S * len(work)
        started = time.monotonic()
        try:
            added = await asyncio.wait_for(loop.run_in_executor(self._pool, lambda: [self._step(*w) for w in work]),
                                           timeout=deadline)
        except asyncio.TimeoutError:
            self.counters["episode_step_timeouts"] += 1
            for b, *_ in {id(w[0]): w for w in work}.values():
                self.give_up(b, "stepping its episodes ran past the deadline")
            return
        self.counters["episode_step_seconds"] += time.monotonic() - started  # type: ignore[assignment]
        self._after(job, work, added)

    def _after(self, job: TurnJob, work: list, added: list[tuple[int, ...] | None]) -> None:
        for (b, i, *_), ids in zip(work, added):
            if b.closed:
                continue
            ep = b.episodes[i]
            if ids is not None and ep.budget <= 0:
                ep.cut_full()
                ids = None
            if ids is None:
                self._release(b.key, i)
                b.open -= 1
                if b.open == 0:
                    b.closed = True
                    self._done(b)
                continue
            self.counters["episode_turns_continued"] += 1
            self.continue_episode(b, i, job.turn + 1)

    # ------------------------------------------------------------------ continuations
    def continue_episode(self, b: EpisodeBatch, i: int, turn: int) -> None:
        """Dispatch the next turn of episode ``i`` of ``b`` (its kept caches if they are still there)."""
        ep, kept = b.episodes[i], self._kept.get((b.key, i))
        routes = self.links.gen_routes()
        if not routes:
            self.give_up(b, "no generation route")
            return
        context = ep.context_ids
        if kept is not None and kept.route in routes and kept.cached < len(context):
            job_id, route, cached, prompt = kept.job, kept.route, kept.cached, list(context[kept.cached:])
            self.counters["turns_from_cache"] += 1
        else:
            if kept is not None:
                self._release(b.key, i)
            load = Counter(tuple(j.route) for j in self.jobs.values())
            route = min(routes, key=lambda r: load[tuple(r)])
            # named for its episode; a retry gets a new name (the failed turn may still run somewhere)
            job_id = f"{b.key}.{i}" if not b.failures[i] else f"{b.key}.{i}.r{b.failures[i]}"
            cached, prompt = 0, list(context)
            self.counters["turns_recomputed"] += 1
        params = replace(self._params(b.kind, job_id, ep.budget), turn=turn, cached_tokens=cached, keep_cache=True)
        self.jobs[job_id] = TurnJob(job_id, route, b.kind, [(b, i)], turn=turn, keep=True)
        message = messages.Gen(job=job_id, route=route, prompt_ids=[prompt], params=params)
        task = asyncio.get_running_loop().create_task(self._send(job_id, route, message), name=f"polis-turn-{job_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, job_id: str, route: list[str], message: messages.Gen) -> None:
        if not await self.links.send(route[0], message):
            self.on_failed(job_id, "first stage unreachable")

    def on_failed(self, job_id: str, reason: str) -> bool:
        """A continuation failed: retry it with its whole prefix, or give its batch up. False: not ours."""
        job = self.jobs.get(job_id)
        if job is None or not job.keep:
            return False
        del self.jobs[job_id]
        b, i = job.rows[0]
        self._kept.pop((b.key, i), None)  # whatever the route held, the retry starts afresh
        if b.closed:
            return True
        self.counters["cache_misses" if reason.startswith("cache miss") else "failed_turns"] += 1
        b.failures[i] += 1
        if b.failures[i] >= MAX_TURN_ATTEMPTS:
            self.give_up(b, f"{b.failures[i]} turns of one episode failed (last: {reason})")
            return True
        log.info("turn %d of %s failed (%s); sent again with its whole prefix", job.turn, job_id, reason)
        self.continue_episode(b, i, job.turn)
        return True

    def give_up(self, b: EpisodeBatch, reason: str) -> None:
        """End a batch unfinished: free its caches, forget its jobs, hand it to the scheduler."""
        if b.closed:
            return
        b.closed = True
        for j in [j for j, job in self.jobs.items() if any(row[0] is b for row in job.rows)]:
            del self.jobs[j]
        for i in range(len(b.episodes)):
            self._release(b.key, i)
        self.counters["episode_batches_given_up"] += 1
        log.warning("episodes %s given up: %s", b.key, reason)
        self._failed(b)

    def _release(self, key: str, i: int) -> None:
        kept = self._kept.pop((key, i), None)
        if kept is None:
            return
        message = messages.GenRelease(job=kept.job, route=kept.route)
        task = asyncio.get_running_loop().create_task(self.links.send(kept.route[0], message),
                                                      name=f"polis-release-{kept.job}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def batch_rewards(b: EpisodeBatch) -> np.ndarray:
    """The finished episodes' rewards, in order."""
    return np.array([ep.outcome.reward if ep.outcome is not None else 0.0 for ep in b.episodes], dtype=np.float64)
