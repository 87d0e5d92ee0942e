"""The swarm's optimiser steps, driven by the coordinator.

:class:`StepRunner` turns the replay buffer (SQLite) into policy versions. A batch:

1. drops rollouts older than the staleness bound (counted, in groups) and takes the oldest
   ``prompts_per_step`` complete groups;
2. hands them to the update planner (``engine.rl.update.plan_update``, the in-process
   trainer's too): advantages with ``std_eps``, zero-variance groups skipped (and dropped from
   the buffer), the rest cut into mini-batches of whole groups;
3. with more than one mini-batch, one forward-only pass over all of them first records the
   proximal log-probs (the weights at the start of the batch), each generator's rows on a route
   whose last stage is another node, and audits every generator's behaviour log-probs against
   them (``engine.swarm.logprob_audit``: gross mismatch is not trained on, repeated, evicts);
   under DiLoCo, where replicas differ between syncs, a second forward-only pass gives each
   row its proximal log-probs on the route that sampled it, and its update runs there too
   (the batch's groups are spread by generator before it is cut, :func:`spread_by_generator`,
   so every mini-batch gives each replica its share);
4. per mini-batch: its micro-batches go through the training routes
   (``engine.swarm.microbatches``), then every trainer is told to ``apply`` (replicas exchange
   compressed gradients, each stage clips its own gradient norm — the planner's per-stage
   rule — and steps; the stage leader the links name streams weight deltas to the inference
   replicas; ``apply`` caps a trainer's wait on its replicas at :data:`PEER_WAIT_SHARE` of the
   step deadline, so one kept waiting by a silent replica still steps in time); once ``stepped``
   comes back (a trainer is waited for one micro-batch deadline after its peers in the step have
   stepped, not the step's: its stage's other replicas, or, if it trained none of the step's
   tokens, every trainer that did) the version advances and is recorded, and each stage's
   full-weight digests go to the links' majority vote (a replica whose digest is the one decided
   is credited the step, ``engine.swarm.credit``; under DiLoCo only sync versions are voted, so
   only they are credited, except for a stage's lone replica, voted every version). The step log
   keeps per stage what its replicas reported (:func:`stage_figures`: gradient norm, a skipped
   non-finite aggregate, the decided digest); skipped ones are counted (``skipped_updates``).

If a batch's first update cannot complete, nodes are told to ``abort`` it and its rollouts
stay in the buffer for one more try — unless nodes refused a micro-batch of it, or it already
failed once: then they are quarantined (never trained, kept for inspection). Versions only ever
go up. What it does not know: websockets, how
rollouts are generated or scored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from typing import Sequence

import numpy as np

from engine.rl.batch import TrainBatch, stack_batches
from engine.rl.rollout import Group, Sample
from engine.rl.run_task import RunTask
from engine.rl.update import UpdatePlan, UpdateRules, plan_update
from engine.swarm import messages
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.logprob_audit import LogprobAudit, mismatch_by_generator, row_generators
from engine.swarm.membership import CATCH_UP_HOLD_S
from engine.swarm.microbatches import MicrobatchDispatcher
from engine.swarm.run_book import NodeLinks, RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.store import Store

log = logging.getLogger(__name__)

#: the steps wait for catch-ups (``NodeLinks.catching_up``) at most this share of the run's time, whoever
#: asks: a credit of ``CATCH_UP_HOLD_S`` seconds that refills at this many seconds per second
CATCH_UP_HOLD_SHARE = 0.1
#: the share of the step deadline a trainer may wait on any one exchange with its peers (``apply``'s
#: ``peer_wait_s``): its replicas' shares or DiLoCo's outer sync; the tied gradient's wait ends two
#: such shares after ``apply`` (the other end may first wait out its own replicas), so the last third
#: is left for compute. At the node's own 20 s share timeout and a 20 s step deadline, an honest
#: replica waiting out a silent one said ``stepped`` late, was blamed for it twice and evicted
PEER_WAIT_SHARE = 1 / 3

Route = tuple[str, ...]


def pin_rows(minibatches: Sequence[TrainBatch], proximal: Sequence[np.ndarray],
             routes: Sequence[Sequence[Route]]) -> tuple[list[TrainBatch], list[np.ndarray], list[list[Route]]]:
    """Each mini-batch's rows (and their proximal log-probs) ordered by the route that computed
    those log-probs, with that route per row: under DiLoCo every replica is its own policy
    between syncs, so a row's update must run on the weights its proximal ``p`` came from
    (else ``u = exp(logp - p)`` measures how far two replicas drifted apart, not the update)."""
    out_batches, out_prox, out_routes = [], [], []
    for mini, prox, rows in zip(minibatches, proximal, routes):
        order = np.array(sorted(range(len(rows)), key=lambda r: rows[r]), dtype=np.int64)
        out_batches.append(mini.take(order))
        out_prox.append(prox[order])
        out_routes.append([rows[r] for r in order])
    return out_batches, out_prox, out_routes


def spread_by_generator(generators: Sequence[Sequence[str | None]]) -> list[int]:
    """An order of a batch's groups (by index) in which every generator's groups are spread evenly,
    each generator's in their own order: group k of a generator's n sits at (k + 1/2) / n.

    Under DiLoCo a row trains on the route that sampled it, and mini-batches are cut from the
    batch's groups in order; a job's groups arrive together, so in buffer order a mini-batch is
    mostly one route's, and that step's update is mostly one replica's while the other steps on
    nothing. Spread, each inner step gives every replica its share of the mini-batch, as DiLoCo
    assumes. A group is its first sample's generator's (mixed groups are rare and not packed)."""
    keys: dict[str | None, list[int]] = defaultdict(list)
    for g, gens in enumerate(generators):
        keys[gens[0] if gens else None].append(g)
    placed = [((k + 0.5) / len(members), str(gen), g) for gen, members in keys.items()
              for k, g in enumerate(members)]
    return [g for _, _, g in sorted(placed)]


def lineage_routes(generators: Sequence[str | None], audit_routes: Sequence[Route],
                   routes: Sequence[Sequence[str]]) -> list[Route | None]:
    """Per row, the live route whose last stage generated it (the replicas whose policy sampled
    it, under DiLoCo), where that is not the route its audit pass already ran on; else None
    (the audit pass's log-probs stand: unknown or departed generator, or the same route)."""
    by_last = {r[-1]: tuple(r) for r in routes}
    out: list[Route | None] = []
    for gen, audited in zip(generators, audit_routes):
        own = by_last.get(gen) if gen is not None else None
        out.append(own if own is not None and own != tuple(audited) else None)
    return out


def stage_figures(stage_replicas: Sequence[Sequence[str]], reports: dict[str, messages.Stepped],
                  decided: dict[int, str | None]) -> list[dict]:
    """Per stage, what its replicas' ``stepped`` said of one update: how many reported, the median of
    their pre-clip gradient norms (every replica computes the same aggregate: the median keeps one
    replica's word out), whether most of them skipped a non-finite aggregate (weights kept), and the
    weights digest the vote decided (``decided``; None: no vote or no majority)."""
    out = []
    for stage, replicas in enumerate(stage_replicas):
        seen = [reports[p] for p in replicas if p in reports]
        out.append({"replicas": len(seen),
                    "grad_norm": float(np.median([m.grad_norm for m in seen])) if seen else None,
                    "skipped": 2 * sum(m.skipped for m in seen) > len(seen),
                    "weights_hash": decided.get(stage)})
    return out


class StepRunner:
    """Training steps of one run. Lives on the coordinator's event loop."""

    def __init__(self, run: RunConfig, rules: UpdateRules, task: RunTask, store: Store, book: RunBook,
                 evals: EvalScheduler, links: NodeLinks, *, step_timeout_s: float = 120.0) -> None:
        self.run, self.rules, self.task, self.store = run, rules, task, store
        self.book, self.evals, self.links = book, evals, links
        self.step_timeout_s = step_timeout_s
        self.microbatches = MicrobatchDispatcher(links, book.counters, micro_batch_rows=run.micro_batch_rows,
                                                 timeout_s=step_timeout_s, mb_timeout_s=run.microbatch_timeout_s,
                                                 credit=book.credit)
        #: generators' behaviour log-probs checked against the proximal pass (engine.swarm.logprob_audit)
        self.audit = LogprobAudit(self.microbatches.health.evict, book.counters)
        #: staleness (versions) of every group that left the buffer: trained, dropped stale or idle
        #: kept in the store at every step, so a restarted coordinator and `polis export` see it whole
        saved_hist = store.get_meta("staleness_histogram", {}) or {}
        self.staleness_histogram: Counter[int] = Counter({int(k): int(v) for k, v in saved_hist.items()})
        self.update_bytes = 0
        self.dense_update_bytes = 0
        saved = store.get_meta("stage_checkpoints", {}) or {}
        self.checkpoints: dict[int, str] = {int(k): v for k, v in saved.items()}
        saved = store.get_meta("stage_checkpoint_versions", {}) or {}
        #: stage -> the version of its last checkpoint (unknown for runs from before it was kept)
        self.checkpoint_versions: dict[int, int] = {int(k): int(v) for k, v in saved.items()}
        self._mb_losses: dict[int, list[messages.MbLoss]] = defaultdict(list)
        self._stepped: dict[int, dict[str, messages.Stepped]] = defaultdict(dict)
        self._stepped_event = asyncio.Event()
        #: per applied step, what each stage's ``stepped`` said of it (:func:`stage_figures`), for its step log
        self._stage_figures: dict[int, list[dict]] = {}
        #: rollouts whose batch failed once for a reason other than a refusal (a second failure quarantines)
        self._failed_once: set[int] = set()
        self._hold_credit_s, self._hold_credit_at = CATCH_UP_HOLD_S, time.monotonic()

    # ------------------------------------------------------------------ batches
    def take_groups(self) -> tuple[list[Group], list[list[int]], list[list[str | None]]] | None:
        """The oldest ``prompts_per_step`` complete fresh groups, their rollout ids and generators, or None."""
        version = self.book.version
        dropped = self.store.drop_stale(self.rules.oldest_fresh_version(version))
        for min_version in dropped.values():
            self.staleness_histogram[version - min_version] += 1
        self.book.counters["dropped_stale"] += len(dropped)
        if self.store.complete_group_count(self.run.group_size) < self.run.prompts_per_step:
            return None  # checked first: reading the rollouts themselves costs far more
        rows = self.store.ready_rollouts(limit=self.run.prompts_per_step * self.run.group_size * 2)
        by_group: dict[str, list] = defaultdict(list)
        for r in rows:
            by_group[r.group_id].append(r)
        complete = [g for g in by_group.values() if len(g) == self.run.group_size][: self.run.prompts_per_step]
        if len(complete) < self.run.prompts_per_step:
            return None
        groups, ids, generators, stops = [], [], [], set(self.task.stop_ids)
        for rollouts in complete:
            group = Group(prompt=rollouts[0].prompt,
                          prompt_ids=np.asarray(self.task.prompt_ids(rollouts[0].prompt), dtype=np.int64))
            for r in rollouts:
                tokens = np.asarray(r.tokens, dtype=np.int64)
                group.samples.append(Sample(completion_ids=tokens, behaviour_logprobs=r.behaviour_logprobs,
                                            versions=np.tile(np.asarray(r.versions, dtype=np.int64), (len(tokens), 1)),
                                            finished=any(t in stops for t in r.tokens), reward=r.reward,
                                            loss_mask=r.loss_mask))
            groups.append(group)
            ids.append([r.id for r in rollouts])
            generators.append([r.generator for r in rollouts])
        return groups, ids, generators

    def plan(self, groups: list[Group], ids: list[list[int]], num_stages: int,
             generators: list[list[str | None]] | None = None) -> UpdatePlan:
        """The planner's batch; groups it leaves out (stale, no signal) leave the buffer now. A group
        is packed into one row only where one node generated all its samples (``generators``), so
        the log-prob audit can blame a row's generator."""
        packable = None if generators is None else [len(set(g)) == 1 and g[0] is not None for g in generators]
        plan = plan_update(groups, [self.book.version] * num_stages, self.rules, self.task.pad_id,
                           packable=packable)
        left_out = plan.stale + plan.zero_variance
        if left_out:
            self.store.mark_rollouts([i for g in left_out for i in ids[g]], "dropped")
        for g in left_out:
            self.staleness_histogram[plan.staleness[g]] += 1
        self.book.counters["dropped_stale"] += plan.dropped_stale
        self.book.counters["zero_variance_groups"] += len(plan.zero_variance)
        return plan

    async def maybe_train(self) -> bool:
        """Train on one batch if the buffer holds enough fresh groups; True if the version advanced."""
        if self.book.finished or not self.evals.has_baseline():
            return False  # the "before" eval comes first
        if not self.store.writable():
            return False  # fail closed: a step whose rollouts and version cannot be recorded waits
        if self.run.max_versions and self.book.version >= self.run.max_versions:
            return False
        routes = self.links.routes()
        if not routes:
            return False
        taken = self.take_groups()
        if taken is None:
            return False
        groups, ids, generators = taken
        if self.run.replica_sync.mode == "diloco":  # every replica its share of each mini-batch
            order = spread_by_generator(generators)
            groups, ids = [groups[g] for g in order], [ids[g] for g in order]
            generators = [generators[g] for g in order]
        plan = self.plan(groups, ids, len(routes[0]), generators)
        if not plan.minibatches:
            return False
        trained_ids = [i for g in plan.trained for i in ids[g]]
        started = time.monotonic()
        minibatches = plan.minibatches
        proximal: Sequence[np.ndarray | None] = [None] * len(minibatches)
        pinned: Sequence[Sequence[tuple[str, ...]] | None] = [None] * len(minibatches)
        if len(minibatches) > 1:
            row_gens = row_generators(minibatches, plan.minibatch_groups, generators)
            passed = await self._proximal_pass(self.book.version, minibatches, row_gens)
            if passed is not None and self.run.replica_sync.mode == "diloco":
                # routes differ between syncs: each row's p (and its update) on the route that sampled it
                passed = await self._lineage_pass(self.book.version, minibatches, row_gens, passed)
            if passed is None:
                return await self._abort(self.book.version, trained_ids)
            proximal, row_routes = passed
            if self.run.replica_sync.mode == "diloco":  # train where p came from
                minibatches, proximal, pinned = pin_rows(minibatches, proximal, row_routes)
        for m, (mini, prox) in enumerate(zip(minibatches, proximal)):
            step = self.book.version
            pass_started = time.monotonic()
            ok = await self.microbatches.run(step, mini, prox, pinned=pinned[m]) is not None
            apply_started = time.monotonic()
            ok = ok and await self._apply(step)
            if not ok:
                if m == 0:
                    return await self._abort(step, trained_ids)
                await self._abort(step, [])
                break
            self._record_step(step, mini, groups, started, train_s=apply_started - pass_started,
                              apply_s=time.monotonic() - apply_started)
        self.store.mark_rollouts(trained_ids, "consumed")
        self._failed_once -= set(trained_ids)
        for g in plan.trained:
            self.staleness_histogram[plan.staleness[g]] += 1
        self.store.set_meta("staleness_histogram", {str(k): v for k, v in sorted(self.staleness_histogram.items())})
        updates = len(plan.minibatches)
        if self.run.eval_every_versions and self.book.version % self.run.eval_every_versions < updates:
            self.evals.request(self.book.version)
        if self.run.max_versions and self.book.version >= self.run.max_versions:
            self.book.finished = True
            self.evals.request(self.book.version, final=True)
        return True

    async def _abort(self, step: int, rollout_ids: list[int]) -> bool:
        """Tell trainers to drop ``step``; its rollouts stay ready once, unless nodes refused them.

        A batch that nodes refused (or that failed before) is quarantined, so one poisoned rollout
        cannot abort every later step by being taken again forever.
        """
        if rollout_ids and (self.microbatches.last_refused or self._failed_once & set(rollout_ids)):
            self.store.mark_rollouts(rollout_ids, "quarantined")
            self._failed_once -= set(rollout_ids)
            self.book.counters["quarantined_rollouts"] += len(rollout_ids)
            log.warning("step %d failed on its rollouts; %d quarantined", step, len(rollout_ids))
        else:
            self._failed_once |= set(rollout_ids)
            if len(self._failed_once) > 65536:  # bounded: ids that left the buffer otherwise linger
                self._failed_once.clear()
            log.warning("step %d did not complete; its %d rollouts stay in the buffer", step, len(rollout_ids))
        self.microbatches.take_trained_tokens()  # nothing of the aborted step is applied
        for replicas in self.links.stage_replicas():
            for peer in replicas:
                await self.links.send(peer, messages.Abort(step=step))
        self.book.counters["aborted_steps"] += 1
        return False

    def _record_step(self, step: int, mini: TrainBatch, groups: list[Group], started: float, *,
                     train_s: float, apply_s: float) -> None:
        losses = self._mb_losses.pop(step, [])
        rewards = [s.reward for g in groups for s in g.samples]
        version = self.book.version
        entry = {
            "version": version, "reward": float(np.mean(rewards)), "samples": int(mini.num_samples),
            "seconds": round(time.monotonic() - started, 3),
            # the split of ``seconds``: the micro-batches' forward+backward through the pipeline, then the
            # apply (replicas exchange gradients, each stage steps and acknowledges)
            "train_s": round(train_s, 3), "apply_s": round(apply_s, 3),
            "staleness_mean": float(mini.staleness.mean()),
            "masked_fraction": float(np.mean([x.masked_fraction for x in losses])) if losses else 0.0,
            "ess": float(np.mean([x.ess for x in losses])) if losses else 1.0,
            "loss": float(np.sum([x.loss for x in losses])) if losses else 0.0,
            # per stage: replicas that stepped, the pre-clip gradient norm, skipped (non-finite), weights digest
            "stages": self._stage_figures.pop(step, []),
        }
        # the stats API's "steps" are these entries, read back a page at a time (engine.swarm.stats_view)
        self.store.record_version(version, reward_mean=entry["reward"], samples=int(mini.num_samples), info=entry)

    async def _proximal_pass(self, step: int, minibatches: list[TrainBatch], generators: list[list[str | None]],
                             ) -> tuple[list[np.ndarray], list[list[tuple[str, ...]]]] | None:
        """Log-probs of every mini-batch's rows under the current weights (one forward-only pass),
        and per row the route that computed them.

        Each generator's rows run on a route whose last stage is another node where one exists
        (rows are grouped by generator for that, then put back), and its behaviour log-probs are
        audited against them: rows of a generator that mismatch grossly are masked out of
        ``minibatches`` (not trained on), and repeated gross mismatch evicts it.
        """
        stacked, offsets = stack_batches(minibatches, self.task.pad_id)
        gens = [g for rows in generators for g in rows]
        order = np.array(sorted(range(len(gens)), key=lambda r: (gens[r] is None, gens[r] or "")), dtype=np.int64)
        grouped = stacked.take(order)
        grouped_gens = [gens[r] for r in order]
        results = await self.microbatches.run(step, grouped, None, forward_only=True, avoid=grouped_gens)
        if results is None:
            return None
        proximal = np.zeros(stacked.mask.shape, dtype=np.float32)
        checked = np.zeros(len(gens), dtype=bool)
        routes: list[tuple[str, ...]] = [()] * len(gens)
        for start, logp, route in results:
            rows = order[start:start + logp.shape[0]]
            proximal[rows, :logp.shape[1]] = logp
            checked[rows] = [gens[r] is not None and route[-1] != gens[r] for r in rows]
            for r in rows:
                routes[r] = route
        self._audit(stacked, proximal, gens, checked, minibatches, offsets)
        return ([proximal[offsets[m]:offsets[m + 1], :b.inputs.shape[1]] for m, b in enumerate(minibatches)],
                [routes[offsets[m]:offsets[m + 1]] for m in range(len(minibatches))])

    async def _lineage_pass(self, step: int, minibatches: list[TrainBatch], generators: list[list[str | None]],
                            audited: tuple[list[np.ndarray], list[list[Route]]],
                            ) -> tuple[list[np.ndarray], list[list[Route]]] | None:
        """DiLoCo: proximal log-probs of each row on the route whose last stage generated it (its
        policy's lineage), where that route still trains; other rows keep the audit pass's."""
        proximal, routes = audited
        stacked, offsets = stack_batches(minibatches, self.task.pad_id)
        own = lineage_routes([g for rows in generators for g in rows], [r for rows in routes for r in rows],
                             self.microbatches.health.routes())
        moved = [i for i, route in enumerate(own) if route is not None]
        out_prox = [p.copy() for p in proximal]
        out_routes = [list(r) for r in routes]
        if not moved:
            return out_prox, out_routes
        order = np.array(sorted(moved, key=lambda i: own[i] or ()), dtype=np.int64)
        results = await self.microbatches.run(step, stacked.take(order), None, forward_only=True,
                                              pinned=[own[i] or () for i in order])
        if results is None:
            return None
        for start, logp, route in results:
            for k, row in enumerate(order[start:start + logp.shape[0]]):
                m = int(np.searchsorted(offsets, row, side="right")) - 1
                local = int(row) - offsets[m]
                width = out_prox[m].shape[1]
                out_prox[m][local, :] = 0.0
                out_prox[m][local, :min(width, logp.shape[1])] = logp[k, :width]
                out_routes[m][local] = route
        return out_prox, out_routes

    def _audit(self, stacked: TrainBatch, proximal: np.ndarray, gens: list[str | None], checked: np.ndarray,
               minibatches: list[TrainBatch], offsets: list[int]) -> None:
        unchecked = sum(stacked.samples_in_row(r) for r, g in enumerate(gens) if g is not None and not checked[r])
        if unchecked:
            self.book.counters["unaudited_rows"] += unchecked
            log.info("%d rows' log-probs could not be checked on a route ending at another node than their "
                     "generator (one replica of the last stage?)", unchecked)
        gross = self.audit.record(mismatch_by_generator(stacked.behaviour, proximal, stacked.mask, gens, checked))
        if not gross:
            return
        for m, batch in enumerate(minibatches):
            for r in range(batch.num_rows):
                if gens[offsets[m] + r] in gross and batch.mask[r].any():
                    batch.mask[r] = False  # not trained on: its behaviour log-probs are not the policy's
                    self.book.counters["audit_dropped_rows"] += batch.samples_in_row(r)

    # ------------------------------------------------------------------ optimiser step
    async def _wait_for_catch_ups(self) -> None:
        """Hold the step while a trainer that joined behind its stage takes a replica's weights
        (``NodeLinks.catching_up``), so it joins at the stage's version; at most the hold credit
        (``CATCH_UP_HOLD_SHARE``): however many nodes ask, holds cost the run at most that share of its time."""
        now = time.monotonic()
        self._hold_credit_s = min(CATCH_UP_HOLD_S,
                                  self._hold_credit_s + (now - self._hold_credit_at) * CATCH_UP_HOLD_SHARE)
        deadline = now + self._hold_credit_s
        while self.links.catching_up() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._hold_credit_at = time.monotonic()
        self._hold_credit_s -= self._hold_credit_at - now

    async def _await_stepped(self, step: int, expected: set[str], contributors: set[str]) -> None:
        """Wait for ``stepped`` from the ``expected`` trainers, up to the step deadline; a trainer
        whose peers in the step have all stepped gets one micro-batch deadline more, not the rest of
        the step's: for a contributor, its stage's other replicas (they waited for its share, at
        most ``peer_wait_s``, and did the same work); for one that trained nothing (its replicas
        did not wait for its share), every contributor. Each one still silent then is a miss of its own.
        A deaf replica that trained used to hold every step it was in for the whole step deadline."""
        stage_of = {p: s for s, replicas in enumerate(self.links.stage_replicas()) for p in replicas}
        step_deadline = time.monotonic() + self.step_timeout_s
        own_deadline: dict[str, float] = {}  #: trainer -> its deadline, once its peers in the step stepped
        while True:
            got = self._stepped.get(step, {})
            alive = {p for replicas in self.links.stage_replicas() for p in replicas}
            waiting = (expected & alive) - set(got)
            if not waiting:
                return
            now = time.monotonic()
            for peer in waiting - own_deadline.keys():
                if peer in contributors:
                    peers = {q for q in expected & alive if q != peer and stage_of.get(q) == stage_of.get(peer)}
                else:
                    peers = contributors & alive
                if peers and peers <= set(got):
                    own_deadline[peer] = now + self.microbatches.mb_timeout_s
            deadline = min(step_deadline, max(own_deadline.get(p, step_deadline) for p in waiting))
            if now >= deadline:
                log.warning("step %d: no 'stepped' from %s", step, sorted(waiting))
                for peer in sorted(waiting):  # one trainer each: no doubt who was silent
                    self.microbatches.health.missed([peer], f"no 'stepped' for step {step}")
                return
            self._stepped_event.clear()
            try:
                await asyncio.wait_for(self._stepped_event.wait(), deadline - now)
            except asyncio.TimeoutError:
                pass

    async def _apply(self, step: int) -> bool:
        await self._wait_for_catch_ups()
        version = step + 1
        checkpoint = version % self.run.checkpoint_every_versions == 0
        expected: set[str] = set()
        inference = self.links.inference_replicas()
        self.book.begin_apply(version)
        trained = self.microbatches.take_trained_tokens()
        for stage, replicas in enumerate(self.links.stage_replicas()):
            leader = self.links.leader(stage)  # named by the weight votes: checkpoints, streams to inference
            total = sum(trained[p] for p in replicas)
            # the replicas' shares of the step's tokens (micro-batches follow the routes' speed)
            shares = [trained[p] / total for p in replicas] if total and len(replicas) > 1 else []
            for peer in replicas:
                apply = messages.Apply(step=step, version=version, replicas=replicas, leader=leader,
                                       checkpoint=checkpoint and peer == leader, token_shares=shares,
                                       inference=inference[stage] if stage < len(inference) else [],
                                       peer_wait_s=self.step_timeout_s * PEER_WAIT_SHARE)
                if await self.links.send(peer, apply):
                    expected.add(peer)
        await self._await_stepped(step, expected, {p for p in expected if trained[p] > 0})
        reports = self._stepped.pop(step, {})
        if not reports:
            return False
        self.book.advance(version)
        for m in reports.values():
            self.update_bytes += m.update_bytes
            self.dense_update_bytes += m.dense_bytes
        replicas = self.links.stage_replicas()  # as they stepped (the vote may evict one)
        decided = await self._check_replicas(reports, version)
        figures = stage_figures(replicas, reports, decided)
        self.book.counters["skipped_updates"] += sum(f["skipped"] for f in figures)
        self._stage_figures = {step: figures}
        return True

    async def _check_replicas(self, reports: dict[str, messages.Stepped], version: int) -> dict[int, str | None]:
        """Replicas of a stage must hold equal weights (under DiLoCo only right after a sync,
        ``RunConfig.replica_sync``; a lone replica agrees with itself at every version): their
        full-weight digests are put to a vote (``engine.swarm.weight_votes``; outvoted replicas are
        resynced from the majority). Returns per stage the digest the vote decided (None: no vote,
        or no majority)."""
        synced = self.run.replica_sync.synced_at(version)
        out: dict[int, str | None] = {}
        for stage, replicas in enumerate(self.links.stage_replicas()):
            agree = synced or len(replicas) == 1
            seen = [(p, reports[p]) for p in replicas if p in reports]
            for _, m in seen:
                if m.checkpoint_path:
                    self.checkpoints[stage] = m.checkpoint_path
                    self.checkpoint_versions[stage] = m.version
                    self.store.set_meta("stage_checkpoints", self.checkpoints)
                    self.store.set_meta("stage_checkpoint_versions", self.checkpoint_versions)
            # a lone replica's digest is recorded too: `polis export --coordinator` checks fetched weights by it
            if agree and (len(seen) >= 2 or any(m.weights_hash for _, m in seen)):
                decided = await self.links.check_weights(stage, {p: m.weights_hash for p, m in seen}, version)
                out[stage] = decided
                # verified credit: a step counts for the replicas whose weights are the ones the vote decided
                self.book.credit.add([p for p, m in seen if decided is not None and m.weights_hash == decided],
                                     steps_applied=1)
        return out

    def checkpoint_of(self, stage: int, version: int) -> str | None:
        """The stage checkpoint holding exactly ``version`` (None: there is none; at version 0 the
        base is that checkpoint)."""
        if self.checkpoint_versions.get(stage) == version:
            return self.checkpoints.get(stage)
        return None

    # ------------------------------------------------------------------ node reports
    def on_mb_loss(self, sender: str, m: messages.MbLoss) -> None:
        self._mb_losses[m.step].append(m)
        self.microbatches.on_mb_loss(sender, m)

    def on_stepped(self, sender: str, m: messages.Stepped) -> None:
        if m.step == self.book.version:
            self._stepped[m.step][sender] = m
            self._stepped_event.set()

    def on_node_lost(self, peer_id: str) -> None:
        self.microbatches.on_node_lost(peer_id)
        self._stepped_event.set()
