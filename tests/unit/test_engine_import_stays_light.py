"""Importing engine, backends and the model/bench/demo modules pulls in no torch, mlx or Qt."""

from __future__ import annotations

import subprocess
import sys

MODULES = ["engine", "backends", "backends.base", "backends.registry", "backends.stage_layout",
           "engine.model.config", "engine.model.checkpoint", "engine.model.safetensors_reader",
           "engine.model.shard_plan", "engine.model.tensor_names", "engine.model.tokenizer",
           "engine.model.loader", "engine.model.random_checkpoint", "engine.model.reference",
           "engine.model.sharded_decode", "engine.bench.shard", "engine.bench.load_probe",
           "engine.model.sharded_check", "engine.swarm.node", "engine.swarm.coordinator", "engine.swarm.demo",
           "engine.cli", "engine.extras", "engine.model.chat_template", "engine.model.importers",
           "engine.model.importers.command", "engine.model.importers.hf_dir", "engine.model.importers.gguf_file",
           "engine.model.importers.smollm2", "engine.rl.codec"]


def test_engine_and_model_modules_import_without_torch_mlx_or_qt():
    code = ("import importlib, sys\n"
            f"for name in {MODULES!r}: importlib.import_module(name)\n"
            "print(' '.join(m for m in ('torch', 'mlx', 'PySide6', 'transformers') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
