"""The one way Polis writes a file that must never be seen half-written.

``atomic_write_bytes(path, data)`` writes to a temporary file in the same directory,
flushes and fsyncs it, renames it over ``path`` (``os.replace``, atomic on POSIX and
Windows) and, on POSIX, fsyncs the directory so that the rename itself survives a
power cut. A crash at any point leaves either the old file or the new one, never a
mix; the temporary file is removed when anything fails. ``mode`` (e.g. ``0o600`` for a
secret; the umask may narrow it further) applies from the file's creation on.

It knows nothing about formats: callers serialise (JSON, safetensors bytes, a key)
and hand over bytes or text.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_text"]


def _fsync_directory(directory: Path) -> None:
    if sys.platform == "win32":  # directories cannot be opened for fsync there
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (e.g. certain network mounts) refuse; the rename is still atomic
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes | bytearray | memoryview, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically and durably (see the module docstring).

    Raises ``OSError`` (e.g. ``ENOSPC`` on a full disk) with ``path`` untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a leftover of a crashed writer: O_EXCL below then applies ``mode`` afresh
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def atomic_write_text(path: str | Path, text: str, *, mode: int = 0o644, encoding: str = "utf-8") -> None:
    """:func:`atomic_write_bytes` for text."""
    atomic_write_bytes(path, text.encode(encoding), mode=mode)
