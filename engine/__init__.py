"""Polis engine: everything that is neither GUI nor tensor maths.

Sub-packages: ``model`` (checkpoints, shard plans, tokenizer), ``rl`` (tasks,
rollouts, objective, trainer), ``net`` (WebRTC links, signalling, identity,
codecs, discovery), ``swarm`` (coordinator and node), ``bench`` (``polis bench``).

Importing ``engine`` never imports torch, mlx or PySide6: backends are created
lazily through ``backends.registry``.
"""

__version__ = "0.1.0"
