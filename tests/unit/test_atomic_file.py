"""engine.atomic_file: a failed write leaves the old file whole; secrets get their mode from creation."""

import os
import stat
import sys

import pytest

from engine.atomic_file import atomic_write_bytes, atomic_write_text


def test_atomic_write_replaces_content_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "state.json"
    atomic_write_text(target, "old")
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    target = tmp_path / "weights.bin"
    atomic_write_bytes(target, b"good")

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="No space"):
        atomic_write_bytes(target, b"x" * 1000)
    monkeypatch.undo()
    assert target.read_bytes() == b"good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.bin"]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permission bits")
def test_secret_mode_applies_even_over_a_stale_world_readable_temporary(tmp_path):
    target = tmp_path / "key"
    stale = tmp_path / f".key.tmp{os.getpid()}"
    stale.write_text("stale")
    stale.chmod(0o666)
    atomic_write_text(target, "secret", mode=0o600)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.read_text() == "secret"
