"""The coordinator's scheduling parts over a real store, task and codec, with a recording outbox.

``scheduling_parts(db_path, links)``: a generation scheduler and a step runner of one small run
(groups of 4, one prompt per step and per job, one update per batch) sharing a ``RunBook`` and a
``Store`` at ``db_path``, reaching the swarm through ``links`` (``tests.support.recording_links``);
the "before" eval is recorded, so training may start. No networking, no model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.paths import base_checkpoint_dir
from engine.rl.codec import TaskCodec
from engine.rl.objective import ObjectiveConfig
from engine.rl.run_task import DigitRunTask
from engine.rl.tasks import make_task
from engine.rl.update import UpdateRules
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.scheduler import GenerationScheduler
from engine.swarm.step_runner import StepRunner
from engine.swarm.store import Store
from tests.support.recording_links import RecordingLinks


@dataclass
class SchedulingParts:
    generation: GenerationScheduler
    steps: StepRunner
    store: Store
    links: RecordingLinks
    codec: TaskCodec
    task: DigitRunTask
    book: RunBook


def scheduling_parts(db_path: Path, links: RecordingLinks) -> SchedulingParts:
    codec = TaskCodec.from_dir(base_checkpoint_dir())
    run = RunConfig(group_size=4, prompts_per_step=1, prompts_per_job=1, generations_in_flight=1,
                    updates_per_batch=1, micro_batch_rows=4)
    task, store = DigitRunTask(make_task(run.task), codec), Store(db_path)
    book, evals = RunBook(store), EvalScheduler(task, store)
    store.record_eval(0, 0.1, 10)  # the "before" eval is done: training may start
    evals.wanted = None
    rules = UpdateRules(objective=ObjectiveConfig(scale_by_std=True))
    generation = GenerationScheduler(run, rules, task, store, book, evals, links, vocab_size=codec.vocab_size)
    steps = StepRunner(run, rules, task, store, book, evals, links, step_timeout_s=5.0)
    return SchedulingParts(generation, steps, store, links, codec, task, book)
