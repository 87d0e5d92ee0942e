"""The node control protocol: JSON lines between the GUI (or any supervisor) and ``polis node``.

``polis node --control stdio`` reads one JSON object per line on stdin (commands)
and writes one JSON object per line on stdout (events). Logs go to stderr, never
stdout, so the event stream stays parseable. Every line is validated here on
both sides; an invalid line is reported (``error`` event / ``ProtocolError``) and
skipped, never fatal. This module knows the message shapes only — not Qt, not
sockets, not what a node does with a command.

Commands (supervisor -> node), each ``{"cmd": NAME, ...}``:

``start``       begin (or resume) contributing.
``pause``       stop taking new work; finish or hand back what is in flight.
``stop``        leave the swarm cleanly and exit (exit code 0).
``set_limits``  ``{"limits": {...}}`` — any subset of :data:`LIMIT_FIELDS`.
``status``      ask for an immediate ``status`` event.

Events (node -> supervisor), each ``{"event": NAME, "t": unix_seconds, ...}``:

``hello``    once at start: ``version``, ``peer_id``, ``fingerprint``, ``key_storage``
             (``"keyring"`` | ``"file"``), ``device`` (words), ``backend``,
             ``memory_gb`` (device memory or ``null``).
``state``    ``state`` in :data:`STATES`, ``detail`` (words for the user).
``status``   ``state``, ``coordinator`` (URL or null), ``stage`` (index or null),
             ``num_stages``, ``layers`` (e.g. ``"layers 1-2 of 4"``), ``role``
             (``"trainer"`` | ``"inference"``), ``peers`` (int), ``policy_version``,
             ``limits`` (the limits in force).
``stats``    cumulative for this session: ``tokens_generated``, ``microbatches_trained``,
             ``bytes_sent``, ``bytes_received``, ``uptime_s``, ``points``,
             ``policy_version``, ``staleness_mean``, ``tokens_per_s`` (recent rate).
``swarm``    swarm-wide: ``policy_version``, ``eval`` (list of ``{"version", "accuracy"}``),
             ``reward`` (list of ``{"version", "reward"}``), ``stages`` (list of
             ``{"stage", "layers", "replicas", "mine"}``).
``log``      ``level``, ``message`` (user-facing log lines; the full log is stderr).
``error``    ``message`` (what happened), ``hint`` (what to do next), ``fatal`` (bool).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Mapping

#: longest line either side accepts (bytes); longer lines are rejected unread.
MAX_LINE_BYTES = 256 * 1024

COMMANDS = ("start", "pause", "stop", "set_limits", "status")
EVENTS = ("hello", "state", "status", "stats", "swarm", "log", "error")
STATES = ("idle", "connecting", "loading", "contributing", "paused", "stopping", "error")

#: limit name -> (type, minimum, maximum, meaning). ``None`` (JSON null) means "no limit".
LIMIT_FIELDS: dict[str, tuple[type, float, float, str]] = {
    "memory_cap_gb": (float, 0.25, 4096.0, "most device/host memory the stage may use"),
    "cpu_threads": (int, 1, 1024, "compute threads for the backend"),
    "gpu_fraction": (float, 0.05, 1.0, "fraction of GPU memory/compute to use"),
    "upload_mbps": (float, 0.1, 100000.0, "upload bandwidth cap, megabits per second"),
    "download_mbps": (float, 0.1, 100000.0, "download bandwidth cap, megabits per second"),
}


class ProtocolError(ValueError):
    """A control line that is not valid JSON or not a valid command/event."""


def validate_limits(limits: Any) -> dict[str, float | int | None]:
    """Return a clean copy of ``limits`` or raise :class:`ProtocolError` naming the bad field."""
    if not isinstance(limits, Mapping):
        raise ProtocolError("limits must be an object")
    clean: dict[str, float | int | None] = {}
    for name, value in limits.items():
        if name not in LIMIT_FIELDS:
            raise ProtocolError(f"unknown limit '{name}' (known: {', '.join(LIMIT_FIELDS)})")
        kind, low, high, _ = LIMIT_FIELDS[name]
        if value is None:
            clean[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"limit '{name}' must be a number or null, got {type(value).__name__}")
        if kind is int and value != int(value):
            raise ProtocolError(f"limit '{name}' must be a whole number")
        if not math.isfinite(value) or not low <= value <= high:
            raise ProtocolError(f"limit '{name}' = {value} is outside [{low}, {high}]")
        clean[name] = kind(value)
    return clean


def _decode_line(line: str | bytes) -> dict[str, Any]:
    if isinstance(line, bytes):
        if len(line) > MAX_LINE_BYTES:
            raise ProtocolError(f"line of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"line is not UTF-8: {exc}") from None
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"line of {len(line)} characters exceeds {MAX_LINE_BYTES}")
    try:
        message = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"not JSON: {exc.msg}") from None
    if not isinstance(message, dict):
        raise ProtocolError("a line must hold a JSON object")
    return message


def parse_command(line: str | bytes) -> dict[str, Any]:
    """Validate one command line (node side)."""
    message = _decode_line(line)
    cmd = message.get("cmd")
    if cmd not in COMMANDS:
        raise ProtocolError(f"unknown command {cmd!r} (known: {', '.join(COMMANDS)})")
    if cmd == "set_limits":
        message["limits"] = validate_limits(message.get("limits"))
    return message


def parse_event(line: str | bytes) -> dict[str, Any]:
    """Validate one event line (supervisor side). Unknown extra keys are kept."""
    message = _decode_line(line)
    event = message.get("event")
    if event not in EVENTS:
        raise ProtocolError(f"unknown event {event!r}")
    if event in ("state", "status") and message.get("state") not in STATES:
        raise ProtocolError(f"unknown state {message.get('state')!r}")
    if event == "error" and not isinstance(message.get("message"), str):
        raise ProtocolError("error event without a message")
    return message


def encode_command(cmd: str, **fields: Any) -> str:
    """One command as a line (with the trailing newline)."""
    if cmd not in COMMANDS:
        raise ProtocolError(f"unknown command {cmd!r}")
    if cmd == "set_limits":
        fields["limits"] = validate_limits(fields.get("limits", {}))
    return json.dumps({"cmd": cmd, **fields}, separators=(",", ":")) + "\n"


def encode_event(event: str, **fields: Any) -> str:
    """One event as a line (with the trailing newline); adds the timestamp ``t``."""
    if event not in EVENTS:
        raise ProtocolError(f"unknown event {event!r}")
    return json.dumps({"event": event, "t": round(time.time(), 3), **fields},
                      separators=(",", ":"), allow_nan=False) + "\n"


# -- limits on the node's command line ------------------------------------------------
# A supervisor passes the limits in force at start as ``--memory-cap-gb 8`` style flags
# (one per field of LIMIT_FIELDS, name with dashes; absent = no limit) and changes them
# later with ``set_limits``. The node builds its parser with add_limit_arguments().


def limit_cli_flag(name: str) -> str:
    """The command-line flag for one limit field, e.g. ``upload_mbps`` -> ``--upload-mbps``."""
    if name not in LIMIT_FIELDS:
        raise ProtocolError(f"unknown limit '{name}'")
    return "--" + name.replace("_", "-")


def limits_to_cli_args(limits: Mapping[str, Any]) -> list[str]:
    """Validated ``limits`` as command-line flags; ``None`` (no limit) is left out."""
    args: list[str] = []
    for name, value in validate_limits(limits).items():
        if value is not None:
            args += [limit_cli_flag(name), str(value)]
    return args


def add_limit_arguments(parser: Any) -> None:
    """Add one optional flag per limit field to an ``argparse`` parser (default: no limit)."""
    for name, (kind, low, high, meaning) in LIMIT_FIELDS.items():
        parser.add_argument(limit_cli_flag(name), dest=name, type=kind, default=None,
                            help=f"{meaning} [{low}..{high}] (default: no limit)")


def limits_from_args(args: Any) -> dict[str, float | int | None]:
    """The limits parsed by :func:`add_limit_arguments`, validated (raises ProtocolError)."""
    return validate_limits({name: getattr(args, name, None) for name in LIMIT_FIELDS})
