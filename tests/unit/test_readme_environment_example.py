"""The README's one-file environment runs as written through the contract."""

from __future__ import annotations

import re
from pathlib import Path

from engine.envs.contract import EpisodeLimits, run_episode

README = Path(__file__).resolve().parents[2] / "README.md"


def _example_source() -> str:
    section = README.read_text(encoding="utf-8").split("## Environments and tools", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_readme_environment_plays_a_binary_search_to_the_answer():
    namespace: dict = {}
    exec(compile(_example_source(), "README.md", "exec"), namespace)  # noqa: S102 - our own README
    env = namespace["GuessTheNumber"]()
    for item in env.eval_items():
        lo, hi = 1, 100

        def policy(messages):
            nonlocal lo, hi
            if messages[-1].content == "higher":
                lo = int(messages[-2].content) + 1
            elif messages[-1].content == "lower":
                hi = int(messages[-2].content) - 1
            return str((lo + hi) // 2)

        result = run_episode(env, item, policy, EpisodeLimits(max_turns=7))  # 2**7 > 100
        assert not result.cut and result.parts["answer"] == 1.0
        assert result.reward == 1.0 + 0.1 / result.turns
