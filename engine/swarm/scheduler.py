"""The coordinator's generation scheduling: prompts out, scored rollouts in.

:class:`GenerationScheduler` keeps jobs (``prompts_per_job`` prompts of one token length x G
samples) on every complete generation route (any replica of each stage: trainers and inference
replicas), as many as the route needs to hide its latency (``engine.swarm.inflight``: Little's
law over the nodes' measured link RTTs and compute per step, at most ``generations_in_flight``),
while the replay buffer is not full, each next job to the route that would finish it soonest by
its measured throughput (``engine.swarm.route_weights``: a route through a 4x slower node takes
about a quarter of the jobs when the buffer bounds them), eval jobs first
(``engine.swarm.eval_scheduler`` says which). Results are checked first (``engine.swarm.rollout_checks``: ids in the
vocabulary, cut at the first stop id, log-probs <= 0, no version from the future; a refused
result flags its generator and its prompts are queued again). Rewards are computed here from the returned
token ids (never trusted from a node), with the update planner's advantage rule
(``engine.rl.update``) for the record; every completed rollout is written to SQLite at once,
so none is ever lost. Every rollout is an episode of the run's task (``engine.rl.run_task``):
a job's rows are episodes, and an episode that goes on after its turn (an environment with
tools) is continued by ``engine.swarm.episodes``; a group is scored and stored when all its
episodes have ended, with its loss mask (model ids 1, observation ids 0). Each rollout keeps
the oldest version every stage served it with over its turns; staleness is counted from those
when it is trained (``engine.swarm.step_runner``).

A first-turn job far past its route's expected time is *hedged*: duplicated (same rows, same
seed) on the fastest other route. The first checked result wins; the other job leaves the books
at once (a late result of it is an unexpected result, never scored twice) and its route is told
to stop (``gen_release`` with ``cancel``). A hedged job that fails leaves its twin to carry the rows.

Requests from outside the run (``engine.swarm.serve_queue``, fed by the OpenAI-compatible
endpoint) go first, up to ``SERVE_IN_FLIGHT`` beyond a route's budget: each is one job of kind
``serve`` whose rows are its ``n`` samples, sampled as the request asks over exact activations,
checked like any result and handed back to its caller; it is never scored, stored or trained on
(its tokens earn the route the same verified credit).

A job whose route loses a node, times out or comes back malformed is failed and its prompts
are queued again (a serve job's request, while its deadline allows). It reaches nodes only through
``NodeLinks.send`` and never sees activations or weights. What it does not know: training steps, websockets.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter, deque
from typing import Sequence

import numpy as np

from engine.rl.episode_outcome import EpisodeOutcome, EvalScore, OneTurnEpisode, one_turn_outcome
from engine.rl.prompt_keys import LengthBuckets
from engine.rl.run_task import RunTask
from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm.episodes import EpisodeBatch, TurnDriver, TurnJob, batch_rewards
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.inflight import InFlightPacer
from engine.swarm.rollout_checks import RefusedResult, RolloutLimits, check_result
from engine.swarm.route_weights import RouteWeights
from engine.swarm.run_book import NodeLinks, RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.serve_queue import ServeQueue, ServeRequest
from engine.swarm.store import Store

log = logging.getLogger(__name__)

#: scored training completions kept for people to read (``samples`` in the stats API)
MAX_SAMPLES = 6
#: longest question / answer text of a kept sample (characters)
MAX_SAMPLE_CHARS = 400
#: turns of a kept sample's transcript (the last ones)
MAX_SAMPLE_TURNS = 8
#: finished training episodes kept for the shortcut monitor (``engine.swarm.rollout_monitor``)
MAX_OUTCOMES = 512
#: serve jobs a route may run beyond its in-flight budget (an external request does not wait for a training job)
SERVE_IN_FLIGHT = 4


def sample_record(outcome: EpisodeOutcome, version: int) -> dict:
    """A finished episode as the stats API shows it: the question, every turn after it, the reward."""
    final = next((text for role, text in reversed(outcome.transcript) if role == "assistant"), "")
    return {"prompt": outcome.question[-MAX_SAMPLE_CHARS:], "answer": final[:MAX_SAMPLE_CHARS],
            "reward": round(float(outcome.reward), 4), "version": int(version),
            "turns": [{"role": role, "text": text[:MAX_SAMPLE_CHARS]}
                      for role, text in outcome.transcript[-MAX_SAMPLE_TURNS:]],
            "tool_calls": outcome.tool_calls, "cuts": list(outcome.cuts)}


class GenerationScheduler:
    """Generation jobs of one run. Lives on the coordinator's event loop."""

    def __init__(self, run: RunConfig, rules: UpdateRules, task: RunTask, store: Store,
                 book: RunBook, evals: EvalScheduler, links: NodeLinks, *, vocab_size: int,
                 job_timeout_s: float = 60.0) -> None:
        self.run, self.rules, self.task = run, rules, task
        #: what an honest result can contain (``engine.swarm.rollout_checks``); vocab_size: the model's
        self.limits = RolloutLimits(vocab_size=vocab_size, stop_ids=frozenset(task.stop_ids),
                                    max_new_tokens=run.sampling.max_new_tokens)
        #: refused results per generator (the last stage of their route): evidence for eviction
        self.flagged: Counter[str] = Counter()
        self.store, self.book, self.evals, self.links = store, book, evals, links
        self.job_timeout_s = job_timeout_s
        epoch = int(store.get_meta("prompt_epoch", 0))
        self._prompts = task.train_prompts(run.seed + 7919 * epoch)
        store.set_meta("prompt_epoch", epoch + 1)
        self._retry_prompts: deque[str] = deque()
        self._length_buckets = LengthBuckets(run.prompts_per_job, lambda key: len(task.prompt_ids(key)))
        self._job_ids = itertools.count(int(time.time() * 1000) % 10**9)
        self.jobs: dict[str, TurnJob] = {}
        #: jobs in flight per route, from the nodes' measured RTTs and compute (fed by their reports)
        self.pacer = InFlightPacer()
        #: each route's measured throughput: which route gets the next job, which job is a straggler
        self.weights = RouteWeights()
        #: hedged jobs, both ways: job id -> the id of its duplicate on another route
        self._twins: dict[str, str] = {}
        self._cancels: set[asyncio.Task] = set()  #: cancels of hedges that lost, on their way
        self.received_rollouts = 0
        #: rollouts per peer that was on the route of their first turn (every stage counts)
        self.scored_by_peer: Counter[str] = Counter()
        #: the latest finished episodes, one per group: question, its turns, reward, version (newest last)
        self.samples: deque[dict] = deque(maxlen=MAX_SAMPLES)
        #: the latest finished training episodes' outcomes (for the shortcut monitor)
        self.outcomes: deque = deque(maxlen=MAX_OUTCOMES)
        #: requests from outside the run (``engine.swarm.openai_api``): served before evals and training
        self.serve = ServeQueue()
        self.turns = TurnDriver(links, self.jobs, book.counters, params=self._params,
                                on_batch_done=self._batch_done, on_batch_failed=self._batch_failed)

    def _next_job_id(self, kind: str) -> str:
        return f"{kind[0]}{next(self._job_ids)}"

    async def fill(self) -> None:
        """Dispatch generation up to the in-flight budget of every route, each next job to the route that
        would finish it soonest (``engine.swarm.route_weights``): external requests first (up to
        ``SERVE_IN_FLIGHT`` over a route's budget: they are small and someone waits), then evals, then
        training; then hedge stragglers."""
        routes = self.links.gen_routes()
        if not routes:
            return
        load = Counter(tuple(j.route) for j in self.jobs.values())
        limits = {tuple(r): self.pacer.limit(r, self.run.generations_in_flight) for r in routes}
        serve_limits = {r: n + SERVE_IN_FLIGHT for r, n in limits.items()}
        while len(self.serve) and (route := self.weights.pick_gen_route(routes, load, serve_limits)) is not None:
            request = self.serve.next_request()
            if request is None:
                break
            if not await self._dispatch(route, self._serve_job(route, request), load):
                serve_limits[tuple(route)] = 0
        while (route := self.weights.pick_gen_route(routes, load, limits)) is not None:
            message = self._next_job(route)
            if message is None:
                break
            if not await self._dispatch(route, message, load):
                limits[tuple(route)] = 0  # not again in this fill
        await self._hedge(routes, load)

    async def _dispatch(self, route: list[str], message: messages.Gen, load: Counter) -> bool:
        load[tuple(route)] += 1
        self.weights.gen_started(message.job, route, load[tuple(route)])
        if await self.links.send(route[0], message):
            return True
        self._fail_job(message.job, "first stage unreachable")
        return False

    async def _hedge(self, routes: list[list[str]], load: Counter) -> None:
        """Duplicate each straggling first-turn job on the fastest other route; the first result
        wins (``on_gen_done``), the other is cancelled and never reaches the buffer."""
        now = time.monotonic()
        for job in [j for j in self.jobs.values() if j.job not in self._twins and j.turn == 0 and not j.keep
                    and not j.hedged and self.weights.is_straggler(j.route, now - j.dispatched)]:
            route = self.weights.hedge_route(job.route, routes)
            if route is None:
                return
            # once: a twin that failed (refused, its node left) is not replaced every tick
            job.hedged = True
            twin = TurnJob(self._next_job_id(job.kind), route, job.kind, job.rows, prompts=job.prompts, hedged=True)
            self.jobs[twin.job] = twin
            self._twins[job.job], self._twins[twin.job] = twin.job, job.job
            load[tuple(route)] += 1
            self.weights.gen_started(twin.job, route, load[tuple(route)])
            self.book.counters["hedged_jobs"] += 1
            log.info("job %s on %s is a straggler (%.1f s); hedged as %s on %s", job.job, job.route,
                     now - job.dispatched, twin.job, route)
            ids = [list(b.episodes[i].context_ids) for b, i in job.rows]
            budget = min(b.episodes[i].budget for b, i in job.rows)
            # the original job's seed: the duplicate samples the same rollout wherever numerics agree
            message = messages.Gen(job=twin.job, route=route, prompt_ids=ids,
                                   params=self._params(job.kind, job.job, budget))
            if not await self.links.send(route[0], message):
                self._fail_job(twin.job, "first stage unreachable")

    def _cancel_twin(self, job_id: str) -> None:
        """``job_id``'s result won: its twin leaves the books and its route stops decoding it."""
        twin_id = self._twins.pop(job_id, None)
        if twin_id is None:
            return
        self._twins.pop(twin_id, None)
        twin = self.jobs.pop(twin_id, None)
        self.weights.gen_abandoned(twin_id)
        if twin is None:
            return
        self.book.counters["hedges_cancelled"] += 1
        self._stop_on_route(twin)

    def _stop_on_route(self, job: TurnJob) -> None:
        """Tell ``job``'s route to stop decoding it (its result is no longer wanted)."""
        message = messages.GenRelease(job=job.job, route=job.route, cancel=True)
        task = asyncio.get_running_loop().create_task(self.links.send(job.route[0], message),
                                                      name=f"polis-coord-cancel-{job.job}")
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    def _drop_abandoned_serve_jobs(self) -> None:
        """Serve jobs whose caller stopped waiting (deadline, disconnect) leave the books and their
        route stops decoding them, so they hold no slot until the job timeout."""
        wanted = self.serve.request_of
        for job in [j for j in self.jobs.values() if j.kind == "serve" and wanted(j.rows[0][0].key) is None]:
            del self.jobs[job.job]
            self._twins.pop(job.job, None)
            self.weights.gen_abandoned(job.job)
            self.book.counters["serve_jobs_abandoned"] += 1
            self._stop_on_route(job)

    def _params(self, kind: str, job_id: str, max_new_tokens: int) -> messages.GenParams:
        """Sampling settings of a job's turn (evals decode greedily over exact activations; a serve job
        samples as its request asks, over exact activations too); the seed follows the job id."""
        greedy = kind == "eval"
        seed = int(np.random.default_rng([self.run.seed, *job_id.encode()]).integers(2**62))
        served = self.serve.request_of(job_id) if kind == "serve" else None
        if served is not None:
            return messages.GenParams(max_new_tokens=max_new_tokens, temperature=served.temperature,
                                      top_p=max(served.top_p, 1e-6), seed=seed if served.seed is None else served.seed,
                                      stop_ids=list(self.task.stop_ids), exact_activations=True)
        return messages.GenParams(max_new_tokens=max_new_tokens,
                                  temperature=0.0 if greedy else self.run.sampling.temperature,
                                  top_p=1.0 if greedy else self.run.sampling.top_p, seed=seed,
                                  stop_ids=list(self.task.stop_ids), exact_activations=greedy)

    def _next_job(self, route: list[str]) -> messages.Gen | None:
        max_new = self.run.sampling.max_new_tokens
        prompts = self.evals.next_batch()
        if prompts is not None:
            job_id = self._next_job_id("eval")
            self.evals.dispatched(job_id, prompts)
            batches = [EpisodeBatch(job_id, "eval", prompts, [self.task.open_episode(p, max_new) for p in prompts],
                                    [None] * len(prompts))]
            rows = [(batches[0], i) for i in range(len(prompts))]
        elif self.evals.baseline_running() or self.book.finished or \
                self.store.ready_group_count() + self._train_groups_in_flight() >= 2 * self.run.prompts_per_step:
            return None  # rollouts of version 0 wait for the "before" eval; the buffer holds two batches
        else:
            prompts = self._next_prompt_batch()
            job_id = self._next_job_id("train")
            g = self.run.group_size
            batches = [EpisodeBatch(f"{job_id}:{k}", "train", [p],
                                    [self.task.open_episode(p, max_new) for _ in range(g)], [None] * g)
                       for k, p in enumerate(prompts)]
            rows = [(b, i) for b in batches for i in range(g)]
        job = TurnJob(job_id, route, batches[0].kind, rows, prompts=prompts)
        self.jobs[job.job] = job
        ids = [list(b.episodes[i].context_ids) for b, i in rows]
        budget = min(b.episodes[i].budget for b, i in rows)
        return messages.Gen(job=job.job, route=route, prompt_ids=ids, params=self._params(job.kind, job.job, budget))

    def _serve_job(self, route: list[str], request: ServeRequest) -> messages.Gen:
        """An external request as one generation job of kind ``serve``: ``n`` rows of its prompt, never
        scored, stored or trained on (``_batch_done`` hands the ids back to ``self.serve``)."""
        job_id = self._next_job_id("serve")
        self.serve.dispatched(job_id, request)

        def unscored(ids: Sequence[int], logprobs: Sequence[float]) -> EpisodeOutcome:
            return one_turn_outcome(ids, logprobs, 0.0, EvalScore(0.0, 0.0), {}, "", None, "", "")

        episodes = [OneTurnEpisode(request.prompt_ids, request.max_new_tokens, unscored) for _ in range(request.n)]
        batch = EpisodeBatch(job_id, "serve", [], list(episodes), [None] * request.n)
        job = TurnJob(job_id, route, "serve", [(batch, i) for i in range(request.n)])
        self.jobs[job_id] = job
        return messages.Gen(job=job_id, route=route, prompt_ids=[list(request.prompt_ids)] * request.n,
                            params=self._params("serve", job_id, request.max_new_tokens))

    def _train_groups_in_flight(self) -> int:
        return len({id(b) for j in self.jobs.values() if j.kind == "train" for b, _ in j.rows})

    def _next_prompt_batch(self) -> list[str]:
        """``prompts_per_job`` prompts of one token length (re-queued ones first)."""
        while True:
            prompt = self._retry_prompts.popleft() if self._retry_prompts else next(self._prompts)
            batch = self._length_buckets.add(prompt)
            if batch is not None:
                return batch

    # ------------------------------------------------------------------ results
    def on_gen_done(self, sender: str, m: messages.GenDone) -> None:
        job = self.jobs.get(m.job)
        if job is None or sender != job.route[-1]:
            self.book.counters["unexpected_results"] += 1
            return
        rows = len(job.rows)
        if len(m.tokens) != rows or len(m.logprobs) != rows or len(m.versions) != len(job.route) or \
                any(len(t) != len(lp) for t, lp in zip(m.tokens, m.logprobs)):
            self.book.counters["malformed_results"] += 1
            self._fail_job(job.job, "malformed result")
            return
        try:
            # trainers that stepped report the version being applied before the coordinator records it
            checked = check_result(m.tokens, m.logprobs, m.versions, self.limits,
                                   max(self.book.version, self.book.applying))
        except RefusedResult as exc:
            self.book.counters["refused_results"] += 1
            self.flagged[sender] += 1  # the last stage sampled it
            log.warning("refused job %s from %s: %s", job.job, sender, exc)
            self._fail_job(job.job, f"refused: {exc}")
            return
        del self.jobs[job.job]
        tokens = sum(len(t) for t in checked.tokens)
        self.weights.gen_finished(job.job, tokens)
        # verified credit: the result passed its checks; every stage of the route computed every token
        self.book.credit.add(job.route, tokens_generated=tokens)
        self._cancel_twin(job.job)
        m = messages.GenDone(job=m.job, tokens=checked.tokens, logprobs=checked.logprobs, versions=checked.versions)
        counters = self.book.counters  # wall time from dispatch to the last token, per kind of job
        counters[f"{job.kind}_job_seconds"] += time.monotonic() - job.dispatched
        counters[f"{job.kind}_jobs_done"] += 1
        if job.kind == "train" and job.turn == 0:  # an episode counts once, for the route of its first turn
            for peer in set(job.route):
                self.scored_by_peer[peer] += len(job.rows)
        self.turns.on_turn(job, m.tokens, m.logprobs, m.versions, self.limits.stop_ids)

    def _batch_done(self, b: EpisodeBatch) -> None:
        """Every episode of ``b`` ended: record an eval job, or score and store a training group."""
        outcomes = [ep.outcome for ep in b.episodes]
        assert all(o is not None for o in outcomes)
        versions = [v if v is not None else [self.book.version] for v in b.versions]
        if b.kind == "serve":
            lowest = [min(v[s] for v in versions) for s in range(len(versions[0]))]
            self.serve.finished(b.key, [o.completion_ids for o in outcomes], lowest)  # type: ignore[union-attr]
            return
        if b.kind == "eval":
            lowest = [min(v[s] for v in versions) for s in range(len(versions[0]))]
            self.evals.on_scores(b.key, [o.score for o in outcomes], lowest)  # type: ignore[union-attr]
            return
        rewards = batch_rewards(b)
        adv, _ = self.rules.advantages(rewards[None, :])
        rows = [dict(group_id=b.key, prompt=b.prompts[0], tokens=o.completion_ids, behaviour_logprobs=o.logprobs,
                     loss_mask=o.loss_mask, versions=v, min_version=min(v), reward=float(r), advantage=float(a),
                     generator=gen or None)  # the log-prob audit (engine.swarm.logprob_audit) checks it
                for o, v, r, a, gen in zip(outcomes, versions, rewards, adv[0], b.generators)]  # type: ignore[union-attr]
        self.store.add_rollouts(rows)
        self.received_rollouts += len(rows)
        self.outcomes.extend(outcomes)
        first = outcomes[0]
        assert first is not None
        self.samples.append(sample_record(first, min(versions[0])))
        counters = self.book.counters
        counters["completion_tokens"] += sum(sum(o.loss_mask) for o in outcomes if o is not None)
        counters["reward_sum"] += float(rewards.sum())
        counters["reward_count"] += rewards.size

    def _batch_failed(self, b: EpisodeBatch) -> None:
        if b.kind == "train":
            self._retry_prompts.extend(b.prompts)
        elif b.kind == "serve":
            self.serve.failed(b.key, "its episodes were given up")
        else:
            self.evals.on_failed(b.key)

    def on_job_failed(self, sender: str, job_id: str, reason: str) -> None:
        """A node on the job's route reports it failed (reports from elsewhere are ignored)."""
        job = self.jobs.get(job_id)
        if job is not None and sender in job.route:
            self._fail_job(job_id, reason)

    def _fail_job(self, job_id: str, reason: str) -> None:
        self.weights.gen_abandoned(job_id)
        twin_id = self._twins.pop(job_id, None)
        if twin_id is not None:  # a hedged job: its twin still runs and carries the rows alone
            self._twins.pop(twin_id, None)
            self.jobs.pop(job_id, None)
            self.book.counters["failed_jobs"] += 1
            log.info("job %s failed (%s); its hedge %s carries on", job_id, reason, twin_id)
            return
        if self.turns.on_failed(job_id, reason):
            return  # a continuation: retried (or its batch given up) by the turn driver
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        self.book.counters["failed_jobs"] += 1
        log.info("job %s failed (%s); its prompts are queued again", job_id, reason)
        for b, _ in job.rows:
            b.closed = True
        if job.kind == "train":
            self._retry_prompts.extend(job.prompts)
        elif job.kind == "serve":
            self.serve.failed(job_id, reason)
        else:
            self.evals.on_failed(job_id)

    def on_node_lost(self, peer_id: str) -> None:
        self.pacer.forget(peer_id)
        for job_id in [j for j, job in self.jobs.items() if peer_id in job.route]:
            self._fail_job(job_id, f"node {peer_id} left")

    def expire_jobs(self) -> None:
        self.serve.expire()
        self._drop_abandoned_serve_jobs()
        cutoff = time.monotonic() - self.job_timeout_s
        for job_id in [j for j, job in self.jobs.items() if job.dispatched < cutoff]:
            self._fail_job(job_id, "timed out")
        for job_id in [j for j in self._twins if j not in self.jobs and self._twins[j] not in self.jobs]:
            del self._twins[job_id]  # both gone another way (their batch given up)
