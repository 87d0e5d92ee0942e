"""The local demo owner's export (the app's "Export model..."): ``polis export`` in a child process.

A run directory with nothing to export fails with the export's own reason and a hint (the node
sends both to the app as an ``error`` event); the command line is ``polis export`` on that run.
(A real export of a real swarm is tests/integration/test_swarm_export.py.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.swarm.demo_export import ExportFailed, export_argv, export_run


def test_the_export_runs_polis_export_on_the_demos_run_directory(tmp_path):
    argv = export_argv(tmp_path / "demo-run", tmp_path / "out", version=7)
    assert argv[-8:] == ["export", "--run-dir", str(tmp_path / "demo-run"), "--out", str(tmp_path / "out"),
                         "--json", "--version", "7"]


def test_a_run_with_nothing_to_export_fails_with_the_exports_reason_and_a_hint(tmp_path):
    run_dir = tmp_path / "demo-run"
    run_dir.mkdir()
    with pytest.raises(ExportFailed) as caught:
        asyncio.run(export_run(run_dir, tmp_path / "out", timeout_s=120))
    assert "no coordinator database here" in str(caught.value)  # the export's words, its prefix dropped
    assert not str(caught.value).startswith("polis export:")
    assert "checkpoint" in caught.value.hint
    assert not Path(tmp_path / "out").exists()
