"""The node control protocol: JSON lines between the GUI (or any supervisor) and ``polis node``.

``polis node --control stdio`` reads one JSON object per line on stdin (commands)
and writes one JSON object per line on stdout (events). Logs go to stderr, never
stdout, so the event stream stays parseable. Every line is validated here on
both sides; an invalid line is reported (``error`` event / ``ProtocolError``) and
skipped, never fatal. Every command and event is a typed struct (msgspec, see
``engine.net.wire``): bounded fields, unknown keys refused, NaN/inf refused, on the
encoding side too, so a node that emits a field this module does not know fails in
its own tests instead of in the GUI. ``parse_command``/``parse_event`` return plain
maps (what the GUI and the node handle); ``decode_command``/``decode_event`` return
the structs. This module knows the message shapes only — not Qt, not sockets, not
what a node does with a command.

Commands (supervisor -> node), each ``{"cmd": NAME, ...}``:

``start``       begin (or resume) contributing.
``pause``       hold: leave the swarm but keep the process and its loaded stage (the app uses it
                for schedule holds, shown as "Waiting"; its Pause button sends ``stop``).
``stop``        leave the swarm cleanly and exit (exit code 0).
``set_limits``  ``{"limits": {...}}`` — any subset of :data:`LIMIT_FIELDS`.
``status``      ask for an immediate ``status`` event.
``export``      ``{"out": FOLDER}`` (optional ``version``) — the owner of a local demo swarm (``polis node
                --demo``) writes that run's policy as an HF checkpoint with a model card into FOLDER
                (``polis export``); answered by an ``exported`` event, or an ``error`` event.

Events (node -> supervisor), each ``{"event": NAME, "t": unix_seconds, ...}``:

``hello``    once at start: ``version``, ``peer_id``, ``fingerprint``, ``key_storage``
             (``"keyring"`` | ``"file"``), ``key_storage_note`` (optional words),
             ``device`` (words), ``backend``, ``memory_gb`` (device memory or ``null``).
``state``    ``state`` in :data:`STATES`, ``detail`` (words for the user).
``status``   ``state``, ``coordinator`` (URL or null), ``stage`` (index or null),
             ``num_stages``, ``layers`` (e.g. ``"layers 1-2 of 4"``), ``role``
             (``"trainer"`` | ``"inference"``), ``peers`` (int), ``policy_version``,
             ``limits`` (the limits in force).
``stats``    cumulative for this session: ``tokens_generated``, ``microbatches_trained``,
             ``bytes_sent``, ``bytes_received``, ``uptime_s``, ``points``,
             ``policy_version``, ``staleness_mean``, ``tokens_per_s`` (recent rate),
             ``compute_busy_fraction`` (optional: share of wall time the compute thread worked).
``swarm``    swarm-wide: ``policy_version``, ``eval`` (list of ``{"version", "accuracy"}``, with
             ``content`` for a chat task), ``reward`` (list of ``{"version", "reward"}``), ``stages``
             (list of ``{"stage", "layers", "replicas", "mine"}``); optional: ``model`` (name),
             ``model_parameters``, ``task``, ``samples`` (the latest scored completions, list of
             ``{"prompt", "answer", "reward", "version"}``, newest last), ``credit`` (what the
             coordinator credits this node with in this run: work it observed or verified,
             ``{"tokens_generated", "microbatches_trained", "microbatches_forward", "steps_applied"}``;
             the ``stats`` counters are the node's own count).
``log``      ``level``, ``message`` (user-facing log lines; the full log is stderr).
``error``    ``message`` (what happened), ``hint`` (what to do next), ``fatal`` (bool).
``exported`` ``path`` (the folder written), ``version`` (the policy version in it), ``model`` (name, optional).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Mapping, Union

import msgspec
from msgspec import UNSET, Meta, UnsetType

from engine.net.wire import FLOAT_MAX, unbounded_float_fields

#: longest line either side accepts (bytes); longer lines are rejected unread.
MAX_LINE_BYTES = 256 * 1024

COMMANDS = ("start", "pause", "stop", "set_limits", "status", "export")
EVENTS = ("hello", "state", "status", "stats", "swarm", "log", "error", "exported")
STATES = ("idle", "connecting", "loading", "contributing", "paused", "stopping", "error")

class ProtocolError(ValueError):
    """A control line that is not valid JSON or not a valid command/event."""


class _Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Base of the control structs (unknown keys refused)."""


class Limits(_Strict, frozen=True):
    """Any subset of the node's resource limits: a field left out is UNSET ("unchanged"),
    null means "no limit". The one definition of the limits; :data:`LIMIT_FIELDS` is read from it."""

    memory_cap_gb: Annotated[float, Meta(ge=0.25, le=4096.0, description="most device/host memory the stage may use")
                             ] | None | UnsetType = UNSET
    cpu_threads: Annotated[int, Meta(ge=1, le=1024, description="compute threads for the backend")
                           ] | None | UnsetType = UNSET
    gpu_fraction: Annotated[float, Meta(ge=0.05, le=1.0, description="fraction of GPU memory/compute to use")
                            ] | None | UnsetType = UNSET
    upload_mbps: Annotated[float, Meta(ge=0.1, le=100000.0, description="upload bandwidth cap, megabits per second")
                           ] | None | UnsetType = UNSET
    download_mbps: Annotated[float, Meta(ge=0.1, le=100000.0,
                                         description="download bandwidth cap, megabits per second")
                             ] | None | UnsetType = UNSET


def _limit_fields() -> dict[str, tuple[type, float, float, str]]:
    mi = msgspec.inspect
    info = mi.type_info(Limits)
    assert isinstance(info, mi.StructType)
    out: dict[str, tuple[type, float, float, str]] = {}
    for f in info.fields:
        assert isinstance(f.type, mi.UnionType)
        meta = next(t for t in f.type.types if isinstance(t, mi.Metadata))
        number = meta.type
        assert isinstance(number, (mi.IntType, mi.FloatType)) and number.ge is not None and number.le is not None
        description = (meta.extra_json_schema or {})["description"]
        out[f.name] = (int if isinstance(number, mi.IntType) else float, number.ge, number.le, description)
    return out


#: limit name -> (type, minimum, maximum, meaning). ``None`` (JSON null) means "no limit".
LIMIT_FIELDS: dict[str, tuple[type, float, float, str]] = _limit_fields()

Text = Annotated[str, Meta(max_length=1000)]
Name = Annotated[str, Meta(max_length=200)]
#: a non-negative figure; ints stay ints on the wire (the GUI shows them as sent)
Count = Union[Annotated[int, Meta(ge=0, le=10**18)], Annotated[float, Meta(ge=0.0, le=1e18)]]
Version = Annotated[int, Meta(ge=0, le=1 << 40)]
State = Literal["idle", "connecting", "loading", "contributing", "paused", "stopping", "error"]


# ---------------------------------------------------------------- commands (supervisor -> node)
class _Command(_Strict, frozen=True, tag_field="cmd"):
    """A command line: ``{"cmd": NAME, ...}``."""


class Start(_Command, frozen=True, tag="start"):
    """Begin (or resume) contributing."""


class Pause(_Command, frozen=True, tag="pause"):
    """Stop taking new work; finish or hand back what is in flight."""


class Stop(_Command, frozen=True, tag="stop"):
    """Leave the swarm cleanly and exit."""


class SetLimits(_Command, frozen=True, tag="set_limits"):
    limits: Limits = msgspec.field(default_factory=Limits)  # the limits to change


class Status(_Command, frozen=True, tag="status"):
    """Ask for an immediate status event."""


#: a folder path on the node's machine
FolderPath = Annotated[str, Meta(min_length=1, max_length=4096)]


class Export(_Command, frozen=True, tag="export"):
    """Write the local demo's policy as an HF checkpoint into ``out`` (an absent or empty folder)."""

    out: FolderPath  # the folder to write
    version: Version | None = None  # the policy version (None: the newest every stage has checkpointed)


Command = Union[Start, Pause, Stop, SetLimits, Status, Export]


# ---------------------------------------------------------------- events (node -> supervisor)
class _Event(_Strict, frozen=True, tag_field="event"):
    t: Annotated[float, Meta(ge=0.0, le=FLOAT_MAX)]  # unix seconds when the node wrote it


class Hello(_Event, frozen=True, tag="hello"):
    version: Name  # the node's software version
    peer_id: Name  # its identity
    fingerprint: Name  # its key fingerprint, for the user to compare
    key_storage: Literal["keyring", "file"]  # where the private key lives
    device: Name  # the compute device in words
    backend: Name  # the compute backend
    memory_gb: Annotated[float, Meta(ge=0.0, le=1e6)] | None  # device memory (None: unknown)
    key_storage_note: Text | UnsetType = UNSET  # words about the key storage, when it needs some


class StateEvent(_Event, frozen=True, tag="state"):
    state: State  # the node's state
    detail: Text = ""  # words for the user


class StatusEvent(_Event, frozen=True, tag="status"):
    state: State  # the node's state
    coordinator: Annotated[str, Meta(max_length=2048)] | None  # URL, or None while there is none
    stage: Annotated[int, Meta(ge=0, le=4096)] | None  # stage index served, if any
    num_stages: Annotated[int, Meta(ge=1, le=4096)] | None  # pipeline depth, if known
    layers: Name | None  # e.g. "layers 1-2 of 4"
    role: Literal["trainer", "inference"]  # what the node does
    peers: Annotated[int, Meta(ge=0, le=1 << 20)]  # open peer links
    policy_version: Version | None  # version of the weights it holds
    limits: Limits  # the limits in force


class Stats(_Event, frozen=True, tag="stats"):
    tokens_generated: Count  # cumulative this session
    microbatches_trained: Count  # cumulative this session
    bytes_sent: Count  # on peer links, this session
    bytes_received: Count  # on peer links, this session
    uptime_s: Count  # seconds since the node started
    points: Count  # contribution points this session
    policy_version: Version | None  # version of the weights it holds
    staleness_mean: Annotated[float, Meta(ge=0.0, le=1e9)] | None  # mean rollout staleness, versions
    tokens_per_s: Count  # recent generation rate
    compute_busy_fraction: Annotated[float, Meta(ge=0.0, le=1e3)] | UnsetType = UNSET  # compute thread busy share


class EvalPoint(_Strict, frozen=True):
    version: Version  # policy version evaluated
    accuracy: Annotated[float, Meta(ge=0.0, le=1.0)]  # held-out accuracy (a chat task: the strict score)
    content: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None  # a chat task: the content-only score


class TurnRow(_Strict, frozen=True):
    role: Literal["assistant", "tool", "user"]  # who wrote the turn (the model, a tool, the environment)
    text: Text  # the turn's text (capped)


class SampleRow(_Strict, frozen=True):
    prompt: Text  # the question as a person reads it (capped by the coordinator)
    answer: Text  # what the model wrote (capped); in an episode of several turns, its final turn
    reward: Annotated[float, Meta(ge=-1e6, le=1e6)]  # the reward the coordinator gave it
    version: Version  # the oldest policy version that wrote it
    turns: Annotated[list[TurnRow], Meta(max_length=16)] = []  # every turn after the question (multi-turn)
    tool_calls: Annotated[int, Meta(ge=0, le=1 << 20)] = 0  # tool calls the episode made


class MonitorRow(_Strict, frozen=True):
    """The coordinator's reward-hacking monitor (``engine.swarm.rollout_monitor``), in brief."""

    episodes: Annotated[int, Meta(ge=0, le=1 << 30)]  # training episodes it looked at
    mean_turns: Annotated[float, Meta(ge=0.0, le=1e6)]  # model turns per episode
    mean_tool_calls: Annotated[float, Meta(ge=0.0, le=1e6)]  # tool calls per episode
    commonest_share: Annotated[float, Meta(ge=0.0, le=1.0)]  # share of the commonest answer given
    gold_share: Annotated[float, Meta(ge=0.0, le=1.0)]  # share of the commonest gold answer
    turn_cut_share: Annotated[float, Meta(ge=0.0, le=1.0)]  # episodes cut by the turn limit
    suspicious: Annotated[list[Name], Meta(max_length=8)] = []  # the tells that are on


class RewardPoint(_Strict, frozen=True):
    version: Version  # policy version
    reward: Annotated[float, Meta(ge=-1e6, le=1e6)]  # mean rollout reward


class StageRow(_Strict, frozen=True):
    stage: Annotated[int, Meta(ge=0, le=4096)]  # stage index
    layers: Name  # e.g. "layers 1-2 of 4"
    replicas: Annotated[int, Meta(ge=0, le=1 << 20)]  # nodes serving it
    mine: bool  # this node serves it


class CreditRow(_Strict, frozen=True):
    """What the coordinator credits this node with in the run: work it observed or verified itself."""

    tokens_generated: Count  # tokens of generation results it accepted from routes through this node
    microbatches_trained: Count  # training micro-batches it saw complete on routes through this node
    microbatches_forward: Count  # forward-only (proximal) micro-batches likewise
    steps_applied: Count  # optimiser steps whose weights the stage's vote confirmed


class SwarmEvent(_Event, frozen=True, tag="swarm"):
    policy_version: Version  # the swarm's current version
    eval: Annotated[list[EvalPoint], Meta(max_length=10_000)]  # held-out accuracy curve
    reward: Annotated[list[RewardPoint], Meta(max_length=10_000)]  # reward curve
    stages: Annotated[list[StageRow], Meta(max_length=4096)]  # the pipeline
    # mean staleness (versions) of the rollouts in the swarm's last training step; None before one
    staleness_mean: Annotated[float, Meta(ge=0.0, le=1e9)] | None = None
    model: Name | None = None  # what is being trained, e.g. "smollm2-135m"
    model_parameters: Annotated[int, Meta(ge=0, le=1 << 50)] | None = None  # its size
    task: Name | None = None  # e.g. "reasoning_gym:chain_sum"
    samples: Annotated[list[SampleRow], Meta(max_length=16)] = []  # latest scored completions, newest last
    monitor: MonitorRow | None = None  # the reward-hacking monitor's figures (None: none yet)
    credit: CreditRow | None = None  # the coordinator's verified credit of this node (None: none known)


class LogEvent(_Event, frozen=True, tag="log"):
    level: Literal["debug", "info", "warning", "error", "critical"]  # severity
    message: Annotated[str, Meta(max_length=8000)]  # a user-facing log line


class ErrorEvent(_Event, frozen=True, tag="error"):
    message: Annotated[str, Meta(max_length=8000)]  # what happened
    hint: Annotated[str, Meta(max_length=4000)] = ""  # what to do next
    fatal: bool = False  # the node is exiting


class Exported(_Event, frozen=True, tag="exported"):
    path: FolderPath  # the folder written (config.json, safetensors, tokenizer, README.md model card)
    version: Version  # the policy version it holds
    model: Name | None = None  # the model's name, e.g. "smollm2-135m"


Event = Union[Hello, StateEvent, StatusEvent, Stats, SwarmEvent, LogEvent, ErrorEvent, Exported]

for _union in (Command, Event):
    if unbounded_float_fields(_union):  # the NaN/inf rule of engine.net.wire
        raise TypeError(f"unbounded float fields: {unbounded_float_fields(_union)}")
_COMMANDS = msgspec.json.Decoder(Command)
_EVENTS = msgspec.json.Decoder(Event)
_ENCODER = msgspec.json.Encoder()
_COMMAND_TYPES = {"start": Start, "pause": Pause, "stop": Stop, "set_limits": SetLimits, "status": Status,
                  "export": Export}
_EVENT_TYPES = {"hello": Hello, "state": StateEvent, "status": StatusEvent, "stats": Stats, "swarm": SwarmEvent,
                "log": LogEvent, "error": ErrorEvent, "exported": Exported}


def _error(exc: Exception) -> ProtocolError:
    return ProtocolError(str(exc)[:300])


def validate_limits(limits: Any) -> dict[str, float | int | None]:
    """Return a clean copy of ``limits`` or raise :class:`ProtocolError` naming the bad field."""
    if not isinstance(limits, Mapping):
        raise ProtocolError("limits must be an object")
    unknown = [name for name in limits if name not in LIMIT_FIELDS]
    if unknown:
        raise ProtocolError(f"unknown limit '{unknown[0]}' (known: {', '.join(LIMIT_FIELDS)})")
    try:
        return msgspec.to_builtins(msgspec.convert(dict(limits), Limits))
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"limit {exc}") from None


def _check_line(line: str | bytes) -> str | bytes:
    if len(line) > MAX_LINE_BYTES:
        unit = "bytes" if isinstance(line, bytes) else "characters"
        raise ProtocolError(f"line of {len(line)} {unit} exceeds {MAX_LINE_BYTES}")
    return line


def decode_command(line: str | bytes) -> Command:
    """One command line as its struct (node side); raises ProtocolError."""
    try:
        return _COMMANDS.decode(_check_line(line))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _error(exc) from None


def decode_event(line: str | bytes) -> Event:
    """One event line as its struct (supervisor side); raises ProtocolError."""
    try:
        return _EVENTS.decode(_check_line(line))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _error(exc) from None


def parse_command(line: str | bytes) -> dict[str, Any]:
    """Validate one command line (node side); the command as a plain map."""
    return msgspec.to_builtins(decode_command(line))


def parse_event(line: str | bytes) -> dict[str, Any]:
    """Validate one event line (supervisor side); the event as a plain map, numbers as sent."""
    decode_event(line)
    return msgspec.json.decode(line)


def encode_command(cmd: str, **fields: Any) -> str:
    """One command as a line (with the trailing newline); raises ProtocolError if invalid."""
    kind = _COMMAND_TYPES.get(cmd)
    if kind is None:
        raise ProtocolError(f"unknown command {cmd!r} (known: {', '.join(COMMANDS)})")
    if cmd == "set_limits":
        fields["limits"] = validate_limits(fields.get("limits", {}))
    try:
        message = msgspec.convert(fields, kind)
    except msgspec.ValidationError as exc:
        raise _error(exc) from None
    return _ENCODER.encode(message).decode("utf-8") + "\n"


def encode_event(event: str, **fields: Any) -> str:
    """One event as a line (with the trailing newline); adds the timestamp ``t``.

    The fields are validated like an inbound event (ProtocolError names the bad one).
    """
    kind = _EVENT_TYPES.get(event)
    if kind is None:
        raise ProtocolError(f"unknown event {event!r} (known: {', '.join(EVENTS)})")
    try:
        message = msgspec.convert({"t": round(time.time(), 3), **fields}, kind)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"{event} event: {exc}") from None
    return _ENCODER.encode(message).decode("utf-8") + "\n"


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
