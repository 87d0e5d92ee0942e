"""The update planner, and the same rollouts trained by the in-process trainer and by the swarm's step runner.

Both paths run their real code (``Trainer.train_on`` and ``StepRunner.maybe_train`` over a real
SQLite store); the model is replaced by a log-prob that depends on the tokens only, so the
per-token loss gradients (the numpy objective's closed form) can be compared exactly.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from engine.paths import base_checkpoint_dir
from engine.rl.codec import TaskCodec
from engine.rl.objective import ObjectiveConfig, compute_objective
from engine.rl.recipe import BASE_TASK
from engine.rl.rollout import Group, Sample
from engine.rl.run_task import DigitRunTask
from engine.rl.step_log import StepLog
from engine.rl.tasks import make_task
from engine.rl.tasks.rewards import token_reward
from engine.rl.trainer import Trainer, TrainerConfig
from engine.rl.update import UpdateRules, clip_scale, plan_update
from engine.swarm import messages
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.step_runner import StepRunner
from engine.swarm.store import Store

GROUP_SIZE = 4
NUM_STAGES = 2
TRAINER_VERSION = 6
OBJECTIVE = ObjectiveConfig(scale_by_std=True, std_eps=0.25)  # far from the default: a forgotten eps shows
#: per-stage squared gradient norms the fake model reports: stage 0 is clipped (norm 3), stage 1 is not
STAGE_SQ_NORMS = [9.0, 0.25]


def token_logprobs(inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """A log-prob that depends on the tokens alone (no weights), the same on both paths."""
    inputs, targets = np.asarray(inputs, dtype=np.int64), np.asarray(targets, dtype=np.int64)
    return (-0.2 - 0.05 * ((inputs * 7 + targets * 3) % 11)).astype(np.float32)


def make_groups(codec: TaskCodec) -> list[Group]:
    """Scored groups: mixed rewards, one zero-variance group, two stale ones, several lengths."""
    task = make_task(BASE_TASK)
    rng = np.random.default_rng(7)
    digits = [codec.char_to_id[c] for c in "0123456789"]
    groups = []
    for k in range(9):
        prompt = task.random_prompt(rng)
        group = Group(prompt=prompt, prompt_ids=np.asarray(codec.encode_prompt(prompt), dtype=np.int64))
        age = 5 if k in (2, 6) else int(rng.integers(0, 3))  # 5 > max_staleness: dropped
        for i in range(GROUP_SIZE):
            if k == 4:  # every sample the same: equal rewards, no signal
                ids = np.asarray(digits[:3] + [codec.eos_id], dtype=np.int64)
            elif i == 0:  # the right answer: every other group has signal
                ids = np.asarray([codec.char_to_id[c] for c in task.solve(prompt)] + [codec.eos_id], dtype=np.int64)
            else:
                length = int(rng.integers(1, 6))
                ids = np.asarray(list(rng.choice(digits, size=length)) + [codec.eos_id], dtype=np.int64)
            versions = np.full((len(ids), NUM_STAGES), TRAINER_VERSION - age, dtype=np.int64)
            versions[:, 1] += i % 2  # stages served it at different versions; the oldest counts
            group.samples.append(Sample(completion_ids=ids, finished=True, versions=versions,
                                        behaviour_logprobs=(-0.3 - 0.02 * rng.random(len(ids))).astype(np.float32),
                                        reward=token_reward(task, prompt, ids, codec)))
        groups.append(group)
    return groups


class TokenOnlyPipeline:
    """A ``StagePipeline`` whose log-probs depend on the tokens only; records what training sends it."""

    num_stages = NUM_STAGES

    def __init__(self) -> None:
        self._versions = [TRAINER_VERSION] * NUM_STAGES
        self.keyed: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.backward_calls: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  #: (inputs, targets, grad)
        self.step_scales: list[list[float]] = []

    def token_logprobs(self, inputs, targets, *, key=None, temperature=1.0, segments=None):
        if key is not None:
            self.keyed[key] = (np.asarray(inputs), np.asarray(targets))
        return token_logprobs(inputs, targets)

    def backward(self, key, grad_logprobs):
        inputs, targets = self.keyed.pop(key)
        self.backward_calls.append((inputs, targets, np.asarray(grad_logprobs)))

    def zero_grad(self):
        pass

    def grad_sq_norms(self):
        return list(STAGE_SQ_NORMS)

    def clip_units(self):
        return [(i,) for i in range(len(STAGE_SQ_NORMS))]

    def step(self, grad_scale=1.0):
        self.step_scales.append(list(grad_scale))
        self._versions = [v + 1 for v in self._versions]

    def versions(self):
        return tuple(self._versions)


class PlayedSwarm:
    """``NodeLinks`` whose one route's nodes answer at once, computing what a last stage computes."""

    def __init__(self, objective: ObjectiveConfig, max_grad_norm: float) -> None:
        self.objective, self.max_grad_norm = objective, max_grad_norm
        self.steps: StepRunner | None = None
        self.inputs: dict[tuple[int, int, bool], np.ndarray] = {}
        self.grads: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []  #: (step, inputs, targets, grad)
        self.stage_scales: list[list[float]] = []

    def routes(self):
        return [["s0", "s1"]]

    gen_routes = routes

    def stage_replicas(self):
        return [["s0"], ["s1"]]

    def inference_replicas(self):
        return [[], []]

    def catching_up(self) -> bool:
        return False

    def leader(self, stage):
        return self.stage_replicas()[stage][0]

    async def send(self, peer, m):
        runner = self.steps
        if isinstance(m, messages.TrainIn):
            self.inputs[(m.step, m.mb, m.prox)] = np.asarray(m.inputs)
        elif isinstance(m, messages.TrainOut):
            inputs, targets = self.inputs.pop((m.step, m.mb, m.prox)), np.asarray(m.targets)
            logp = token_logprobs(inputs, targets)
            if m.prox:
                runner.microbatches.on_prox_done("s1", messages.ProxDone(step=m.step, mb=m.mb, logprobs=logp.tolist()))
                return True
            anchor = logp if m.proximal is None else np.asarray(m.proximal)
            advantages = np.asarray(m.advantages if m.token_advantages is None else m.token_advantages)
            result = compute_objective(logp, anchor, np.asarray(m.behaviour), advantages,
                                       np.asarray(m.mask), self.objective, normaliser=m.normaliser)
            self.grads.append((m.step, inputs, targets, result.grad))
            runner.microbatches.on_mb_done("s0", messages.MbDone(step=m.step, mb=m.mb))
        elif isinstance(m, messages.Apply):
            # each stage clips its own norm, as engine.swarm.stage_runtime does with the planner's rule
            stage = int(peer[1])
            if stage == 0:
                self.stage_scales.append([])
            self.stage_scales[-1].append(clip_scale(float(np.sqrt(STAGE_SQ_NORMS[stage])), self.max_grad_norm))
            runner.on_stepped(peer, messages.Stepped(step=m.step, version=m.version, grad_norm=0.0, checksum=1.0,
                                                     update_bytes=0, dense_bytes=0, checkpoint_path=None))
        return True


@pytest.fixture(scope="module")
def codec():
    return TaskCodec.from_dir(base_checkpoint_dir())


@pytest.mark.parametrize("updates_per_batch,pack", [(1, False), (3, False), (1, True), (3, True)])
def test_trainer_and_swarm_train_the_same_batches_with_the_same_gradients(tmp_path, codec, updates_per_batch, pack):
    """Rows plain or packed (a group's prompt once: ``pack_groups``), the same rows and gradients."""
    groups = make_groups(codec)
    fresh = [g for k, g in enumerate(groups) if k not in (2, 6)]
    config = TrainerConfig(task=BASE_TASK, objective=OBJECTIVE, group_size=GROUP_SIZE, prompts_per_step=len(groups),
                           max_staleness=4, updates_per_batch=updates_per_batch, max_grad_norm=1.0,
                           micro_batch_rows=5, eval_every_steps=0, pack_groups=pack)
    rules = config.update_rules()

    # the in-process trainer
    pipeline = TokenOnlyPipeline()
    trainer = Trainer(pipeline, codec, config)
    log = StepLog(step=1, versions=pipeline.versions(), trained=False)
    trainer.train_on(groups, log)

    # the swarm: the same rollouts in the replay buffer, in the same order
    store = Store(tmp_path / "c.db")
    store.record_eval(0, 0.1, 10)  # the "before" eval is done
    store.set_meta("version", TRAINER_VERSION)
    for k, g in enumerate(groups):
        adv, _ = rules.advantages(g.rewards()[None, :])
        store.add_rollouts([dict(group_id=f"g{k}", prompt=g.prompt, tokens=s.completion_ids.tolist(),
                                 behaviour_logprobs=s.behaviour_logprobs, versions=s.oldest_versions().tolist(),
                                 min_version=int(s.oldest_versions().min()), reward=s.reward, advantage=float(a),
                                 generator="s1")
                            for s, a in zip(g.samples, adv[0])])
    run = RunConfig(task=BASE_TASK, objective=OBJECTIVE, group_size=GROUP_SIZE, prompts_per_step=len(fresh),
                    micro_batch_rows=3, updates_per_batch=updates_per_batch, max_staleness=4, max_grad_norm=1.0,
                    eval_every_versions=0, pack_groups=pack)
    swarm = PlayedSwarm(OBJECTIVE, run.max_grad_norm)
    book = RunBook(store)
    run_task = DigitRunTask(make_task(BASE_TASK), codec)
    swarm.steps = StepRunner(run, rules, run_task, store, book, EvalScheduler(run_task, store), swarm)
    assert asyncio.run(swarm.steps.maybe_train())

    # the same books: stale groups dropped, the zero-variance one skipped, every group's staleness counted
    updates = min(updates_per_batch, len(fresh) - 1)
    assert log.dropped_stale == book.counters["dropped_stale"] == 2
    assert book.counters["zero_variance_groups"] == 1 and log.zero_variance_fraction == pytest.approx(1 / len(fresh))
    assert dict(swarm.steps.staleness_histogram) == log.staleness_histogram
    # the histogram is in the store, so a restarted coordinator (and polis export) sees it whole
    restarted = StepRunner(run, rules, run_task, store, book, EvalScheduler(run_task, store), swarm)
    assert dict(restarted.staleness_histogram) == log.staleness_histogram
    assert book.version == TRAINER_VERSION + updates and pipeline.versions() == (TRAINER_VERSION + updates,) * 2
    assert store.rollout_counts() == {"consumed": (len(fresh) - 1) * GROUP_SIZE, "dropped": 3 * GROUP_SIZE}

    # the same per-stage clipping: stage 0 (norm 3) scaled to norm 1, stage 1 left alone
    np.testing.assert_allclose(pipeline.step_scales, [[1 / 3, 1.0]] * updates, rtol=1e-9)
    np.testing.assert_allclose(swarm.stage_scales, pipeline.step_scales, rtol=1e-12)

    # the same mini-batches and rows in the same order, the same per-token gradients
    plan = plan_update(groups, (TRAINER_VERSION,) * NUM_STAGES, rules, codec.pad_id)
    update_of_row = [m for m, b in enumerate(plan.minibatches) for _ in range(b.num_rows)]
    trainer_rows = [(inputs[r], targets[r], grad[r]) for inputs, targets, grad in pipeline.backward_calls
                    for r in range(inputs.shape[0])]
    swarm_rows = [(step - TRAINER_VERSION, inputs[r], targets[r], grad[r])
                  for step, inputs, targets, grad in swarm.grads for r in range(inputs.shape[0])]
    assert len(trainer_rows) == len(swarm_rows) == len(update_of_row) == (len(fresh) - 1) * (1 if pack else GROUP_SIZE)
    assert [update for update, *_ in swarm_rows] == update_of_row
    for (t_in, t_tg, t_grad), (_, s_in, s_tg, s_grad) in zip(trainer_rows, swarm_rows):
        width = s_in.shape[0]  # the swarm trims micro-batches to their longest row; the rest is padding
        np.testing.assert_array_equal(t_in[:width], s_in)
        np.testing.assert_array_equal(t_tg[:width], s_tg)
        assert not t_grad[width:].any()
        np.testing.assert_allclose(t_grad[:width], s_grad, rtol=1e-4, atol=1e-7)  # the swarm rounds to 6 digits
    assert sum(np.abs(g).sum() for *_, g in trainer_rows) > 0
    store.close()


def test_mini_batches_take_whole_groups_and_never_more_updates_than_informative_groups(codec):
    groups = make_groups(codec)
    rules = UpdateRules(objective=OBJECTIVE, max_staleness=4, updates_per_batch=3, pack_groups=False)
    plan = plan_update(groups, (TRAINER_VERSION,) * NUM_STAGES, rules, codec.pad_id)
    assert plan.stale == [2, 6] and plan.zero_variance == [4]
    assert plan.minibatch_groups == [[0, 1], [3, 5], [7, 8]]  # contiguous chunks, in the order given
    packed = plan_update(groups, (TRAINER_VERSION,) * NUM_STAGES, replace(rules, pack_groups=True), codec.pad_id)
    assert packed.minibatch_groups == plan.minibatch_groups
    for members, batch, one_row_each in zip(plan.minibatch_groups, plan.minibatches, packed.minibatches):
        assert batch.num_rows == batch.num_samples == GROUP_SIZE * len(members)
        assert one_row_each.num_rows == len(members) and one_row_each.num_samples == batch.num_samples
        assert one_row_each.num_tokens == batch.num_tokens  # the same completion tokens trained
        # whole groups: each mini-batch's advantages are its groups' own, which sum to zero per group
        assert sorted(batch.advantages.tolist()) == pytest.approx(
            sorted(a for g in members for a in plan.advantages[g].tolist()), abs=1e-6)
    many = plan_update(groups, (TRAINER_VERSION,) * NUM_STAGES, replace(rules, updates_per_batch=64), codec.pad_id)
    assert len(many.minibatches) == 6 and all(len(m) == 1 for m in many.minibatch_groups)


def test_advantages_are_scaled_with_the_objectives_std_eps(codec):
    rewards = np.array([[0.0, 0.0, 0.0, 1.0]])
    for eps in (1e-6, 0.25):
        adv, keep = UpdateRules(objective=ObjectiveConfig(scale_by_std=True, std_eps=eps)).advantages(rewards)
        centred = rewards - rewards.mean()
        np.testing.assert_allclose(adv, centred / (rewards.std() + eps))
        assert keep.tolist() == [True]


def test_staleness_is_counted_for_every_group_seen_and_stale_ones_are_dropped(codec):
    groups = make_groups(codec)
    plan = plan_update(groups, (TRAINER_VERSION,) * NUM_STAGES, UpdateRules(max_staleness=4), codec.pad_id)
    assert sum(plan.staleness_histogram.values()) == len(groups)
    assert plan.staleness_histogram[5] == plan.dropped_stale == 2
    assert not set(plan.stale) & set(plan.trained)
    nothing = plan_update(groups, (TRAINER_VERSION + 10,) * NUM_STAGES, UpdateRules(max_staleness=4), codec.pad_id)
    assert nothing.minibatches == [] and nothing.dropped_stale == len(groups) and nothing.zero_variance_fraction == 0


def test_clip_scale_clips_only_above_the_bound_and_refuses_a_non_finite_norm():
    assert clip_scale(0.5, 1.0) == 1.0 and clip_scale(4.0, 0.0) == 1.0
    assert clip_scale(4.0, 1.0) == pytest.approx(0.25)
    assert UpdateRules(max_grad_norm=2.0).stage_clip_scales([16.0, 1.0]) == pytest.approx([0.5, 1.0])
    with pytest.raises(ValueError):
        clip_scale(float("nan"), 1.0)


def test_stages_sharing_a_tied_tensor_clip_as_one_unit_and_the_others_alone():
    rules = UpdateRules(objective=ObjectiveConfig(), max_grad_norm=1.0)
    sq = [9.0, 0.25, 16.0]  # norms 3, 0.5, 4
    alone = rules.stage_clip_scales(sq)
    assert alone == pytest.approx([1 / 3, 1.0, 1 / 4], rel=1e-9)
    tied = rules.stage_clip_scales(sq, [(0, 2), (1,)])
    assert tied[0] == tied[2] == pytest.approx(1 / 5, rel=1e-9)  # sqrt(9 + 16) = 5
    assert tied[1] == 1.0
