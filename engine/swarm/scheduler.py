"""The coordinator's RL scheduling: prompts out, scored rollouts in, steps and evals.

:class:`RunScheduler` decides what the swarm does next and keeps the books:

* **generation** — keeps ``generations_in_flight`` jobs (``prompts_per_job`` prompts x G samples)
  on every complete generation route (any replica of each stage: trainers and inference
  replicas), while the replay buffer is not full; each rollout keeps the version every
  stage served it with, and staleness is counted from those;
* **scoring** — rewards are computed here from the returned token ids (never
  trusted from a node), group advantages; every
  completed rollout is written to SQLite at once, so none is ever lost;
* **training** — when ``prompts_per_step`` fresh groups are ready (stale ones dropped
  by the staleness bound), the ones with signal (not all rewards equal) make a batch, as
  in the in-process trainer: micro-batches spread over the routes (data
  parallel across the trainers' pipelines), then ``apply`` to every trainer, then the
  version advances (monotonically, recorded in the database);
* **evals** — greedy decoding of the held-out split at the start, every
  ``eval_every_versions`` and at the end, accuracy per version.

A job whose route loses a node is re-queued (generation) or retried on another
route (training). The scheduler talks to nodes only through the coordinator's
``send`` callable and never sees activations or weights.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

from engine.rl.batch import build_batch
from engine.rl.codec import TaskCodec
from engine.rl.objective import group_advantages
from engine.rl.rollout import Group, Sample
from engine.rl.tasks import make_task
from engine.rl.tasks.rewards import exact_match, token_reward
from engine.swarm.run_config import RunConfig
from engine.swarm.step_runner import StepRunner
from engine.swarm.store import Store

log = logging.getLogger(__name__)

#: rows of one eval job (held-out prompts of one token length decoded together)
EVAL_ROWS = 64


@dataclass
class GenJob:
    job: str
    route: list[str]
    prompts: list[str]  #: prompts of one token length (train: each sampled group_size times)
    kind: str  #: "train" or "eval"
    dispatched: float = field(default_factory=time.monotonic)


@dataclass
class EvalRound:
    version: int
    pending: set[str] = field(default_factory=set)
    correct: int = 0
    total: int = 0
    min_version: int | None = None
    queue: deque = field(default_factory=deque)  #: prompt batches not dispatched yet


class RunScheduler(StepRunner):
    """Scheduling state of one run. Lives on the coordinator's event loop.

    Generation, scoring and evals are here; optimiser steps in
    :class:`~engine.swarm.step_runner.StepRunner`.
    """

    def __init__(self, run: RunConfig, store: Store, codec: TaskCodec,
                 send: Callable[[str, dict], Awaitable[bool]], routes: Callable[[], list[list[str]]],
                 stage_replicas: Callable[[], list[list[str]]], job_timeout_s: float = 60.0,
                 step_timeout_s: float = 120.0, gen_routes: Callable[[], list[list[str]]] | None = None,
                 inference_replicas: Callable[[], list[list[str]]] | None = None) -> None:
        """``routes``/``stage_replicas``: trainers only (training, apply, checksums);
        ``gen_routes``: routes for generation (default: ``routes``); ``inference_replicas``:
        each stage's inference replicas, whom the stage leader streams weights to."""
        self.run = run
        self.store = store
        self.codec = codec
        self.task = make_task(run.task)
        self.send = send
        self.routes = routes
        self.gen_routes = gen_routes or routes
        self.stage_replicas = stage_replicas
        self.inference_replicas = inference_replicas or (lambda: [[] for _ in stage_replicas()])
        self.job_timeout_s = job_timeout_s
        self.step_timeout_s = step_timeout_s
        self.version = int(store.get_meta("version", 0))
        self._prompts = self.task.train_stream(run.seed + 7919 * int(store.get_meta("prompt_epoch", 0)))
        store.set_meta("prompt_epoch", int(store.get_meta("prompt_epoch", 0)) + 1)
        self._retry_prompts: deque[str] = deque()
        self._length_buckets: dict[int, list[str]] = defaultdict(list)
        self._job_ids = itertools.count(int(time.time() * 1000) % 10**9)
        self.jobs: dict[str, GenJob] = {}
        self.eval_round: EvalRound | None = None
        self.eval_wanted: int | None = 0 if not store.evals() else None
        self.stats = Counter()
        self.staleness_hist: Counter = Counter()
        self.step_log: list[dict[str, Any]] = []
        self.finished = False
        self.received_rollouts = 0
        #: rollouts scored per peer that was on their generation route (every stage counts)
        self.scored_by_peer: Counter = Counter()
        self._mb_events: dict[tuple[int, int, bool], asyncio.Future] = {}
        self._mb_losses: dict[int, list[dict]] = defaultdict(list)
        self._stepped: dict[int, dict[str, dict]] = defaultdict(dict)
        self._stepped_event = asyncio.Event()
        self.update_bytes = 0
        self.dense_update_bytes = 0
        self.checkpoints: dict[int, str] = dict(store.get_meta("stage_checkpoints", {}) or {})
        self.checkpoints = {int(k): v for k, v in self.checkpoints.items()}

    # ------------------------------------------------------------------ generation
    def _next_job_id(self, kind: str) -> str:
        return f"{kind[0]}{next(self._job_ids)}"

    def _ready_groups(self) -> int:
        return self.store.ready_group_count()

    async def fill_generation(self) -> None:
        """Dispatch generation (eval first) up to the in-flight budget of every route."""
        routes = self.gen_routes()
        if not routes:
            return
        load = Counter(tuple(j.route) for j in self.jobs.values())
        # least-loaded routes first, so that when the buffer is nearly full no route starves
        for route in sorted(routes, key=lambda r: load[tuple(r)]):
            while load[tuple(route)] < self.run.generations_in_flight:
                message = self._next_generation(route)
                if message is None:
                    break
                load[tuple(route)] += 1
                if not await self.send(route[0], message):
                    self._fail_job(message["job"], "first stage unreachable")
                    break

    def _next_generation(self, route: list[str]) -> dict | None:
        sampling = self.run.sampling
        params = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                  "top_p": sampling.top_p, "seed": 0, "eos_id": self.codec.eos_id}
        if self.eval_wanted is not None and self.eval_round is None:
            self._start_eval(self.eval_wanted)
        if self.eval_round is not None and self.eval_round.queue:
            prompts = self.eval_round.queue.popleft()
            job = GenJob(self._next_job_id("eval"), route, prompts, "eval")
            self.eval_round.pending.add(job.job)
            ids = [self.codec.encode_prompt(p) for p in prompts]
            params.update(temperature=0.0, top_p=1.0)
        elif self.eval_round is not None and self.eval_round.pending and self.version == 0:
            return None  # the "before" eval must finish before rollouts from version 0 pile up
        elif self.finished or self._ready_groups() + self._train_jobs() >= 2 * self.run.prompts_per_step:
            return None
        else:
            prompts = self._next_prompt_batch()
            job = GenJob(self._next_job_id("train"), route, prompts, "train")
            ids = [self.codec.encode_prompt(p) for p in prompts for _ in range(self.run.group_size)]
        params["seed"] = int(np.random.default_rng([self.run.seed, int(job.job[1:])]).integers(2**62))
        self.jobs[job.job] = job
        return {"type": "gen", "job": job.job, "route": route, "prompt_ids": ids, "params": params}

    def _train_jobs(self) -> int:
        """Prompt groups being generated right now."""
        return sum(len(j.prompts) for j in self.jobs.values() if j.kind == "train")

    def _next_prompt_batch(self) -> list[str]:
        """``prompts_per_job`` prompts of one token length (re-queued ones first)."""
        want = self.run.prompts_per_job
        while True:
            if self._retry_prompts:
                prompt = self._retry_prompts.popleft()
            else:
                prompt = next(self._prompts).prompt
            bucket = self._length_buckets[len(self.codec.encode_prompt(prompt))]
            bucket.append(prompt)
            if len(bucket) >= want:
                batch = bucket[:want]
                del bucket[:want]
                return batch

    def _start_eval(self, version: int) -> None:
        by_length: dict[int, list[str]] = defaultdict(list)
        for example in self.task.eval_split():
            by_length[len(self.codec.encode_prompt(example.prompt))].append(example.prompt)
        queue: deque = deque()
        for _, prompts in sorted(by_length.items()):
            for i in range(0, len(prompts), EVAL_ROWS):
                queue.append(prompts[i:i + EVAL_ROWS])
        self.eval_round = EvalRound(version=version, queue=queue)
        self.eval_wanted = None
        log.info("eval of version %d: %d prompts in %d jobs", version, sum(map(len, queue)), len(queue))

    def on_gen_done(self, sender: str, m: dict) -> None:
        job = self.jobs.get(m["job"])
        if job is None or sender != job.route[-1]:
            self.stats["unexpected_results"] += 1
            return
        rows = len(job.prompts) * (1 if job.kind == "eval" else self.run.group_size)
        if len(m["tokens"]) != rows or len(m["logprobs"]) != rows or len(m["versions"]) != len(job.route) or \
                any(len(t) != len(lp) for t, lp in zip(m["tokens"], m["logprobs"])):
            self.stats["malformed_results"] += 1
            self._fail_job(job.job, "malformed result")
            return
        del self.jobs[job.job]
        if job.kind == "eval":
            self._score_eval(job, m)
        else:
            self._score_groups(job, m)

    def _score_eval(self, job: GenJob, m: dict) -> None:
        r = self.eval_round
        if r is None or job.job not in r.pending:
            return
        r.pending.discard(job.job)
        r.correct += sum(exact_match(self.task, p, t, self.codec) for p, t in zip(job.prompts, m["tokens"]))
        r.total += len(job.prompts)
        low = min(m["versions"])
        r.min_version = low if r.min_version is None else min(r.min_version, low)
        if not r.pending and not r.queue:
            accuracy = r.correct / max(r.total, 1)
            self.store.record_eval(r.version, accuracy, r.total)
            log.info("eval version %d: exact match %.3f on %d held-out prompts", r.version, accuracy, r.total)
            self.eval_round = None

    def _score_groups(self, job: GenJob, m: dict) -> None:
        g = self.run.group_size
        rewards = np.array([[token_reward(self.task, prompt, t, self.codec) for t in m["tokens"][k * g:(k + 1) * g]]
                            for k, prompt in enumerate(job.prompts)])
        adv, _ = group_advantages(rewards, scale_by_std=self.run.objective.scale_by_std)
        min_version = min(m["versions"])
        rows = []
        for k, prompt in enumerate(job.prompts):
            sl = slice(k * g, (k + 1) * g)
            rows += [dict(group_id=f"{job.job}:{k}", prompt=prompt, tokens=t, behaviour_logprobs=lp,
                          versions=m["versions"], min_version=min_version, reward=float(r), advantage=float(a))
                     for t, lp, r, a in zip(m["tokens"][sl], m["logprobs"][sl], rewards[k], adv[k])]
        self.store.add_rollouts(rows)
        self.received_rollouts += len(rows)
        for peer in set(job.route):
            self.scored_by_peer[peer] += len(rows)
        self.stats["completion_tokens"] += sum(len(t) for t in m["tokens"])
        self.stats["reward_sum"] += float(rewards.sum())
        self.stats["reward_count"] += rewards.size

    def on_job_failed(self, job_id: str, reason: str) -> None:
        self._fail_job(job_id, reason)

    def _fail_job(self, job_id: str, reason: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        self.stats["failed_jobs"] += 1
        log.info("job %s failed (%s); its prompts are queued again", job_id, reason)
        if job.kind == "train":
            self._retry_prompts.extend(job.prompts)
        elif self.eval_round is not None and job_id in self.eval_round.pending:
            self.eval_round.pending.discard(job_id)
            self.eval_round.queue.appendleft(job.prompts)

    def on_node_lost(self, peer_id: str) -> None:
        for job_id in [j for j, job in self.jobs.items() if peer_id in job.route]:
            self._fail_job(job_id, f"node {peer_id} left")
        for fut in list(self._mb_events.values()):
            if not fut.done() and peer_id in getattr(fut, "route", ()):
                fut.set_result(("failed", f"node {peer_id} left"))
        self._stepped_event.set()

    def expire_jobs(self) -> None:
        cutoff = time.monotonic() - self.job_timeout_s
        for job_id in [j for j, job in self.jobs.items() if job.dispatched < cutoff]:
            self._fail_job(job_id, "timed out")
