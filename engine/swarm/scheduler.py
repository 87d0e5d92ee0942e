"""The coordinator's generation scheduling: prompts out, scored rollouts in.

:class:`GenerationScheduler` keeps jobs (``prompts_per_job`` prompts of one token length x G
samples) on every complete generation route (any replica of each stage: trainers and inference
replicas), as many as the route needs to hide its latency (``engine.swarm.inflight``: Little's
law over the nodes' measured link RTTs and compute per step, at most ``generations_in_flight``),
while the replay buffer is not full, eval jobs first
(``engine.swarm.eval_scheduler`` says which). Results are checked first (``engine.swarm.rollout_checks``: ids in the
vocabulary, cut at the first stop id, log-probs <= 0, no version from the future; a refused
result flags its generator and its prompts are queued again). Rewards are computed here from the returned
token ids (never trusted from a node), with the update planner's advantage rule
(``engine.rl.update``) for the record; every completed rollout is written to SQLite at once,
so none is ever lost. Each rollout keeps the version every stage served it with; staleness
is counted from those when it is trained (``engine.swarm.step_runner``).

A job whose route loses a node, times out or comes back malformed is failed and its prompts
are queued again. It reaches nodes only through ``NodeLinks.send`` and never sees
activations or weights. What it does not know: training steps, websockets.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.inflight import InFlightPacer
from engine.swarm.rollout_checks import RefusedResult, RolloutLimits, check_result
from engine.swarm.run_book import NodeLinks, RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.run_task import RunTask
from engine.swarm.store import Store

log = logging.getLogger(__name__)

#: scored training completions kept for people to read (``samples`` in the stats API)
MAX_SAMPLES = 6
#: longest question / answer text of a kept sample (characters)
MAX_SAMPLE_CHARS = 400


@dataclass
class GenJob:
    job: str
    route: list[str]
    prompts: list[str]  #: prompts of one token length (train: each sampled group_size times)
    kind: str  #: "train" or "eval"
    dispatched: float = field(default_factory=time.monotonic)


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
        self._length_buckets: dict[int, list[str]] = defaultdict(list)
        self._job_ids = itertools.count(int(time.time() * 1000) % 10**9)
        self.jobs: dict[str, GenJob] = {}
        #: jobs in flight per route, from the nodes' measured RTTs and compute (fed by their reports)
        self.pacer = InFlightPacer()
        self.received_rollouts = 0
        #: rollouts scored per peer that was on their generation route (every stage counts)
        self.scored_by_peer: Counter[str] = Counter()
        #: the latest scored completions, one per job: question, answer, reward, version (newest last)
        self.samples: deque[dict] = deque(maxlen=MAX_SAMPLES)

    def _next_job_id(self, kind: str) -> str:
        return f"{kind[0]}{next(self._job_ids)}"

    async def fill(self) -> None:
        """Dispatch generation (eval first) up to the in-flight budget of every route."""
        routes = self.links.gen_routes()
        if not routes:
            return
        load = Counter(tuple(j.route) for j in self.jobs.values())
        # least-loaded routes first, so that when the buffer is nearly full no route starves
        for route in sorted(routes, key=lambda r: load[tuple(r)]):
            limit = self.pacer.limit(route, self.run.generations_in_flight)
            while load[tuple(route)] < limit:
                message = self._next_job(route)
                if message is None:
                    break
                load[tuple(route)] += 1
                if not await self.links.send(route[0], message):
                    self._fail_job(message.job, "first stage unreachable")
                    break

    def _next_job(self, route: list[str]) -> messages.Gen | None:
        temperature, top_p = self.run.sampling.temperature, self.run.sampling.top_p
        prompts = self.evals.next_batch()
        if prompts is not None:
            job = GenJob(self._next_job_id("eval"), route, prompts, "eval")
            self.evals.dispatched(job.job, prompts)
            ids = [self.task.prompt_ids(p) for p in prompts]
            temperature, top_p = 0.0, 1.0  # greedy
        elif self.evals.baseline_running() or self.book.finished or \
                self.store.ready_group_count() + self._train_groups_in_flight() >= 2 * self.run.prompts_per_step:
            return None  # rollouts of version 0 wait for the "before" eval; the buffer holds two batches
        else:
            prompts = self._next_prompt_batch()
            job = GenJob(self._next_job_id("train"), route, prompts, "train")
            ids = [self.task.prompt_ids(p) for p in prompts for _ in range(self.run.group_size)]
        seed = int(np.random.default_rng([self.run.seed, int(job.job[1:])]).integers(2**62))
        self.jobs[job.job] = job
        params = messages.GenParams(max_new_tokens=self.run.sampling.max_new_tokens, temperature=temperature,
                                    top_p=top_p, seed=seed, stop_ids=list(self.task.stop_ids))
        return messages.Gen(job=job.job, route=route, prompt_ids=ids, params=params)

    def _train_groups_in_flight(self) -> int:
        return sum(len(j.prompts) for j in self.jobs.values() if j.kind == "train")

    def _next_prompt_batch(self) -> list[str]:
        """``prompts_per_job`` prompts of one token length (re-queued ones first)."""
        want = self.run.prompts_per_job
        while True:
            prompt = self._retry_prompts.popleft() if self._retry_prompts else next(self._prompts)
            bucket = self._length_buckets[len(self.task.prompt_ids(prompt))]
            bucket.append(prompt)
            if len(bucket) >= want:
                batch = bucket[:want]
                del bucket[:want]
                return batch

    # ------------------------------------------------------------------ results
    def on_gen_done(self, sender: str, m: messages.GenDone) -> None:
        job = self.jobs.get(m.job)
        if job is None or sender != job.route[-1]:
            self.book.counters["unexpected_results"] += 1
            return
        rows = len(job.prompts) * (1 if job.kind == "eval" else self.run.group_size)
        if len(m.tokens) != rows or len(m.logprobs) != rows or len(m.versions) != len(job.route) or \
                any(len(t) != len(lp) for t, lp in zip(m.tokens, m.logprobs)):
            self.book.counters["malformed_results"] += 1
            self._fail_job(job.job, "malformed result")
            return
        try:
            checked = check_result(m.tokens, m.logprobs, m.versions, self.limits, self.book.version)
        except RefusedResult as exc:
            self.book.counters["refused_results"] += 1
            self.flagged[sender] += 1  # the last stage sampled it
            log.warning("refused job %s from %s: %s", job.job, sender, exc)
            self._fail_job(job.job, f"refused: {exc}")
            return
        del self.jobs[job.job]
        m = messages.GenDone(job=m.job, tokens=checked.tokens, logprobs=checked.logprobs, versions=checked.versions)
        counters = self.book.counters  # wall time from dispatch to the last token, per kind of job
        counters[f"{job.kind}_job_seconds"] += time.monotonic() - job.dispatched
        counters[f"{job.kind}_jobs_done"] += 1
        if job.kind == "eval":
            self.evals.on_result(job.job, m.tokens, m.versions)
        else:
            self._score_groups(job, m)

    def _score_groups(self, job: GenJob, m: messages.GenDone) -> None:
        g = self.run.group_size
        rewards = np.array([[self.task.reward(prompt, t) for t in m.tokens[k * g:(k + 1) * g]]
                            for k, prompt in enumerate(job.prompts)])
        adv, _ = self.rules.advantages(rewards)
        min_version = min(m.versions)
        rows = []
        for k, prompt in enumerate(job.prompts):
            sl = slice(k * g, (k + 1) * g)
            rows += [dict(group_id=f"{job.job}:{k}", prompt=prompt, tokens=t, behaviour_logprobs=lp,
                          versions=m.versions, min_version=min_version, reward=float(r), advantage=float(a))
                     for t, lp, r, a in zip(m.tokens[sl], m.logprobs[sl], rewards[k], adv[k])]
        self.store.add_rollouts(rows)
        self.received_rollouts += len(rows)
        question, answer = self.task.sample_text(job.prompts[0], m.tokens[0])
        self.samples.append({"prompt": question[-MAX_SAMPLE_CHARS:], "answer": answer[:MAX_SAMPLE_CHARS],
                             "reward": round(float(rewards[0, 0]), 4), "version": int(min_version)})
        for peer in set(job.route):
            self.scored_by_peer[peer] += len(rows)
        counters = self.book.counters
        counters["completion_tokens"] += sum(len(t) for t in m.tokens)
        counters["reward_sum"] += float(rewards.sum())
        counters["reward_count"] += rewards.size

    def on_job_failed(self, sender: str, job_id: str, reason: str) -> None:
        """A node on the job's route reports it failed (reports from elsewhere are ignored)."""
        job = self.jobs.get(job_id)
        if job is not None and sender in job.route:
            self._fail_job(job_id, reason)

    def _fail_job(self, job_id: str, reason: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        self.book.counters["failed_jobs"] += 1
        log.info("job %s failed (%s); its prompts are queued again", job_id, reason)
        if job.kind == "train":
            self._retry_prompts.extend(job.prompts)
        else:
            self.evals.on_failed(job_id)

    def on_node_lost(self, peer_id: str) -> None:
        self.pacer.forget(peer_id)
        for job_id in [j for j, job in self.jobs.items() if peer_id in job.route]:
            self._fail_job(job_id, f"node {peer_id} left")

    def expire_jobs(self) -> None:
        cutoff = time.monotonic() - self.job_timeout_s
        for job_id in [j for j, job in self.jobs.items() if job.dispatched < cutoff]:
            self._fail_job(job_id, "timed out")
