"""The RL engine and its bench import without torch, mlx, Qt or transformers."""

import subprocess
import sys

MODULES = ["engine.rl.trainer", "engine.rl.make_base", "engine.rl.recipe", "engine.rl.run_state",
           "engine.rl.sft", "engine.rl.tool_warmup", "engine.rl.evaluation", "engine.rl.tasks.rewards",
           "engine.bench.rl"]


def test_rl_modules_import_without_heavy_libraries():
    code = ("import importlib, sys\n"
            f"for name in {MODULES!r}: importlib.import_module(name)\n"
            "print(' '.join(m for m in ('torch', 'mlx', 'PySide6', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""
