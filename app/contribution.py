"""What this computer contributed: this session and all time, persisted as a small JSON file.

The node reports cumulative counters for its own run (``stats`` events); a node run
ends (pause, crash, quit) and a new one starts from zero. This module folds runs
into an app-session total and adds the stored all-time total. It knows the
counter names of the protocol's ``stats`` event and the file format, nothing about
Qt or processes.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Mapping

from engine.atomic_file import atomic_write_text

log = logging.getLogger(__name__)

#: the cumulative counters of a ``stats`` event that add up across runs.
COUNTERS = ("tokens_generated", "microbatches_trained", "bytes_sent", "bytes_received", "uptime_s", "points")
_FILE_VERSION = 1


def _zero() -> dict[str, float]:
    return {name: 0.0 for name in COUNTERS}


def _clean_counters(stats: Mapping[str, object]) -> dict[str, float]:
    clean = _zero()
    for name in COUNTERS:
        value = stats.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            clean[name] = float(value)
    return clean


class ContributionLedger:
    """Session and all-time totals; call :meth:`update` per stats event and :meth:`end_run` per node exit."""

    def __init__(self, path: Path, save_interval_s: float = 30.0) -> None:
        self.path = path
        self.save_interval_s = save_interval_s
        self._all_time_base = self._load()
        self._finished_runs = _zero()
        self._current_run = _zero()
        self._last_save = 0.0

    def _load(self) -> dict[str, float]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return _zero()
        except (OSError, ValueError) as exc:
            log.warning("could not read contribution totals from %s (%s); starting from zero", self.path, exc)
            return _zero()
        if not isinstance(data, dict) or not isinstance(data.get("all_time"), dict):
            log.warning("contribution file %s has an unknown layout; starting from zero", self.path)
            return _zero()
        return _clean_counters(data["all_time"])

    def update(self, stats: Mapping[str, object]) -> None:
        """Take the latest cumulative stats of the running node; counters never go backwards."""
        fresh = _clean_counters(stats)
        self._current_run = {k: max(fresh[k], self._current_run[k]) for k in COUNTERS}
        if time.monotonic() - self._last_save >= self.save_interval_s:
            self.save()

    def end_run(self) -> None:
        """The node process ended: its totals become part of the session, and are saved."""
        self._finished_runs = {k: self._finished_runs[k] + self._current_run[k] for k in COUNTERS}
        self._current_run = _zero()
        self.save()

    @property
    def session(self) -> dict[str, float]:
        return {k: self._finished_runs[k] + self._current_run[k] for k in COUNTERS}

    @property
    def all_time(self) -> dict[str, float]:
        session = self.session
        return {k: self._all_time_base[k] + session[k] for k in COUNTERS}

    def save(self) -> None:
        """Write the all-time totals atomically (errors are logged, never raised)."""
        self._last_save = time.monotonic()
        payload = {"version": _FILE_VERSION, "updated": round(time.time(), 3), "all_time": self.all_time}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(payload, indent=1))
        except OSError as exc:
            log.warning("could not save contribution totals to %s: %s", self.path, exc)
