"""RL post-training: verifiable tasks, rollouts, the decoupled-PPO objective, the trainer.

Modules: ``tasks`` (prompt streams, held-out splits, rewards from tokens), ``codec``
(char <-> id tables read from a checkpoint's tokenizer files), ``pipeline`` (what RL needs
from a chain of stages; ``LocalPipeline`` chains in-process backends), ``rollout``
(sampling with KV caches, behaviour log-probs and per-stage versions), ``batch`` (rollouts
-> padded training arrays), ``objective`` (loss and its closed-form gradient, in numpy),
``staleness`` (version bounds and the lagged rollout queue), ``update`` (the one update
planner: staleness, advantages, zero-variance skipping, whole-group mini-batches, per-stage
clipping; the swarm's step runner uses it too), ``trainer`` (the loop), ``step_log`` (what a
step and an eval recorded), ``evaluation`` (greedy held-out evals), ``run_state`` (resumable
learning state), ``sft``
(supervised warm-up), ``recipe`` (the tested settings), ``make_base`` (``polis make-base``).

Nothing here knows about transports: the swarm's coordinator plans its updates with
``update`` and builds its batches with ``batch``. Nothing here imports torch or mlx.
"""
