"""The desktop app's settings: a typed, validated dataclass persisted in QSettings.

Knows which choices the user can make (swarm, limits, schedule, start at login,
first-run consent), how they are stored (INI-format ``QSettings``, so the file is
readable and easy to include in diagnostics) and how they become the node's
command-line arguments. It does not know widgets, the node process or the
platform autostart mechanism (see ``app.autostart``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import urlsplit

from PySide6.QtCore import QSettings

from engine.control_protocol import LIMIT_FIELDS, ProtocolError, limits_to_cli_args, validate_limits

log = logging.getLogger(__name__)

ORGANIZATION = "Polis"
APPLICATION = "Polis"

#: how the node finds its swarm: LAN discovery, an explicit coordinator URL, or a local demo swarm.
SWARM_MODES = ("lan", "coordinator", "demo")
SWARM_MODE_LABELS = {
    "lan": "Find a swarm on this network (LAN discovery)",
    "coordinator": "Join the coordinator at a URL",
    "demo": "Run a local demo swarm on this computer",
}
_URL_SCHEMES = ("http", "https", "ws", "wss")
#: compute threads of the app's own node in the local demo, as for every node of ``polis demo``.
DEMO_CPU_THREADS = 1


def no_limits() -> dict[str, float | int | None]:
    """Every limit field set to ``None`` (no limit)."""
    return {name: None for name in LIMIT_FIELDS}


@dataclass(frozen=True)
class AppSettings:
    """Everything the user sets in the app. Validate with :meth:`validated`."""

    #: one of SWARM_MODES.
    swarm_mode: str = "lan"
    #: coordinator URL (http/https/ws/wss), used when ``swarm_mode == "coordinator"``.
    coordinator_url: str = ""
    #: limit name (see engine.control_protocol.LIMIT_FIELDS) -> value, ``None`` = no limit.
    limits: dict[str, float | int | None] = field(default_factory=no_limits)
    #: contribute only while nobody uses the computer.
    run_only_when_idle: bool = False
    #: minutes without keyboard/mouse input after which the computer counts as idle.
    idle_after_min: float = 5.0
    #: contribute only on AC power: pause when the computer switches to battery.
    run_only_on_ac_power: bool = False
    #: generate only, no training: the node holds its stage without optimiser state, serves
    #: generation and follows its stage leader's weights (``polis node --inference-only``).
    generate_only: bool = False
    #: open Polis (minimised to the tray) and start contributing when the user logs in.
    start_at_login: bool = False
    #: the user accepted the first-run explanation of what Polis does to the machine.
    consent_given: bool = False
    #: the one-time "Polis keeps running in the tray" notice was shown.
    tray_notice_shown: bool = False

    def validated(self) -> "AppSettings":
        """Return a clean copy or raise ``ValueError`` naming the bad field."""
        if self.swarm_mode not in SWARM_MODES:
            raise ValueError(f"swarm_mode must be one of {', '.join(SWARM_MODES)}, got {self.swarm_mode!r}")
        url = self.coordinator_url.strip()
        if self.swarm_mode == "coordinator" or url:
            check_coordinator_url(url)
        try:
            limits = {**no_limits(), **validate_limits(self.limits)}
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None
        if not 1.0 <= float(self.idle_after_min) <= 240.0:
            raise ValueError("idle_after_min must be between 1 and 240 minutes")
        return replace(self, coordinator_url=url, limits=limits, idle_after_min=float(self.idle_after_min))


def check_coordinator_url(url: str) -> None:
    """Raise ``ValueError`` with a plain-words reason when ``url`` is not a usable coordinator URL."""
    if not url:
        raise ValueError("Enter the coordinator URL, e.g. https://swarm.example.org")
    parts = urlsplit(url)
    if parts.scheme not in _URL_SCHEMES:
        raise ValueError(f"The coordinator URL must start with {', '.join(s + '://' for s in _URL_SCHEMES)}")
    if not parts.hostname:
        raise ValueError("The coordinator URL has no host name")
    try:
        _ = parts.port  # raises on a malformed port
    except ValueError:
        raise ValueError("The coordinator URL has an invalid port") from None


def node_arguments(settings: AppSettings) -> list[str]:
    """The ``polis node`` arguments (after ``--control stdio``) for these settings.

    Swarm: ``--lan`` | ``--coordinator URL`` | ``--demo``; limits: one flag per set
    limit (``--upload-mbps 20``), see ``engine.control_protocol.limits_to_cli_args``
    (the demo runs with ``--cpu-threads 1`` unless the user set a thread limit);
    ``--inference-only`` when ``generate_only`` is set.
    """
    settings = settings.validated()
    if settings.swarm_mode == "coordinator":
        swarm = ["--coordinator", settings.coordinator_url]
    else:
        swarm = ["--" + settings.swarm_mode]
    role = ["--inference-only"] if settings.generate_only else []
    limits = dict(settings.limits)
    if settings.swarm_mode == "demo" and limits.get("cpu_threads") is None:
        limits["cpu_threads"] = DEMO_CPU_THREADS  # the demo's recipe: every node computes with one thread
    return swarm + role + limits_to_cli_args(limits)


# -- persistence -----------------------------------------------------------------------

def open_qsettings() -> QSettings:
    """The app's settings store (INI format, per user). Tests redirect it with ``QSettings.setPath``."""
    return QSettings(QSettings.Format.IniFormat, QSettings.Scope.UserScope, ORGANIZATION, APPLICATION)


def _to_bool(value: Any, default: bool) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes"):
        return True
    if isinstance(value, str) and value.lower() in ("false", "0", "no"):
        return False
    return default


def _limit_value(name: str, raw: Any) -> float | int | None:
    if raw in (None, "", "none"):
        return None
    kind = LIMIT_FIELDS[name][0]
    return kind(float(raw)) if kind is int else kind(raw)


def load_settings(store: QSettings) -> AppSettings:
    """Read settings; a missing or corrupt value falls back to its default (logged, never fatal)."""
    defaults = AppSettings()
    values: dict[str, Any] = {}
    values["swarm_mode"] = str(store.value("swarm/mode", defaults.swarm_mode))
    values["coordinator_url"] = str(store.value("swarm/coordinator_url", defaults.coordinator_url) or "")
    limits = no_limits()
    for name in LIMIT_FIELDS:
        try:
            limits[name] = _limit_value(name, store.value(f"limits/{name}", None))
        except (TypeError, ValueError):
            log.warning("ignoring unreadable stored limit %s", name)
    values["limits"] = limits
    values["idle_after_min"] = store.value("schedule/idle_after_min", defaults.idle_after_min)
    for key, attr in (("schedule/only_when_idle", "run_only_when_idle"),
                      ("schedule/only_on_ac_power", "run_only_on_ac_power"),
                      ("swarm/generate_only", "generate_only"),
                      ("system/start_at_login", "start_at_login"),
                      ("first_run/consent_given", "consent_given"),
                      ("first_run/tray_notice_shown", "tray_notice_shown")):
        values[attr] = _to_bool(store.value(key, getattr(defaults, attr)), getattr(defaults, attr))
    try:
        values["idle_after_min"] = float(values["idle_after_min"])
    except (TypeError, ValueError):
        values["idle_after_min"] = defaults.idle_after_min
    settings = AppSettings(**values)
    try:
        return settings.validated()
    except ValueError as exc:
        log.warning("stored settings are invalid (%s); repairing them field by field", exc)
        return _repair(settings)


def _repair(settings: AppSettings) -> AppSettings:
    defaults = AppSettings()
    for f in fields(AppSettings):
        try:
            settings.validated()
            break
        except ValueError:
            settings = replace(settings, **{f.name: getattr(defaults, f.name)})
    try:
        return settings.validated()
    except ValueError:
        return defaults


def save_settings(store: QSettings, settings: AppSettings) -> None:
    """Validate and write ``settings`` (raises ``ValueError`` before writing anything if invalid)."""
    settings = settings.validated()
    store.setValue("swarm/mode", settings.swarm_mode)
    store.setValue("swarm/coordinator_url", settings.coordinator_url)
    store.setValue("swarm/generate_only", settings.generate_only)
    for name in LIMIT_FIELDS:
        value = settings.limits.get(name)
        store.setValue(f"limits/{name}", "" if value is None else value)
    store.setValue("schedule/only_when_idle", settings.run_only_when_idle)
    store.setValue("schedule/idle_after_min", settings.idle_after_min)
    store.setValue("schedule/only_on_ac_power", settings.run_only_on_ac_power)
    store.setValue("system/start_at_login", settings.start_at_login)
    store.setValue("first_run/consent_given", settings.consent_given)
    store.setValue("first_run/tray_notice_shown", settings.tray_notice_shown)
    store.sync()
