"""Generation jobs through the pipeline: KV-cached steps, hops, sampling on the last stage.

One job (``gen`` from the coordinator, a batch of prompts and a route of one peer
per stage) runs step by step: stage 0 embeds the prompt (later: the last sampled
tokens) and sends activations along the route; each stage runs its layers with
its KV cache for the job; the last stage samples one token per row, accumulates
tokens and log-probs, and sends the tokens back to stage 0 (``tok``) until every
row ended or ``max_new_tokens`` is reached; then it reports ``gen_done`` and the
caches are dropped along the route (``drop``). A one-stage swarm samples in place.

Multi-turn episodes (``engine.swarm.episodes``) continue a job turn after turn: a turn with
``params.keep_cache`` leaves every stage's KV cache in place, and the next turn (same job id,
``params.turn`` one higher) sends only the tokens the caches lack, saying how many they hold
(``params.cached_tokens``). Each stage counts the tokens its cache holds per job and checks that
count when a new turn of the job reaches it; a stage that holds another count (its cache was
expired, or it is not the stage the job ran on) fails the job with ``cache miss`` and the
coordinator recomputes the prefix. ``gen_release`` frees a kept cache along the whole route;
kept caches also expire like any untouched job, and the oldest go when more than
``MAX_KEPT_CACHES`` are kept. ``gen_release`` with ``cancel`` also stops a job mid-turn (a duplicate
of it on another route already delivered: the coordinator hedges stragglers); the drop it sends
along the route tells the last stage to sample no more of it.

Every message is checked before the backend sees it (route, rows, vocabulary);
a failing job is reported (``job_failed``) instead of killing the node.

Every call this module makes on the compute thread (steps and cache drops) runs at background
priority, in the order made (``engine.swarm.compute_thread``): a drop never overtakes a step of its
job already queued, and training work goes first.

What it does not know: training, rewards, how links are made.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from functools import partial

import numpy as np
from msgspec.structs import replace

from engine.net.errors import LinkClosed, NetError, ProtocolViolation
from engine.rl.rollout import rows_going_on
from engine.swarm import messages
from engine.swarm.messages import Act, Drop, Gen, GenParams, GenRelease, Ticket, Tok
from engine.swarm.node_context import NodeContext
from engine.swarm.pipeline_hops import rect

log = logging.getLogger(__name__)

#: most generation jobs a stage keeps state for at once
MAX_JOBS = 1024
#: most caches kept between the turns of episodes (the oldest is freed first)
MAX_KEPT_CACHES = 256
#: what a failing job reports instead of killing the node
JOB_ERRORS = (ProtocolViolation, NetError, LinkClosed, ValueError, RuntimeError, asyncio.TimeoutError)


def _kept_rows(keep: list[int] | None, rows: int) -> np.ndarray | None:
    """``Act.keep`` / ``Tok.keep`` as an index for a step of ``rows`` rows, or a ProtocolViolation."""
    if keep is None:
        return None
    index = np.asarray(keep, dtype=np.int64)
    if len(index) != rows or (len(index) > 1 and not (np.diff(index) > 0).all()):
        raise ProtocolViolation("keep must list one strictly increasing row per row of the step")
    return index


def _timed(fn, *args, **kwargs):
    """Compute thread: ``fn``'s result and the seconds it took (queueing on the thread excluded)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def _wire_encoding(params: GenParams | None, run_encoding: str) -> str:
    """The encoding of a generation job's activations: exact for evals, else the run's."""
    return "fp32" if params is not None and params.exact_activations else run_encoding


@dataclass
class _FirstStageJob:
    """What stage 0 keeps while a generation job decodes."""

    route: list[str]
    params: GenParams
    rows: int  #: rows its cache holds now (the job's rows, fewer once finished rows were dropped)
    touched: float = field(default_factory=time.monotonic)
    ticket: Ticket | None = None  #: the coordinator's ticket, copied into every act and drop of the job


@dataclass
class _LastStageJob:
    """What the last stage accumulates while a generation job decodes."""

    rows: int
    tokens: list[list[int]]
    logprobs: list[list[float]]
    finished: np.ndarray
    versions: list[int]
    steps: int = 0
    touched: float = field(default_factory=time.monotonic)
    #: the job row of each row of the cache (rows that finished are dropped in batches); None: every row
    live: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.live is None:
            self.live = np.arange(self.rows)


class Generation:
    """The generation jobs this stage takes part in (first, middle or last stage, or all three)."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self._first: dict[str, _FirstStageJob] = {}
        self._last: dict[str, _LastStageJob] = {}
        self._mid_touch: dict[str, float] = {}
        self._cached: dict[str, int] = {}  #: job -> tokens this stage's cache of it holds
        self._turn: dict[str, int] = {}  #: job -> the turn this stage last ran a step of
        self._kept: dict[str, float] = {}  #: jobs whose cache waits for a next turn -> when kept
        self._kept_tickets: dict[str, Ticket | None] = {}  #: those jobs -> their last turn's ticket

    # ------------------------------------------------------------------ inbound (loop, no await)
    def on_gen(self, msg: Gen) -> None:
        self._spawn(self._start(msg), msg.job)

    def on_act(self, sender: str, header: Act, x: np.ndarray) -> None:
        self._spawn(self._hop(header, x, self._expand(header, x), _kept_rows(header.keep, x.shape[0])), header.job)

    def on_tok(self, sender: str, header: Tok, payload: bytes) -> None:
        state = self._first.get(header.job)
        if state is None or header.turn != state.params.turn:
            return  # an abandoned job, or the end of a turn the coordinator already continued
        if sender != state.route[-1]:
            raise ProtocolViolation(f"tokens for {header.job} from {sender}, not the route's last stage")
        keep = _kept_rows(header.keep, len(header.tokens))
        if keep is None and len(header.tokens) != state.rows:
            raise ProtocolViolation(f"{len(header.tokens)} tokens for a job of {state.rows} rows")
        if keep is not None and keep[-1] >= state.rows:
            raise ProtocolViolation(f"keep names rows beyond the job's {state.rows}")
        self._spawn(self._tokens(header, keep), header.job, prefix="polis-tok")

    def on_drop(self, sender: str, header: Drop, payload: bytes) -> None:
        self.ctx.tasks.spawn(self._drop(header.job, header.route, header.hop, header.ticket, header.through_last,
                                        header.cancel), f"polis-drop-{header.job}")

    def on_release(self, msg: GenRelease) -> None:
        """The coordinator ends a job that kept its caches, or cancels a running one (``cancel``: a
        hedge of it won elsewhere): free its caches here and along the route."""
        if msg.route[0] != self.ctx.peer_id:
            log.warning("ignored gen_release of %s: this node is not the first stage of its route", msg.job)
            return
        running = self._first.get(msg.job)
        if running is not None and msg.cancel and running.route == msg.route:
            self._first.pop(msg.job)  # its next tokens find no job here and are dropped
            self._last.pop(msg.job, None)  # a one-stage swarm samples it here too
            self._kept_tickets[msg.job] = running.ticket
        elif msg.job in self._first or msg.job in self._last:
            return  # a turn of it is running: the release is late or mistaken; expiry frees it later
        ticket = self._kept_tickets.get(msg.job)  # the last turn's ticket: the next stages check it
        self._forget(msg.job)
        self.ctx.compute.submit_background(self.ctx.stage.rt.drop, msg.job)
        if len(msg.route) > 1:
            self.ctx.tasks.spawn(self.ctx.peers.send(msg.route[1], Drop(job=msg.job, route=msg.route, hop=1,
                                                                          through_last=True, ticket=ticket,
                                                                          cancel=msg.cancel)),
                                 f"polis-release-{msg.job}")

    def _spawn(self, coro: Coroutine, job: str, prefix: str = "polis-gen") -> None:
        self.ctx.tasks.spawn(self._guard(coro, job), f"{prefix}-{job}")

    async def _guard(self, coro: Coroutine, job: str) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except JOB_ERRORS as exc:
            log.warning("job %s failed: %s", job, exc)
            await self.ctx.coordinator.send(messages.JobFailed(job=job, reason=str(exc)[:500]))

    # ------------------------------------------------------------------ cache accounting
    async def _enter(self, job: str, params: GenParams | None, x: np.ndarray) -> None:
        """Before this stage's forward of ``x`` for ``job``: check its cache at a new turn, count ``x``."""
        turn = 0 if params is None else params.turn
        if self._turn.get(job) != turn:
            want = 0 if params is None else params.cached_tokens
            held = self._cached.get(job, 0)
            self._kept.pop(job, None)
            if want == 0 and held:
                await self.ctx.compute.run_background(self.ctx.stage.rt.drop, job)  # a fresh start of a known job
                held = 0
            elif want != held:
                self._forget(job)
                await self.ctx.compute.run_background(self.ctx.stage.rt.drop, job)
                raise ValueError(f"cache miss: this stage holds {held} tokens of the job, the turn expects {want}")
            self._turn[job] = turn
            self._cached[job] = held
        self._cached[job] = self._cached.get(job, 0) + int(x.shape[1])

    def _keep(self, job: str, ticket: Ticket | None = None) -> None:
        self._kept[job] = time.monotonic()
        self._kept_tickets[job] = ticket
        while len(self._kept) > MAX_KEPT_CACHES:
            oldest = min(self._kept, key=self._kept.__getitem__)
            self._forget(oldest)
            self.ctx.compute.submit_background(self.ctx.stage.rt.drop, oldest)

    def _forget(self, job: str) -> None:
        for book in (self._cached, self._turn, self._kept, self._kept_tickets, self._mid_touch):
            book.pop(job, None)

    # ------------------------------------------------------------------ steps
    async def _compute(self, fn, *args, **kwargs):
        """One decoding step of this stage on the compute thread, its compute time counted
        (``gen_compute_s`` / ``gen_steps``: the coordinator paces jobs in flight by them)."""
        result, seconds = await self.ctx.compute.run_background(_timed, fn, *args, **kwargs)
        counters = self.ctx.counters
        counters["gen_compute_s"] = counters.get("gen_compute_s", 0.0) + seconds
        counters["gen_steps"] = counters.get("gen_steps", 0.0) + 1
        return result

    async def _start(self, msg: Gen) -> None:
        ctx, spec, rt = self.ctx, self.ctx.stage.spec, self.ctx.stage.rt
        route = msg.route
        if not spec.is_first or len(route) != spec.num_stages or route[0] != ctx.peer_id:
            raise ProtocolViolation("generation job sent to a node that is not its first stage")
        ids = rect(msg.prompt_ids, np.int64, "prompt_ids")
        if ids.max() >= rt.vocab_size:
            raise ProtocolViolation("prompt token id outside the vocabulary")
        if len(self._first) >= MAX_JOBS and msg.job not in self._first:
            raise ProtocolViolation("too many generation jobs in flight")
        running = self._first.get(msg.job)
        if running is not None:
            if msg.params.turn <= running.params.turn:
                raise ProtocolViolation("a turn of this generation job is still running")
            del self._first[msg.job]  # its end (tok done) is still on its way; the coordinator has the result
        await self._enter(msg.job, msg.params, ids)
        self._first[msg.job] = _FirstStageJob(route=route, params=msg.params, rows=ids.shape[0], ticket=msg.ticket)
        expand = None
        if msg.params.cached_tokens == 0:  # the samples of one prompt share its prefill
            distinct, inverse = np.unique(ids, axis=0, return_inverse=True)
            if len(distinct) < len(ids):
                ids, expand = distinct, inverse.reshape(-1)
        await self._advance(msg.job, ids, counted=True, expand=expand)

    async def _advance(self, job: str, x: np.ndarray, counted: bool = False, expand: np.ndarray | None = None,
                       keep: np.ndarray | None = None) -> None:
        ctx, rt = self.ctx, self.ctx.stage.rt
        state = self._first[job]
        state.touched = time.monotonic()
        if keep is not None:
            state.rows = len(keep)
        ctx.counters["tokens_generated"] += state.rows
        if not counted:
            await self._enter(job, state.params, x)
        if ctx.stage.spec.is_last:  # a one-stage swarm samples right here
            await self._sample(job, state.route, state.params, [], x, counted=True, expand=expand, keep=keep)
            return
        tensor, payload = await self._compute(ctx.boundary.forward_encoded,
                                              partial(rt.gen_forward, expand=expand, keep=keep), job, x,
                                              _wire_encoding(state.params, ctx.stage.run_cfg.activation_encoding),
                                              state.route[1], ctx.stage.spec.stage_index)
        if self._first.get(job) is not state:  # cancelled (or restarted) while this step computed
            if job not in self._first:
                ctx.compute.submit_background(rt.drop, job)
            return
        await ctx.peers.send(state.route[1], Act(kind="gen", job=job, route=state.route, hop=1,
                                                 versions=[int(rt.version)], tensor=tensor, step=0, mb=0,
                                                 params=state.params, ticket=state.ticket,
                                                 expand=None if expand is None else expand.tolist(),
                                                 keep=None if keep is None else keep.tolist()), payload)
        ctx.boundary.sent(state.route[1], tensor)

    def _expand(self, header: Act, x: np.ndarray) -> np.ndarray | None:
        """The job's rows of a prefill of distinct rows (``Act.expand``), checked against ``x`` and
        against this stage's cache of the job (a continuing cache is never expanded): a
        ProtocolViolation, struck against the sender, before anything is computed."""
        if header.expand is None:
            return None
        if max(header.expand) >= x.shape[0]:
            raise ProtocolViolation("expand names rows the activations do not have")
        fresh = header.params is not None and header.params.cached_tokens == 0 and \
            (self._turn.get(header.job) != header.params.turn or not self._cached.get(header.job))
        if not fresh:
            raise ProtocolViolation("expand on a step that continues a cache")
        return np.asarray(header.expand, dtype=np.int64)

    async def _hop(self, header: Act, x: np.ndarray, expand: np.ndarray | None, keep: np.ndarray | None) -> None:
        ctx, rt = self.ctx, self.ctx.stage.rt
        ctx.counters["tokens_generated"] += x.shape[0] if expand is None else len(expand)
        if ctx.stage.spec.is_last:
            await self._sample(header.job, header.route, header.params, header.versions, x, expand=expand,
                               keep=keep)
            return
        if len(self._mid_touch) >= MAX_JOBS and header.job not in self._mid_touch:
            raise ProtocolViolation("too many generation jobs in flight")
        self._mid_touch[header.job] = time.monotonic()
        await self._enter(header.job, header.params, x)
        hop = header.hop + 1
        tensor, payload = await self._compute(ctx.boundary.forward_encoded,
                                              partial(rt.gen_forward, expand=expand, keep=keep), header.job, x,
                                              _wire_encoding(header.params, ctx.stage.run_cfg.activation_encoding),
                                              header.route[hop], ctx.stage.spec.stage_index)
        await ctx.peers.send(header.route[hop], replace(header, hop=hop, versions=[*header.versions, int(rt.version)],
                                                        tensor=tensor), payload)
        ctx.boundary.sent(header.route[hop], tensor)

    async def _sample(self, job: str, route: list[str], params: GenParams | None, versions_so_far: list[int],
                      x: np.ndarray, counted: bool = False, expand: np.ndarray | None = None,
                      keep: np.ndarray | None = None) -> None:
        ctx, rt = self.ctx, self.ctx.stage.rt
        if params is None:
            raise ProtocolViolation("generation step without sampling parameters")
        if not counted:
            await self._enter(job, params, x)
        versions = [*versions_so_far, int(rt.version)]
        rows = x.shape[0] if expand is None else len(expand)
        state = self._last.get(job)
        if state is None:
            if len(self._last) > MAX_JOBS:
                raise ProtocolViolation("too many generation jobs in flight")
            state = self._last[job] = _LastStageJob(rows=rows, tokens=[[] for _ in range(rows)],
                                                    logprobs=[[] for _ in range(rows)],
                                                    finished=np.zeros(rows, dtype=bool), versions=versions)
        if rows != len(state.live) or len(versions) != len(state.versions):
            raise ProtocolViolation("generation step does not match its job")
        state.versions = [min(a, b) for a, b in zip(state.versions, versions)]
        state.touched = time.monotonic()
        tokens, logprobs = await self._compute(rt.gen_sample, job, x, temperature=params.temperature,
                                               top_p=params.top_p, seed=params.seed, step=state.steps,
                                               expand=expand, keep=keep, job_rows=state.live, of_rows=state.rows)
        for c, r in enumerate(state.live):
            if not state.finished[r]:
                state.tokens[r].append(int(tokens[c]))
                state.logprobs[r].append(float(logprobs[c]))
                state.finished[r] = int(tokens[c]) in params.stop_ids
        state.steps += 1
        done = bool(state.finished.all()) or state.steps >= params.max_new_tokens
        # a cache kept for the episode's next turn keeps every row
        going_on = None if done or params.keep_cache else rows_going_on(state.finished[state.live])
        if going_on is not None:
            state.live, tokens = state.live[going_on], tokens[going_on]
        if done:
            self._last.pop(job, None)  # (a cancelled job is gone already)
            if params.keep_cache:
                self._keep(job)
            else:
                self._forget(job)
                await ctx.compute.run_background(rt.drop, job)
            empty = [params.stop_ids[0]]  # a row that produced nothing reads as an immediate stop
            await ctx.coordinator.send(messages.GenDone(job=job, tokens=[t or empty for t in state.tokens],
                                                        logprobs=[lp or [0.0] for lp in state.logprobs],
                                                        versions=state.versions))
        if len(route) == 1:
            if not done:
                await self._advance(job, tokens[:, None], keep=going_on)
            else:
                self._first.pop(job, None)
            return
        await ctx.peers.send(route[0], Tok(job=job, tokens=[int(t) for t in tokens], done=done, turn=params.turn,
                                           keep=None if going_on is None else going_on.tolist()))

    async def _tokens(self, header: Tok, keep: np.ndarray | None) -> None:
        ctx, rt = self.ctx, self.ctx.stage.rt
        job = header.job
        state = self._first[job]
        if header.done:
            del self._first[job]
            if state.params.keep_cache:
                self._keep(job, state.ticket)
                return
            self._forget(job)
            await ctx.compute.run_background(rt.drop, job)
            if len(state.route) > 2:
                await ctx.peers.send(state.route[1], Drop(job=job, route=state.route, hop=1, ticket=state.ticket))
            return
        tokens = np.asarray(header.tokens, dtype=np.int64)
        if tokens.max() >= rt.vocab_size:
            raise ProtocolViolation("sampled token id outside the vocabulary")
        await self._advance(job, tokens[:, None], keep=keep)

    async def _drop(self, job: str, route: list[str], hop: int, ticket: Ticket | None,
                    through_last: bool = False, cancel: bool = False) -> None:
        if cancel:
            self._last.pop(job, None)  # a cancelled job: this last stage samples no more of it
        elif job in self._last:
            return  # a new turn of it is running here
        self._forget(job)
        await self.ctx.compute.run_background(self.ctx.stage.rt.drop, job)
        if hop + 1 < len(route) - (0 if through_last else 1):
            await self.ctx.peers.send(route[hop + 1], Drop(job=job, route=route, hop=hop + 1,
                                                           through_last=through_last, ticket=ticket))

    # ------------------------------------------------------------------ housekeeping
    def abandon(self) -> None:
        """Forget every job (coordinator lost, or reassigned) and free its caches."""
        jobs = set(self._first) | set(self._last) | set(self._mid_touch) | set(self._cached)
        self._first.clear()
        self._last.clear()
        for book in (self._cached, self._turn, self._kept, self._kept_tickets, self._mid_touch):
            book.clear()
        for job in jobs:
            self.ctx.compute.submit_background(self.ctx.stage.rt.drop, job)

    def expire(self, cutoff: float) -> None:
        """Free the caches of jobs untouched since ``cutoff`` (monotonic seconds)."""
        stale = [j for j, s in self._first.items() if s.touched < cutoff]
        stale += [j for j, t in self._mid_touch.items() if t < cutoff]
        stale += [j for j, s in self._last.items() if s.touched < cutoff]  # a job whose first stage vanished
        stale += [j for j, t in self._kept.items() if t < cutoff]  # an episode the coordinator never released
        for job in stale:
            self._first.pop(job, None)
            self._last.pop(job, None)
            self._forget(job)
            self.ctx.compute.submit_background(self.ctx.stage.rt.drop, job)
