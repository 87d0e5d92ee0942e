"""One optimiser step of the swarm, driven by the coordinator.

:class:`StepRunner` is the training half of ``engine.swarm.scheduler.RunScheduler``
(a mixin over its attributes: ``store``, ``codec``, ``run``, ``version``, ``send``,
``routes``, ``stage_replicas``). A step:

1. drops rollouts older than the staleness bound, takes ``prompts_per_step``
   complete, useful groups from the replay buffer (SQLite);
2. builds the padded batch with ``engine.rl.batch.build_batch`` (the in-process
   trainer's code) and cuts it into micro-batches spread over the routes;
3. sends token ids to each route's first stage and targets/advantages/behaviour
   log-probs to its last stage; a micro-batch whose route breaks is retried on
   another route;
4. tells every trainer to ``apply`` (replicas exchange compressed gradients and
   step identically; each stage's leader then streams weight deltas to the stage's
   inference replicas), waits for ``stepped``, advances the version, records it.

If the step cannot complete, nodes are told to ``abort`` it and its rollouts stay
in the buffer. Versions only ever go up.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from typing import Any

import numpy as np

from engine.rl.batch import build_batch
from engine.rl.objective import group_advantages
from engine.rl.rollout import Group, Sample

log = logging.getLogger(__name__)

MAX_MB_ATTEMPTS = 3


class StepRunner:
    """Training steps (mixed into ``RunScheduler``)."""

    def request_eval(self) -> None:
        """Evaluate the current version as soon as generation capacity allows."""
        if self.eval_round is None:
            self.eval_wanted = self.version

    def _take_groups(self) -> tuple[list[Group], list[np.ndarray], list[int]] | None:
        dropped = self.store.drop_stale(self.version, self.run.max_staleness)
        if dropped:
            self.stats["dropped_stale"] += dropped
        if self.store.complete_group_count(self.run.group_size) < self.run.prompts_per_step:
            return None  # checked first: reading the rollouts themselves costs far more
        rows = self.store.ready_rollouts(limit=self.run.prompts_per_step * self.run.group_size * 2)
        by_group: dict[str, list] = defaultdict(list)
        for r in rows:
            by_group[r.group_id].append(r)
        complete = [g for g in by_group.values() if len(g) == self.run.group_size][: self.run.prompts_per_step]
        if len(complete) < self.run.prompts_per_step:
            return None
        # As in the in-process trainer, a batch is prompts_per_step groups and the ones whose
        # rewards are all equal (no signal) are left out of it, so the batch rows per update,
        # and the samples per version, are the trainer's.
        _, keep = group_advantages(np.asarray([[r.reward for r in g] for g in complete]))
        idle = [r.id for g, k in zip(complete, keep) if not k for r in g]
        if idle:
            self.store.mark_rollouts(idle, "dropped")
            self.stats["zero_variance_groups"] += int((~keep).sum())
        complete = [g for g, k in zip(complete, keep) if k]
        if not complete:
            return None
        groups, advantages, ids = [], [], []
        for rollouts in complete:
            group = Group(prompt=rollouts[0].prompt,
                          prompt_ids=np.asarray(self.codec.encode_prompt(rollouts[0].prompt), dtype=np.int64))
            for r in rollouts:
                tokens = np.asarray(r.tokens, dtype=np.int64)
                group.samples.append(Sample(completion_ids=tokens, behaviour_logprobs=r.behaviour_logprobs,
                                            versions=np.tile(np.asarray(r.versions, dtype=np.int64), (len(tokens), 1)),
                                            finished=bool(self.codec.eos_id in r.tokens), reward=r.reward))
                ids.append(r.id)
            groups.append(group)
            advantages.append(np.asarray([r.advantage for r in rollouts], dtype=np.float32))
        return groups, advantages, ids

    async def maybe_train(self) -> bool:
        """Train on one batch if the buffer holds enough fresh groups; True if the version advanced.

        A batch gets ``updates_per_batch`` optimiser steps, one per mini-batch of its rows;
        with more than one, a forward-only pass first records every row's proximal log-probs.
        """
        if self.finished or not self.store.evals():
            return False  # the "before" eval comes first
        if self.run.max_versions and self.version >= self.run.max_versions:
            return False
        routes = self.routes()
        if not routes:
            return False
        taken = self._take_groups()
        if taken is None:
            return False
        groups, advantages, rollout_ids = taken
        num_stages = len(routes[0])
        batch = build_batch(groups, advantages, self.codec.pad_id, [self.version] * num_stages)
        for s in batch.staleness.tolist():
            self.staleness_hist[int(s)] += 1
        started = time.monotonic()
        updates = min(self.run.updates_per_batch, len(groups))  # as the trainer: never less than a group per update
        proximal = None
        if updates > 1:
            proximal = await self._proximal_pass(self.version, batch)
            if proximal is None:
                return await self._abort(self.version, rollout_ids)
        for m in range(updates):
            rows = np.arange(m, batch.num_rows, updates)
            mini = _select(batch, rows)
            step = self.version
            ok = await self._run_microbatches(step, mini, None if proximal is None else proximal[rows])
            ok = ok and await self._apply(step)
            if not ok:
                if m == 0:
                    return await self._abort(step, rollout_ids)
                await self._abort(step, [])
                break
            self._record_step(step, mini, groups, started)
        self.store.mark_rollouts(rollout_ids, "consumed")
        if self.run.eval_every_versions and self.version % self.run.eval_every_versions < updates:
            self.request_eval()
        if self.run.max_versions and self.version >= self.run.max_versions:
            self.finished = True
            self.request_eval()
        return True

    async def _abort(self, step: int, rollout_ids: list[int]) -> bool:
        log.warning("step %d did not complete; its %d rollouts stay in the buffer", step, len(rollout_ids))
        for replicas in self.stage_replicas():
            for peer in replicas:
                await self.send(peer, {"type": "abort", "step": step})
        self.stats["aborted_steps"] += 1
        return False

    def _record_step(self, step: int, mini, groups: list[Group], started: float) -> None:
        losses = self._mb_losses.pop(step, [])
        rewards = [s.reward for g in groups for s in g.samples]
        entry = {
            "version": self.version, "reward": float(np.mean(rewards)), "samples": int(mini.num_rows),
            "seconds": round(time.monotonic() - started, 3),
            "staleness_mean": float(mini.staleness.mean()),
            "masked_fraction": float(np.mean([x["masked_fraction"] for x in losses])) if losses else 0.0,
            "ess": float(np.mean([x["ess"] for x in losses])) if losses else 1.0,
            "loss": float(np.sum([x["loss"] for x in losses])) if losses else 0.0,
        }
        self.store.record_version(self.version, reward_mean=entry["reward"], samples=int(mini.num_rows), info=entry)
        self.step_log.append(entry)

    async def _proximal_pass(self, step: int, batch) -> np.ndarray | None:
        """Log-probs of every row under the current weights (forward only), as ``[rows, width]``."""
        results = await self._run_microbatches(step, batch, None, prox=True)
        if results is None:
            return None
        proximal = np.zeros(batch.mask.shape, dtype=np.float32)
        for start, logp in results:
            proximal[start:start + logp.shape[0], :logp.shape[1]] = logp
        return proximal

    async def _run_microbatches(self, step: int, batch, proximal: np.ndarray | None, *, prox: bool = False):
        """Send every micro-batch of ``batch`` through the routes and wait for all of them.

        Returns True (or, for a proximal pass, ``[(first_row, logprobs)]``) on success, else
        None/False. A micro-batch whose route breaks is retried on another route.
        """
        routes = self.routes()
        rows = batch.num_rows
        per_mb = max(1, min(self.run.micro_batch_rows, math.ceil(rows / len(routes))))
        pending: dict[int, tuple[Any, int, int]] = {}
        for mb, start in enumerate(range(0, rows, per_mb)):
            pending[mb] = (batch.rows(start, min(rows, start + per_mb)), 0, start)
        normaliser = float(max(batch.num_tokens, 1))
        deadline = time.monotonic() + self.step_timeout_s
        futures: dict[int, asyncio.Future] = {}
        results: list[tuple[int, np.ndarray]] = []
        failed = None if prox else False

        async def dispatch(mb: int, micro, start: int, route: list[str]) -> None:
            fut = asyncio.get_running_loop().create_future()
            fut.route = tuple(route)  # lets on_node_lost fail it
            self._mb_events[(step, mb, prox)] = fut
            futures[mb] = fut
            width = micro.inputs.shape[1]
            out = {"type": "train_out", "step": step, "mb": mb, "route": route, "targets": micro.targets.tolist(),
                   "mask": micro.mask.tolist(), "behaviour": np.round(micro.behaviour, 6).tolist(),
                   "advantages": micro.advantages.tolist(), "normaliser": normaliser}
            if prox:
                out["prox"] = True
            if proximal is not None:
                out["proximal"] = np.round(proximal[start:start + micro.num_rows, :width], 6).tolist()
            sent = await self.send(route[0], {"type": "train_in", "step": step, "mb": mb, "route": route,
                                              "inputs": micro.inputs.tolist(), **({"prox": True} if prox else {})})
            sent = sent and await self.send(route[-1], out)
            if not sent and not fut.done():
                fut.set_result(("failed", "route unreachable"))

        for i, mb in enumerate(sorted(pending)):
            micro, _, start = pending[mb]
            await dispatch(mb, micro, start, routes[i % len(routes)])
        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return failed
                done, _ = await asyncio.wait([futures[mb] for mb in pending], timeout=remaining,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    return failed
                for mb in [m for m in pending if futures[m].done()]:
                    status, detail = futures[mb].result()
                    micro, attempts, start = pending.pop(mb)
                    if status == "done":
                        if prox:
                            results.append((start, detail))
                        continue
                    self.stats["retried_microbatches"] += 1
                    routes = self.routes()
                    if attempts + 1 >= MAX_MB_ATTEMPTS or not routes:
                        log.warning("micro-batch %d of step %d failed for good: %s", mb, step, detail)
                        return failed
                    log.info("micro-batch %d of step %d failed (%s); retrying on another route", mb, step, detail)
                    pending[mb] = (micro, attempts + 1, start)
                    await dispatch(mb, micro, start, routes[(mb + attempts + 1) % len(routes)])
            return results if prox else True
        finally:
            for key in [k for k in self._mb_events if k[0] == step and k[2] == prox]:
                del self._mb_events[key]

    async def _apply(self, step: int) -> bool:
        version = step + 1
        checkpoint = version % self.run.checkpoint_every_versions == 0
        expected: set[str] = set()
        inference = self.inference_replicas()
        for stage, replicas in enumerate(self.stage_replicas()):
            for peer in replicas:
                # replicas[0] leads the stage: it checkpoints and streams weights to the inference replicas
                if await self.send(peer, {"type": "apply", "step": step, "version": version, "replicas": replicas,
                                          "checkpoint": checkpoint and peer == replicas[0],
                                          "inference": inference[stage] if stage < len(inference) else []}):
                    expected.add(peer)
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            got = self._stepped.get(step, {})
            alive = {p for replicas in self.stage_replicas() for p in replicas}
            waiting = (expected & alive) - set(got)
            if not waiting:
                break
            if time.monotonic() >= deadline:
                log.warning("step %d: no 'stepped' from %s", step, sorted(waiting))
                break
            self._stepped_event.clear()
            try:
                await asyncio.wait_for(self._stepped_event.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                pass
        reports = self._stepped.pop(step, {})
        if not reports:
            return False
        self.version = version
        self.store.set_meta("version", version)
        for m in reports.values():
            self.update_bytes += m["update_bytes"]
            self.dense_update_bytes += m["dense_bytes"]
        await self._check_replicas(reports)
        return True

    async def _check_replicas(self, reports: dict[str, dict]) -> None:
        """Replicas of a stage must hold equal weights; resync any that drifted."""
        for stage, replicas in enumerate(self.stage_replicas()):
            seen = [(p, reports[p]) for p in replicas if p in reports]
            for peer, m in seen:
                if m.get("checkpoint_path"):
                    self.checkpoints[stage] = m["checkpoint_path"]
                    self.store.set_meta("stage_checkpoints", self.checkpoints)
            if len(seen) < 2:
                continue
            leader, lead = seen[0]
            for peer, m in seen[1:]:
                if abs(m["checksum"] - lead["checksum"]) > 1e-3 * max(1.0, abs(lead["checksum"])):
                    self.stats["resyncs"] += 1
                    log.info("replica %s of stage %d drifted from %s; resynchronising", peer, stage, leader)
                    await self.send(peer, {"type": "sync", "source_peer": leader})

    # ------------------------------------------------------------------ node reports
    def on_mb_loss(self, sender: str, m: dict) -> None:
        self._mb_losses[m["step"]].append(m)

    def on_mb_done(self, sender: str, m: dict) -> None:
        fut = self._mb_events.get((m["step"], m["mb"], False))
        if fut is not None and not fut.done() and sender == fut.route[0]:
            fut.set_result(("done", ""))

    def on_prox_done(self, sender: str, m: dict) -> None:
        fut = self._mb_events.get((m["step"], m["mb"], True))
        if fut is None or fut.done() or sender != fut.route[-1]:
            return
        rows = m["logprobs"]
        if any(len(r) != len(rows[0]) for r in rows):
            fut.set_result(("failed", "ragged proximal log-probs"))
            return
        fut.set_result(("done", np.asarray(rows, dtype=np.float32)))

    def on_mb_failed(self, sender: str, m: dict) -> None:
        for prox in (False, True):
            fut = self._mb_events.get((m["step"], m["mb"], prox))
            if fut is not None and not fut.done() and sender in fut.route:
                fut.set_result(("failed", m["reason"]))

    def on_stepped(self, sender: str, m: dict) -> None:
        if m["step"] == self.version:
            self._stepped[m["step"]][sender] = m
            self._stepped_event.set()


def _select(batch, rows: np.ndarray):
    """The rows ``rows`` of a TrainBatch, trimmed to their longest row."""
    from engine.rl.batch import TrainBatch

    mask = batch.mask[rows]
    width = int(np.max(np.nonzero(mask.any(axis=0))[0], initial=0)) + 1
    return TrainBatch(batch.inputs[rows, :width], batch.targets[rows, :width], mask[:, :width],
                      batch.behaviour[rows, :width], batch.advantages[rows], batch.staleness[rows])
