"""Export the local demo's run from the node that owns it: the desktop app's "Export model...".

The app never loads a model (it talks to its node through JSON lines and never imports torch).
Its node, when it owns a local demo swarm (``polis node --demo``), answers the control
protocol's ``export`` command with :func:`export_run`: ``polis export --run-dir RUN --out FOLDER
--json`` in a child process (the export loads the model and evaluates it; a child keeps the
node's event loop and compute thread free, and a failure there cannot take the node down),
bounded by :data:`EXPORT_TIMEOUT_S`. The result is what ``polis export --json`` printed; a
failure is an :class:`ExportFailed` with the export's own one-line reason and what to do.

What it does not know: Qt, the control protocol's encoding, how the export is written.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from engine.self_command import polis_command

log = logging.getLogger(__name__)

#: seconds an export (weights, model card with a before/after eval) may take before it is given up
EXPORT_TIMEOUT_S = 1800.0
#: most bytes of the export's output read back (its JSON summary is a few KB)
MAX_OUTPUT_BYTES = 1 << 20


class ExportFailed(RuntimeError):
    """The export did not write a folder: ``message`` says why, ``hint`` what to do next."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


def export_argv(run_dir: Path, out: Path, version: int | None = None) -> list[str]:
    """The ``polis export`` command line for one run directory and output folder."""
    argv = polis_command("export", "--run-dir", str(run_dir), "--out", str(out), "--json")
    if version is not None:
        argv += ["--version", str(version)]
    return argv


async def export_run(run_dir: Path, out: Path, *, version: int | None = None,
                     timeout_s: float = EXPORT_TIMEOUT_S) -> dict[str, Any]:
    """Run ``polis export`` on ``run_dir`` into ``out``; its JSON summary (``out_dir``, ``version``, ...)."""
    proc = await asyncio.create_subprocess_exec(*export_argv(run_dir, out, version),
                                                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise ExportFailed(f"the export ran past {timeout_s:.0f} s and was stopped",
                           "Try again when the computer is less busy, or run `polis export` in a terminal.") from None
    except asyncio.CancelledError:
        proc.kill()
        await proc.wait()
        raise
    reason = stderr[-MAX_OUTPUT_BYTES:].decode("utf-8", "replace").strip().splitlines()
    if proc.returncode != 0:
        last = reason[-1] if reason else f"exit code {proc.returncode}"
        log.warning("polis export failed (exit %s): %s", proc.returncode, last)
        raise ExportFailed(last.removeprefix("polis export: "),
                           "A version can be exported once every stage has written a checkpoint of it; "
                           "let the demo run a little longer and try again.")
    try:
        summary = json.loads(stdout[:MAX_OUTPUT_BYTES])
        if not isinstance(summary, dict) or not isinstance(summary.get("out_dir"), str):
            raise ValueError("no out_dir")
    except ValueError as exc:
        raise ExportFailed(f"the export's summary could not be read ({exc})",
                           f"Look in {out}; the node log has the export's output.") from None
    return summary
