"""A multi-turn rollout's loss mask reaches the objective: context tokens are neither trained nor in a ratio.

The mask goes from the stored rollout (``Store``) through the step runner's ``Sample`` into the
training rows (``build_batch``, the same rows the in-process trainer and the swarm's ``train_out``
use), and the objective gives those tokens no gradient and leaves them out of its statistics.
"""

from __future__ import annotations

import numpy as np

from engine.rl.batch import build_batch
from engine.rl.objective import ObjectiveConfig, compute_objective
from engine.rl.rollout import Group, Sample
from engine.swarm.store import Store

PROMPT = np.array([1, 5, 6], dtype=np.int64)
#: model turn (7, 8, 2), observation (9, 10, 11), model turn (12, 2)
COMPLETION = [7, 8, 2, 9, 10, 11, 12, 2]
MASK = [1, 1, 1, 0, 0, 0, 1, 1]
LOGPROBS = [-1.0, -2.0, -0.5, 0.0, 0.0, 0.0, -1.5, -0.1]


def test_a_stored_loss_mask_comes_back_and_an_all_model_one_is_stored_as_none(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    common = dict(group_id="g", prompt="p", behaviour_logprobs=LOGPROBS, versions=[0, 0], min_version=0,
                  reward=1.0, advantage=0.5)
    store.add_rollouts([dict(common, tokens=COMPLETION, loss_mask=MASK), dict(common, tokens=COMPLETION)])
    masked, plain = store.ready_rollouts(limit=5)
    assert masked.loss_mask.astype(int).tolist() == MASK
    assert plain.loss_mask is None


def test_context_tokens_inside_a_completion_get_no_loss_no_gradient_and_no_ratio():
    sample = Sample(completion_ids=np.array(COMPLETION), behaviour_logprobs=np.array(LOGPROBS, dtype=np.float32),
                    versions=np.zeros((len(COMPLETION), 2), dtype=np.int64), finished=True, reward=1.0,
                    loss_mask=np.array(MASK, dtype=bool))
    batch = build_batch([Group("p", PROMPT, [sample])], [np.array([1.0])], pad_id=0, trainer_versions=[0, 0])
    start = len(PROMPT) - 1  # the target of the last prompt position is the first completion id
    assert batch.mask[0, start:].astype(int).tolist() == MASK
    assert not batch.mask[0, :start].any()
    assert batch.num_tokens == sum(MASK)
    # a proximal log-prob far from the behaviour one on the context tokens would be masked by the
    # importance band or clipped if they counted; they must simply not count
    logp = np.where(batch.mask, batch.behaviour, -1.0).astype(np.float32)  # on-policy on the model's tokens
    prox = logp.copy()
    prox[0, start + 3:start + 6] = -20.0
    result = compute_objective(logp, prox, batch.behaviour, batch.advantages, batch.mask, ObjectiveConfig())
    context = ~batch.mask
    assert np.all(result.grad[context] == 0.0)
    assert np.all(result.grad[batch.mask] != 0.0)
    assert result.stats.num_tokens == sum(MASK)
    assert result.stats.masked_fraction == 0.0  # the far-off context tokens are not in the importance band's count
