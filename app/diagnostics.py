""""Export diagnostics…": a zip of logs, settings and versions, with every secret removed.

What goes in: ``versions.json`` (Polis, Python, OS, Qt and library versions, read
from package metadata without importing heavy libraries), ``settings.json`` (the
app settings with URLs stripped of credentials and query strings),
``identity.json`` (public facts only: peer id, public-key fingerprint, where the
key is stored, device), and the log lines and log files, passed through
:func:`redact`. Never included: private keys, tokens, passwords, the raw settings
file. This module knows nothing about widgets or the node process.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import re
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Iterable, Mapping

#: the hello-event fields that are public and useful for support.
PUBLIC_IDENTITY_FIELDS = ("version", "peer_id", "fingerprint", "key_storage", "device", "backend", "memory_gb")
#: at most this much of each log file goes into the zip (its end).
MAX_LOG_FILE_BYTES = 2_000_000
_PACKAGES = ("polis", "PySide6", "PySide6_Essentials", "pyqtgraph", "psutil", "torch", "mlx", "transformers",
             "aiortc", "zeroconf", "keyring", "numpy")

_PEM = re.compile(r"-----BEGIN [A-Z0-9 ]+-----.*?(-----END [A-Z0-9 ]+-----|\Z)", re.DOTALL)
_SECRET_ASSIGNMENT = re.compile(
    r"(?i)\b([\w.-]*(?:private[_ -]?key|secret|token|passw(?:or)?d|api[_-]?key|authorization|seed)[\w.-]*)"
    r"(\"?\s*[:=]\s*)(\"[^\"]*\"|'[^']*'|[^\s,;}]+)")
_SECRET_NAME = re.compile(r"(?i)private[_ -]?key|secret|token|passw(?:or)?d|api[_-]?key|authorization|seed")
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}")
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")
_URL_QUERY = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s?#\"']+)\?[^\s#\"']*")
_BLOB = re.compile(r"(?<![A-Za-z0-9+/_-])[A-Za-z0-9+/_-]{48,}={0,2}")


def redact(text: str) -> str:
    """Remove anything that looks like a secret: PEM blocks, ``token=...``-style assignments,
    bearer credentials, credentials and query strings in URLs, long base64/hex blobs."""
    text = _PEM.sub("[redacted key block]", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} [redacted]", text)
    text = _SECRET_ASSIGNMENT.sub(lambda m: f"{m.group(1)}{m.group(2)}[redacted]", text)
    text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}[redacted]@", text)
    text = _URL_QUERY.sub(lambda m: f"{m.group(1)}?[redacted]", text)
    return _BLOB.sub("[redacted blob]", text)


def versions() -> dict[str, Any]:
    """Versions of Polis, Python, the OS and the libraries that matter (metadata only)."""
    found: dict[str, Any] = {}
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        from PySide6 import QtCore

        found["Qt"] = QtCore.qVersion()
    except ImportError:
        pass
    return {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine(),
            "frozen": bool(getattr(sys, "frozen", False)), "packages": found}


def redact_data(value: Any) -> Any:
    """JSON-like data with secret-named keys blanked and every string passed through :func:`redact`."""
    if isinstance(value, Mapping):
        return {str(k): "[redacted]" if _SECRET_NAME.search(str(k)) else redact_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_data(v) for v in value]
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return redact(str(value))


def public_settings(settings: Any) -> dict[str, Any]:
    """Settings (a dataclass or mapping) as JSON-ready data, with secrets redacted."""
    data = dataclasses.asdict(settings) if dataclasses.is_dataclass(settings) else dict(settings)
    return redact_data(data)


def _tail(path: Path, max_bytes: int) -> str:
    with path.open("rb") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        fh.seek(max(0, size - max_bytes))
        data = fh.read()
    text = data.decode("utf-8", errors="replace")
    return text if size <= max_bytes else "[earlier lines omitted]\n" + text.split("\n", 1)[-1]


def export_diagnostics(destination: Path, *, settings: Any, hello: Mapping[str, Any] | None,
                       log_lines: Iterable[str], log_files: Iterable[Path] = ()) -> Path:
    """Write the diagnostics zip to ``destination`` and return its path."""
    destination = Path(destination)
    if destination.suffix.lower() != ".zip":
        destination = destination.with_suffix(".zip")
    identity = {k: (hello or {}).get(k) for k in PUBLIC_IDENTITY_FIELDS}
    with zipfile.ZipFile(destination, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("README.txt", "Polis diagnostics, written "
                         + time.strftime("%Y-%m-%d %H:%M:%S %z") + ".\nSecrets (keys, tokens, passwords, "
                         "URL credentials) were removed before writing.\n")
        archive.writestr("versions.json", json.dumps(versions(), indent=1))
        archive.writestr("settings.json", json.dumps(public_settings(settings), indent=1))
        archive.writestr("identity.json", json.dumps(redact_data(identity), indent=1))
        archive.writestr("gui-log.txt", redact("\n".join(log_lines)) + "\n")
        for path in log_files:
            path = Path(path)
            if path.is_file():
                archive.writestr(f"logs/{path.name}", redact(_tail(path, MAX_LOG_FILE_BYTES)))
    return destination
