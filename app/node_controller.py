"""Runs ``polis node --control stdio`` as a child process and turns its output into Qt signals.

Owns one ``QProcess``: launches it, writes JSON-lines commands to its stdin
(``engine.control_protocol``), reads events from stdout line by line (partial
lines are buffered, over-long or invalid lines are logged and skipped, never
fatal) and stderr (kept as a tail and appended to a log file). It tells a clean
exit from a crash (non-zero exit code or killed by a signal), stops cleanly
(``stop`` command, then terminate after ``stop_timeout_s``, then kill) and warns
when the node goes silent (after first asking a quiet node for its ``status``).
Everything is signal-driven; nothing here blocks the GUI thread. It knows
nothing about widgets or settings.
"""

from __future__ import annotations

import collections
import logging
import logging.handlers
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

from engine.control_protocol import MAX_LINE_BYTES, ProtocolError, encode_command, parse_event
from engine.self_command import polis_command

log = logging.getLogger(__name__)

#: environment variable holding a replacement node command (shell words), e.g. for tests.
NODE_COMMAND_ENV = "POLIS_NODE_COMMAND"
STDERR_TAIL_LINES = 400
LOG_FILE_MAX_BYTES = 5_000_000
LOG_FILE_BACKUPS = 2


def node_log_file(path: Path) -> logging.Logger:
    """A logger that writes the node's stderr to ``path`` as is (the lines carry their own time),
    rotated by ``RotatingFileHandler`` at :data:`LOG_FILE_MAX_BYTES`, keeping :data:`LOG_FILE_BACKUPS`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"{__name__}.node_output.{str(path.resolve()).replace('.', '_')}")
    if logger.handlers:  # one handler per file, however many controllers write to it
        return logger
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=LOG_FILE_MAX_BYTES, backupCount=LOG_FILE_BACKUPS,
                                                   encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    return logger


def default_node_command() -> list[str]:
    """The command that runs ``polis node`` (before ``--control stdio``)."""
    override = os.environ.get(NODE_COMMAND_ENV)
    if override:
        return shlex.split(override)
    return polis_command("node")


@dataclass(frozen=True)
class CrashReport:
    """How the node ended when nobody asked it to."""

    exit_code: int | None
    killed_by_signal: bool
    stderr_tail: tuple[str, ...]


class NodeController(QObject):
    """Start, pause, resume and stop the node process; every event arrives as a signal."""

    hello_received = Signal(dict)
    state_changed = Signal(str, str)  # node state (control_protocol.STATES), detail in words
    status_received = Signal(dict)
    stats_received = Signal(dict)
    swarm_received = Signal(dict)
    log_received = Signal(str, str)  # level, message
    error_received = Signal(dict)  # message, hint, fatal
    exported = Signal(dict)  # path, version, model: the local demo's model was written there
    stderr_line = Signal(str)
    running_changed = Signal(bool)
    stopped = Signal()  # the node exited after stop() (or on its own with exit code 0)
    crashed = Signal(object)  # CrashReport
    start_failed = Signal(str)  # the process could not be launched at all
    unresponsive = Signal(float)  # seconds without any output from a running node

    def __init__(self, node_command: list[str] | None = None, *, log_path: Path | None = None,
                 stop_timeout_s: float = 10.0, kill_timeout_s: float = 3.0, silence_warning_s: float = 120.0,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.node_command = list(node_command) if node_command else default_node_command()
        self.log_path = log_path
        self._log_file: logging.Logger | None = None
        self.stop_timeout_s = stop_timeout_s
        self.kill_timeout_s = kill_timeout_s
        self.silence_warning_s = silence_warning_s
        self.hello: dict[str, Any] | None = None
        self.node_state: str | None = None
        self.invalid_lines = 0
        self._process: QProcess | None = None
        self._generation = 0
        self._stop_requested = False
        self._forced = False
        self._pending_restart: list[str] | None = None
        self._stdout_buffer = bytearray()
        self._stderr_buffer = bytearray()
        self._discarding = False
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._last_output = time.monotonic()
        self._silence_reported = False
        self._status_probed = False
        self._watchdog = QTimer(self)
        self._watchdog.setInterval(max(250, int(silence_warning_s * 250)))
        self._watchdog.timeout.connect(self._check_silence)

    # -- public API -----------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._process is not None

    @property
    def is_stopping(self) -> bool:
        return self._process is not None and self._stop_requested

    @property
    def stderr_tail(self) -> list[str]:
        return list(self._stderr_tail)

    def full_command(self, arguments: list[str]) -> list[str]:
        return [*self.node_command, "--control", "stdio", *arguments]

    def start(self, arguments: list[str]) -> None:
        """Launch the node with these arguments (after ``--control stdio``) and tell it to start."""
        if self._process is not None:
            if self._stop_requested:
                self._pending_restart = list(arguments)
            else:
                self.resume()
            return
        command = self.full_command(arguments)
        self._generation += 1
        self._stop_requested = self._forced = False
        self._stdout_buffer.clear()
        self._stderr_buffer.clear()
        self._discarding = False
        self._stderr_tail.clear()
        self.hello, self.node_state = None, None
        process = QProcess(self)
        env = QProcessEnvironment.systemEnvironment()
        env.insert("PYTHONUNBUFFERED", "1")
        process.setProcessEnvironment(env)
        process.setProgram(command[0])
        process.setArguments(command[1:])
        process.readyReadStandardOutput.connect(self._read_stdout)
        process.readyReadStandardError.connect(self._read_stderr)
        process.errorOccurred.connect(self._on_error)
        process.finished.connect(self._on_finished)
        self._process = process
        self._append_log_file(f"--- starting node: {shlex.join(command)}", marker=True)
        log.info("starting node: %s", shlex.join(command))
        process.start()
        self._send("start")
        self._last_output = time.monotonic()
        self._silence_reported = False
        self._watchdog.start()
        self.running_changed.emit(True)

    def pause(self) -> None:
        """Ask the running node to stop taking work (it stays connected)."""
        self._send("pause")

    def resume(self) -> None:
        """Ask a paused node to contribute again."""
        self._send("start")

    def set_limits(self, limits: Mapping[str, Any]) -> None:
        """Send new limits to the running node (validated; raises ProtocolError on a bad value)."""
        self._send("set_limits", limits=dict(limits))

    def request_status(self) -> None:
        self._send("status")

    def export_model(self, out: str, version: int | None = None) -> None:
        """Ask the node (the owner of a local demo) to write its model into the folder ``out``;
        ``exported`` or ``error_received`` answers."""
        self._send("export", out=out, version=version)

    def stop(self) -> None:
        """Stop cleanly: ``stop`` command, terminate after ``stop_timeout_s``, kill after ``kill_timeout_s``."""
        self._pending_restart = None
        process = self._process
        if process is None or self._stop_requested:
            return
        self._stop_requested = True
        if process.state() == QProcess.ProcessState.NotRunning:
            return  # still launching or already ended: _on_error/_on_finished will clean up
        self._send("stop")
        process.closeWriteChannel()
        generation = self._generation
        QTimer.singleShot(int(self.stop_timeout_s * 1000), lambda: self._escalate(generation, kill=False))

    def restart(self, arguments: list[str]) -> None:
        """Stop the node if it runs, then start it again with ``arguments``."""
        if self._process is None:
            self.start(arguments)
            return
        self.stop()
        self._pending_restart = list(arguments)

    def kill_now(self) -> None:
        """Last resort at application exit: kill without waiting (the node gets no goodbye)."""
        if self._process is not None:
            self._stop_requested = self._forced = True
            self._process.kill()
            self._process.waitForFinished(2000)

    # -- process plumbing -----------------------------------------------------------------

    def _send(self, cmd: str, **fields: Any) -> None:
        process = self._process
        if process is None or (self._stop_requested and cmd != "stop"):
            log.debug("not sending %s: no running node", cmd)
            return
        line = encode_command(cmd, **fields)
        process.write(line.encode("utf-8"))

    def _escalate(self, generation: int, kill: bool) -> None:
        if generation != self._generation or self._process is None:
            return
        self._forced = True
        if kill:
            log.warning("node did not exit after terminate; killing it")
            self._process.kill()
        else:
            log.warning("node did not stop within %.0f s; terminating it", self.stop_timeout_s)
            self._process.terminate()
            QTimer.singleShot(int(self.kill_timeout_s * 1000), lambda: self._escalate(generation, kill=True))

    def _read_stdout(self) -> None:
        if self._process is None:
            return
        self._note_output()
        self._stdout_buffer += bytes(self._process.readAllStandardOutput().data())
        while True:
            newline = self._stdout_buffer.find(b"\n")
            if newline < 0:
                if len(self._stdout_buffer) > MAX_LINE_BYTES:
                    log.warning("node wrote a line longer than %d bytes; skipping it", MAX_LINE_BYTES)
                    self.invalid_lines += 1
                    self._stdout_buffer.clear()
                    self._discarding = True
                return
            line = bytes(self._stdout_buffer[:newline])
            del self._stdout_buffer[: newline + 1]
            if self._discarding:
                self._discarding = False
                continue
            if line.strip():
                self._dispatch(line)

    def _dispatch(self, line: bytes) -> None:
        try:
            event = parse_event(line)
        except ProtocolError as exc:
            self.invalid_lines += 1
            log.warning("ignoring invalid line from the node: %s", exc)
            return
        kind = event["event"]
        try:
            if kind == "hello":
                self.hello = event
                self.hello_received.emit(event)
            elif kind == "state":
                self.node_state = event["state"]
                self.state_changed.emit(event["state"], str(event.get("detail") or ""))
            elif kind == "status":
                if event["state"] != self.node_state:
                    self.node_state = event["state"]
                    self.state_changed.emit(event["state"], "")
                self.status_received.emit(event)
            elif kind == "stats":
                self.stats_received.emit(event)
            elif kind == "swarm":
                self.swarm_received.emit(event)
            elif kind == "log":
                self.log_received.emit(str(event.get("level") or "info"), str(event.get("message") or ""))
            elif kind == "error":
                self.error_received.emit(event)
            elif kind == "exported":
                self.exported.emit(event)
        except Exception:  # a slot failing on odd data must not stop the stream
            log.exception("error while handling a %s event from the node", kind)

    def _read_stderr(self) -> None:
        if self._process is None:
            return
        self._note_output()
        self._stderr_buffer += bytes(self._process.readAllStandardError().data())
        *lines, rest = self._stderr_buffer.split(b"\n")
        self._stderr_buffer = bytearray(rest[-MAX_LINE_BYTES:])
        for raw in lines:
            self._take_stderr_line(raw.decode("utf-8", errors="replace").rstrip("\r"))

    def _take_stderr_line(self, text: str) -> None:
        self._stderr_tail.append(text)
        self._append_log_file(text)
        self.stderr_line.emit(text)

    def _note_output(self) -> None:
        self._last_output = time.monotonic()
        self._silence_reported = False
        self._status_probed = False

    def _check_silence(self) -> None:
        if self._process is None or self._stop_requested or self._silence_reported:
            return
        silent_s = time.monotonic() - self._last_output
        if silent_s >= self.silence_warning_s / 2 and not self._status_probed:
            self._status_probed = True  # a quiet but healthy node (e.g. paused) answers this at once
            self.request_status()
        if silent_s >= self.silence_warning_s:
            self._silence_reported = True
            self.unresponsive.emit(silent_s)

    def _append_log_file(self, text: str, marker: bool = False) -> None:
        """One stderr line as is, or (``marker``) the controller's own note with a timestamp."""
        if self.log_path is None:
            return
        if self._log_file is None:
            try:
                self._log_file = node_log_file(self.log_path)
            except OSError as exc:
                log.debug("could not open node log %s: %s", self.log_path, exc)
                self.log_path = None
                return
        self._log_file.info("%s", time.strftime("%Y-%m-%d %H:%M:%S ") + text if marker else text)

    def _on_error(self, error: QProcess.ProcessError) -> None:
        process = self._process
        if process is None or error != QProcess.ProcessError.FailedToStart:
            return  # other errors are followed by finished()
        message = process.errorString()
        log.error("node failed to start: %s", message)
        self._finish_process()
        self.start_failed.emit(message)

    def _on_finished(self, exit_code: int, exit_status: QProcess.ExitStatus) -> None:
        process = self._process
        if process is None:
            return
        self._read_stdout()
        self._read_stderr()
        if self._stderr_buffer.strip():
            self._take_stderr_line(self._stderr_buffer.decode("utf-8", errors="replace"))
        self._stderr_buffer.clear()
        killed = exit_status == QProcess.ExitStatus.CrashExit
        expected = self._stop_requested or (exit_code == 0 and not killed)
        self._append_log_file(f"--- node exited (code {exit_code}{', killed' if killed else ''})", marker=True)
        pending = self._pending_restart
        self._finish_process()
        if expected:
            if self._forced:
                log.warning("node was forced to stop (exit code %s)", exit_code)
            self.stopped.emit()
            if pending is not None:
                self.start(pending)
        else:
            log.error("node crashed: exit code %s, killed=%s", exit_code, killed)
            self.crashed.emit(CrashReport(None if killed else exit_code, killed, tuple(self._stderr_tail)))

    def _finish_process(self) -> None:
        process = self._process
        self._process = None
        self._pending_restart = None
        self._generation += 1
        self._watchdog.stop()
        self.node_state = None
        if process is not None:
            process.deleteLater()
        self.running_changed.emit(False)
