"""The python tool inside an episode: hostile snippets become error observations, then the
environment serves the next episode normally."""

from __future__ import annotations

import pytest

from engine.envs.contract import EpisodeLimits, run_episode
from engine.envs.sandbox import Sandbox, SandboxLimits
from engine.envs.tool_env import ToolEnvironment
from engine.envs.tools import PythonTool, format_tool_call
from tests.support.digit_questions import DigitAdditionQuestions

pytestmark = pytest.mark.skipif(not Sandbox.namespaces_available(),
                                reason="this machine gives no user namespaces (unshare -U); the sandbox refuses")

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256, max_processes=16, output_bytes=2048)
HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "infinite loop": "while True:\n    pass\n",
    "10 GB": "x = bytearray(10 * 1024 ** 3)\n",
    "1 GB of output": "while True:\n    print('x' * 100000)\n",
    "socket": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\n",
}


def _policy_for(code):
    def policy(messages):
        if messages[-1].role == "tool":
            return "<answer>0</answer>"
        return format_tool_call("python", {"code": code})
    return policy


def _honest(messages):
    if messages[-1].role == "tool":
        return f"<answer>{messages[-1].content.strip()}</answer>"
    a, b = [w.strip("?") for w in messages[1].content.split() if w.strip("?").isdigit()]
    return format_tool_call("python", {"code": f"print({a} + {b})"})


def test_each_hostile_snippet_is_an_error_observation_and_the_next_episode_is_normal():
    env = ToolEnvironment(DigitAdditionQuestions(eval_size=8), [PythonTool(limits=LIMITS)], name="python")
    items = env.eval_items()
    limits = EpisodeLimits(max_turns=3, max_tool_s=20.0)
    for k, (name, code) in enumerate(HOSTILE.items()):
        result = run_episode(env, items[k], _policy_for(code), limits)
        observation = [m.content for m in result.messages if m.role == "tool"][0]
        assert "error:" in observation, (name, observation)
        assert result.tool_errors == 1 and not result.cut, name
        assert len(observation) < 3000, name
        normal = run_episode(env, items[k + 1], _honest, limits)
        assert normal.parts["answer"] == 1.0, (name, normal.messages)
        assert normal.tool_errors == 0


def test_the_episode_tool_budget_shortens_the_sandbox_wall_clock():
    env = ToolEnvironment(DigitAdditionQuestions(eval_size=2), [PythonTool(limits=SandboxLimits(wall_s=30.0))])
    result = run_episode(env, env.eval_items()[0], _policy_for("import time\ntime.sleep(60)\n"),
                         EpisodeLimits(max_turns=2, max_tool_s=1.0))
    assert result.tool_s < 5
    assert [c.kind.value for c in result.cuts] == ["tool_s"]
    assert result.reward == 0.0
