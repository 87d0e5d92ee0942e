"""Held-out evals of the swarm's policy: which prompts to decode greedily next, and the scores.

An eval of version v decodes every held-out prompt greedily, ``EVAL_ROWS`` prompts of one token
length per job, and records two figures for v in the store: the task's strict score (``accuracy``;
exact match for a digit task, the answer in tags for a chat task) and the content-only score
(``content``: the answer the text states, format ignored; equal to strict for a digit task).
Prompts and scores come from the run's task (``engine.rl.run_task``). The first eval (of the
base, version 0) runs before any training; later ones when asked (every
``eval_every_versions``, at the end, or by an operator). The generation scheduler asks
:meth:`EvalScheduler.next_batch` for eval work before it dispatches training rollouts, and
hands back each job's scores (its episodes', ``engine.swarm.episodes``) and failures.

What it does not know: routes, nodes, messages, training.
"""

from __future__ import annotations

import logging
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Sequence

from engine.rl.episode_outcome import EvalScore
from engine.rl.run_task import RunTask
from engine.swarm.store import Store

log = logging.getLogger(__name__)

#: rows of one eval job (held-out prompts of one token length decoded together)
EVAL_ROWS = 64


@dataclass
class EvalRound:
    version: int
    pending: dict[str, list[str]] = field(default_factory=dict)  #: job id -> its prompts, dispatched
    strict: float = 0.0  #: sum of the strict scores so far
    content: float = 0.0  #: sum of the content-only scores so far
    total: int = 0
    min_version: int | None = None  #: the oldest stage version that served any of its jobs
    queue: deque[list[str]] = field(default_factory=deque)  #: prompt batches not dispatched yet


class EvalScheduler:
    """Eval rounds of one run, one at a time."""

    def __init__(self, task: RunTask, store: Store) -> None:
        self.task, self.store = task, store
        self.round: EvalRound | None = None
        #: the version to evaluate next (None: nothing asked); the base is evaluated first. Durable
        #: (store meta ``eval_wanted``, cleared when its round is recorded): a restart loses no eval.
        saved = store.get_meta("eval_wanted")
        self.wanted: int | None = 0 if not store.eval_count() else (None if saved is None else int(saved))

    @property
    def running(self) -> bool:
        return self.round is not None

    def has_baseline(self) -> bool:
        """The "before" eval is recorded (training waits for it)."""
        return self.store.eval_count() > 0

    def baseline_running(self) -> bool:
        """The "before" eval still has jobs out (rollouts of version 0 should not pile up meanwhile)."""
        return self.round is not None and self.round.version == 0 and bool(self.round.pending)

    def request(self, version: int, final: bool = False) -> None:
        """Evaluate ``version`` as soon as generation capacity allows. A running round is left alone:
        a periodic request made meanwhile is dropped (rounds slower than the eval spacing must not
        crowd out training), a ``final`` one (the run finished: ``max_versions``, an operator's
        finish) waits for it to end, so the run still gets its final eval."""
        if self.round is not None and (not final or self.round.version == version):
            return
        self.wanted = version
        self.store.set_meta("eval_wanted", version)

    def next_batch(self) -> list[str] | None:
        """The prompts of the next eval job, starting a wanted round; None if there is none.

        The caller dispatches them and says so with :meth:`dispatched`."""
        if self.wanted is not None and self.round is None:
            self._start(self.wanted)
        if self.round is None or not self.round.queue:
            return None
        return self.round.queue.popleft()

    def dispatched(self, job_id: str, prompts: list[str]) -> None:
        """``prompts`` (from :meth:`next_batch`) are out as job ``job_id``."""
        if self.round is not None:
            self.round.pending[job_id] = prompts

    def _start(self, version: int) -> None:
        by_length: dict[int, list[str]] = defaultdict(list)
        for prompt in self.task.eval_prompts():
            by_length[len(self.task.prompt_ids(prompt))].append(prompt)
        queue: deque[list[str]] = deque()
        for _, prompts in sorted(by_length.items()):
            for i in range(0, len(prompts), EVAL_ROWS):
                queue.append(prompts[i:i + EVAL_ROWS])
        self.round = EvalRound(version=version, queue=queue)
        self.wanted = None
        log.info("eval of version %d: %d prompts in %d jobs", version, sum(map(len, queue)), len(queue))

    def on_scores(self, job_id: str, scores: Sequence[EvalScore], versions: Sequence[int]) -> None:
        """Record a finished eval job (one score per prompt, its episodes' own); the last one records the round."""
        r = self.round
        if r is None or job_id not in r.pending:
            return
        prompts = r.pending.pop(job_id)
        if len(scores) != len(prompts):
            raise ValueError(f"{len(scores)} scores for {len(prompts)} eval prompts")
        for score in scores:
            r.strict += score.strict
            r.content += score.content
        r.total += len(prompts)
        low = min(versions)
        r.min_version = low if r.min_version is None else min(r.min_version, low)
        if not r.pending and not r.queue:
            accuracy, content = r.strict / max(r.total, 1), r.content / max(r.total, 1)
            self.store.record_eval(r.version, accuracy, r.total, content=content)
            if self.store.get_meta("eval_wanted") == r.version:
                self.store.set_meta("eval_wanted", None)
            log.info("eval version %d: strict %.3f, content %.3f on %d held-out prompts", r.version, accuracy,
                     content, r.total)
            self.round = None

    def on_failed(self, job_id: str) -> None:
        """An eval job was lost: its prompts go back to the front of the queue."""
        if self.round is not None and job_id in self.round.pending:
            self.round.queue.appendleft(self.round.pending.pop(job_id))
