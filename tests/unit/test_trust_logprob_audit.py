"""Finding 4 of issue 14, last part: the proximal pass checks every generator's behaviour log-probs.

Real step runner, store, planner, micro-batch dispatcher and audit; the swarm is a recording
outbox whose last stages answer the proximal pass with fixed log-probs (what honest weights give).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest

from engine.paths import base_checkpoint_dir
from engine.rl.codec import TaskCodec
from engine.rl.objective import ObjectiveConfig
from engine.rl.run_task import DigitRunTask
from engine.rl.tasks import make_task
from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.logprob_audit import GROSS_MISMATCH_NATS, LogprobAudit, route_avoiding
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.step_runner import StepRunner
from engine.swarm.store import Store
from tests.support.recording_links import RecordingLinks

#: the log-prob honest weights give every target in this test
TRUE_LOGPROB = -0.5
#: an honest generator's behaviour log-probs: off by a little (older version, bf16 activations)
HONEST_OFFSET = 0.02
FORGED_LOGPROB = -40.0


def _node(links: RecordingLinks, steps: StepRunner):
    """Trainers answering like honest ones: proximal log-probs, micro-batches done, steps applied."""
    def on_send(peer, message):
        mb = steps.microbatches
        if isinstance(message, messages.TrainOut) and message.prox:
            rows = [[TRUE_LOGPROB] * len(r) for r in message.targets]
            mb.on_prox_done(peer, messages.ProxDone(step=message.step, mb=message.mb, logprobs=rows))
        elif isinstance(message, messages.TrainIn) and not message.prox:
            mb.on_mb_done(peer, messages.MbDone(step=message.step, mb=message.mb))
        elif isinstance(message, messages.Apply):
            steps.on_stepped(peer, messages.Stepped(step=message.step, version=message.version, grad_norm=1.0,
                                                    checksum=0.0, update_bytes=0, dense_bytes=0,
                                                    checkpoint_path=None))
    links.on_send = on_send


@pytest.fixture()
def make_parts(tmp_path):
    made = []

    def make(stages: list[list[str]]):
        codec = TaskCodec.from_dir(base_checkpoint_dir())
        run = RunConfig(group_size=4, prompts_per_step=2, prompts_per_job=1, generations_in_flight=1,
                        updates_per_batch=2, micro_batch_rows=2)
        task, store = DigitRunTask(make_task(run.task), codec), Store(tmp_path / f"c{len(made)}.db")
        links = RecordingLinks.grid(stages)
        book, evals = RunBook(store), EvalScheduler(task, store)
        store.record_eval(0, 0.1, 10)  # the "before" eval is done: training may start
        evals.wanted = None
        rules = UpdateRules(objective=ObjectiveConfig(scale_by_std=True), updates_per_batch=2)
        steps = StepRunner(run, rules, task, store, book, evals,
                           links, step_timeout_s=5.0)
        _node(links, steps)
        made.append(store)
        return steps, store, links, codec
    yield make
    for store in made:
        store.close()


def _add_groups(store, codec, generators: dict[str, float], batch: int) -> None:
    """One group of four per generator (behaviour log-prob ``value`` on every token)."""
    for gen, value in generators.items():
        tokens = codec.encode("12") + [codec.eos_id]
        store.add_rollouts([dict(group_id=f"{batch}:{gen}", prompt="5+7", tokens=tokens,
                                 behaviour_logprobs=[value] * len(tokens), versions=[0, 0], min_version=0,
                                 reward=r, advantage=0.0, generator=gen) for r in (1.0, 0.0, 0.0, 1.0)])


def _prox_routes(links) -> dict[float, set[str]]:
    """Behaviour value -> last stages that computed proximal log-probs of rows carrying it."""
    seen: dict[float, set[str]] = {}
    for peer, m in links.sent:
        if isinstance(m, messages.TrainOut) and m.prox:
            for row, mask in zip(m.behaviour, m.mask):
                values = {round(v, 3) for v, on in zip(row, mask) if on}
                for v in values:
                    seen.setdefault(v, set()).add(peer)
    return seen


def test_forged_behaviour_logprobs_are_checked_on_another_route_flagged_and_on_repeat_evicted(make_parts):
    steps, store, links, codec = make_parts([["a0", "a1"], ["b0", "b1"]])
    honest = TRUE_LOGPROB - HONEST_OFFSET
    _add_groups(store, codec, {"b0": honest, "b1": FORGED_LOGPROB}, batch=0)
    assert asyncio.run(steps.maybe_train()) is True  # the run advances
    seen = _prox_routes(links)
    assert seen[round(FORGED_LOGPROB, 3)] == {"b0"} and seen[round(honest, 3)] == {"b1"}  # never the generator
    audit = steps.audit.snapshot()
    assert audit["b1"]["gross"] == 1 and audit["b1"]["last_mismatch_nats"] == pytest.approx(39.5, abs=1e-3)
    assert audit["b0"]["gross"] == 0 and audit["b0"]["last_mismatch_nats"] == pytest.approx(HONEST_OFFSET, abs=1e-3)
    assert steps.book.counters["audit_dropped_rows"] == 4  # the forged rows are not trained on
    trained = [m for _, m in links.sent if isinstance(m, messages.TrainOut) and not m.prox]
    assert not any(on for m in trained for row, mask in zip(m.behaviour, m.mask)
                   for v, on in zip(row, mask) if on and v < -10)
    assert links.evicted == []  # one gross pass flags, it does not evict

    links.sent.clear()
    _add_groups(store, codec, {"b0": honest, "b1": FORGED_LOGPROB}, batch=1)
    assert asyncio.run(steps.maybe_train()) is True
    assert [peer for peer, _ in links.evicted] == ["b1"]  # the second one in a row evicts, the honest one stays
    assert steps.book.counters["evicted_generators"] == 1 and steps.audit.scores["b0"].gross == 0


def test_with_one_replica_of_the_last_stage_the_check_is_skipped_and_counted_never_failed(make_parts):
    steps, store, links, codec = make_parts([["a0"], ["b0"]])
    for batch in (0, 1):
        _add_groups(store, codec, {"b0": FORGED_LOGPROB}, batch=batch)
    assert asyncio.run(steps.maybe_train()) is True
    assert steps.book.counters["unaudited_rows"] == 8 and steps.audit.scores == {} and links.evicted == []


def test_the_check_route_excludes_the_generator_whenever_another_route_exists():
    routes = [["a0", "b0"], ["a1", "b1"], ["a2", "b0"]]
    assert {tuple(route_avoiding(routes, "b0", t)[0]) for t in range(4)} == {("a1", "b1")}
    assert route_avoiding(routes, "b0", 0)[1] is True
    assert route_avoiding([["a0", "b0"]], "b0", 3) == (["a0", "b0"], False)
    assert route_avoiding(routes, None, 2)[0] == ["a2", "b0"]  # an unknown generator: any route


def test_an_honest_generator_within_the_measured_spread_never_accumulates_a_score():
    evicted = []
    audit = LogprobAudit(lambda peer, why: evicted.append(peer), counters=Counter())
    rng = np.random.default_rng(0)
    for _ in range(200):
        mean = float(rng.uniform(0.0, GROSS_MISMATCH_NATS / 4))  # well above the honest spread measured
        assert audit.record({"honest": (mean * 50, 50)}) == set()
    assert evicted == [] and audit.scores["honest"].score == 0.0
    assert audit.record({"honest": (0.0, 0)}) == set()  # no tokens: no check
    # a forger that alternates gross and honest passes is evicted too (score 1, 0.5, 1.25)
    for k in range(3):
        assert audit.record({"sly": ((GROSS_MISMATCH_NATS * 3 if k % 2 == 0 else 0.0) * 10, 10)}) == \
            ({"sly"} if k % 2 == 0 else set())
    assert evicted == ["sly"]
    # isolated gross passes (three honest ones between) decay away: never evicted
    for k in range(40):
        audit.record({"unlucky": ((GROSS_MISMATCH_NATS * 3 if k % 4 == 0 else 0.0) * 10, 10)})
    assert evicted == ["sly"] and audit.scores["unlucky"].gross == 10
