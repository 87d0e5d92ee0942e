"""engine.envs imports no torch, mlx, Qt, aiortc or transformers (it runs in the coordinator)."""

from __future__ import annotations

import subprocess
import sys

MODULES = ["engine.envs", "engine.envs.pids_cgroup", "engine.envs.contract", "engine.envs.trajectory",
           "engine.envs.tools", "engine.envs.stats", "engine.envs.token_rollout", "engine.envs.calculator",
           "engine.envs.sandbox", "engine.envs.tool_env", "engine.envs.registry",
           "engine.envs.transcripts"]


def test_envs_modules_import_without_heavy_packages():
    code = ("import importlib, sys\n"
            f"for name in {MODULES!r}: importlib.import_module(name)\n"
            "print(' '.join(m for m in ('torch', 'mlx', 'PySide6', 'transformers', 'aiortc', 'tokenizers', 'jinja2')"
            " if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_the_sandbox_runner_is_never_imported_by_the_product():
    code = ("import importlib, sys\n"
            f"for name in {MODULES!r}: importlib.import_module(name)\n"
            "print('engine.envs.sandbox_runner' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
