"""Environments: multi-turn episodes, tools, the python sandbox, loss masks of trajectories.

Modules: ``contract`` (the environment contract: items, episodes, limits, cuts, rewards in
named parts; ``TaskEnvironment``, the one-turn case of a ``Task``), ``trajectory`` (token ids
and the loss mask of a multi-turn episode from a chat template), ``tools`` (the tagged-JSON
call format, ``CalculatorTool``, ``PythonTool``), ``calculator`` (exact arithmetic),
``sandbox`` (+ ``sandbox_runner``, which only ever runs inside the sandbox, and
``pids_cgroup``), ``stats`` (figures of a batch of episodes), ``tool_env`` (``ToolEnvironment`` and the calculator
environment over a chat question source), ``token_rollout`` (one episode at the token level:
one growing context for a KV cache, the trajectory and its behaviour log-probs; ``TokenEpisodeRun``
is the stepping the swarm's turn driver shares), ``registry`` (the environments a run can name),
``transcripts`` (correct tool-use transcripts of training items, for ``engine.rl.tool_warmup``).

What it does not know: models, backends, the swarm (``engine.rl.env_run_task`` and
``engine.swarm.episodes`` drive episodes through the pipeline). Importing it pulls in no torch,
mlx, Qt or network stack.
"""
