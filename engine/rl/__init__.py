"""RL post-training: verifiable tasks, rollouts, the decoupled-PPO objective, the trainer.

Sub-modules: ``tasks`` (prompt streams, held-out splits, rewards from tokens),
``pipeline`` (what RL needs from a chain of stages; ``LocalPipeline`` chains
in-process backends), ``rollout`` (sampling with KV caches and behaviour
log-probs), ``batch`` (rollouts -> padded training arrays), ``objective``
(loss and its closed-form gradient, in numpy), ``staleness`` (version bounds and
the rollout queue), ``trainer`` (the loop), ``run_state`` (resumable learning state),
``make_base`` (``polis make-base``).

Nothing here knows about transports: the swarm runs the same code with a remote
``StagePipeline``. Nothing here imports torch or mlx.
"""
