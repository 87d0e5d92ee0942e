"""Tools a model may call, and the one tool-call format: a tagged JSON object in its text.

Format (what the model writes; any chat template can carry it, it is plain text)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>

At most ``ToolCallFormat.max_calls`` calls per turn, each at most ``max_call_bytes`` of JSON;
the object has exactly the keys ``name`` (a string) and ``arguments`` (an object). The answer
goes back as the content of a ``tool`` message (see ``engine.envs.tool_env``). Anything
malformed (an unclosed tag, bad JSON, an unknown tool, a missing or mistyped argument) is
reported as an error string for the model, never raised.

Tools: ``CalculatorTool`` (``engine.envs.calculator``) and ``PythonTool``
(``engine.envs.sandbox``). What this module does not know: episodes, rewards, tokens.
"""

from __future__ import annotations

import json
import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping, Sequence

from engine.envs.calculator import CalculatorError, CalculatorLimits, evaluate, format_value
from engine.envs.sandbox import Sandbox, SandboxLimits

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)


@dataclass(frozen=True)
class ToolCallFormat:
    """Size caps of the tagged-JSON format.

    Fields:
      max_calls: calls honoured per model turn (more is a malformed turn).
      max_call_bytes: largest JSON object of one call, UTF-8 bytes.
      max_result_chars: a tool's answer is cut to this many characters, with a marker.
    """

    max_calls: int = 2
    max_call_bytes: int = 8192
    max_result_chars: int = 4000


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's name and its (JSON) arguments."""

    name: str
    arguments: Mapping[str, object]


@dataclass(frozen=True)
class ParsedTurn:
    """What a model turn asked for: the calls, or the reason the turn's calls are malformed."""

    calls: tuple[ToolCall, ...]
    error: str | None

    @property
    def has_calls(self) -> bool:
        return bool(self.calls) or self.error is not None


def parse_tool_calls(text: str, fmt: ToolCallFormat = ToolCallFormat()) -> ParsedTurn:
    """Parse every ``<tool_call>`` of a model turn; never raises."""
    opened = text.count(OPEN_TAG)
    if opened == 0:
        return ParsedTurn((), None)
    bodies = _CALL_RE.findall(text)
    if len(bodies) != opened or text.count(CLOSE_TAG) != opened:
        return ParsedTurn((), f"error: every {OPEN_TAG} needs a matching {CLOSE_TAG}")
    if len(bodies) > fmt.max_calls:
        return ParsedTurn((), f"error: at most {fmt.max_calls} tool calls per turn, got {len(bodies)}")
    calls = []
    for body in bodies:
        if len(body.encode("utf-8", errors="replace")) > fmt.max_call_bytes:
            return ParsedTurn((), f"error: a tool call is longer than {fmt.max_call_bytes} bytes")
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return ParsedTurn((), 'error: a tool call must be JSON: {"name": ..., "arguments": {...}}')
        if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
            return ParsedTurn((), 'error: a tool call must have exactly the keys "name" and "arguments"')
        if not isinstance(obj["name"], str) or not isinstance(obj["arguments"], dict):
            return ParsedTurn((), 'error: "name" must be a string and "arguments" an object')
        calls.append(ToolCall(obj["name"], obj["arguments"]))
    return ParsedTurn(tuple(calls), None)


def format_tool_call(name: str, arguments: Mapping[str, object]) -> str:
    """The text of a call in the documented format (for prompts, tests and SFT data)."""
    return f"{OPEN_TAG}{json.dumps({'name': name, 'arguments': dict(arguments)}, ensure_ascii=False)}{CLOSE_TAG}"


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer: ``ok`` is False for any error (the text then says why)."""

    ok: bool
    text: str
    seconds: float
    limit: str | None = None  #: the sandbox limit that ended a python run, if one did


class Tool(ABC):
    """A named function of string arguments that answers with text."""

    name: str = ""
    description: str = ""
    #: argument name -> one-line description (every argument is a required string)
    parameters: Mapping[str, str] = {}

    def call(self, arguments: Mapping[str, object], *, time_left_s: float) -> ToolResult:
        """Check the arguments, run, time it; never raises."""
        start = time.monotonic()
        missing = [p for p in self.parameters if p not in arguments]
        extra = [a for a in arguments if a not in self.parameters]
        if missing or extra:
            want = ", ".join(f'"{p}"' for p in self.parameters)
            return ToolResult(False, f"error: {self.name} takes the arguments {want}", 0.0)
        if any(not isinstance(arguments[p], str) for p in self.parameters):
            return ToolResult(False, f"error: every argument of {self.name} is a string", 0.0)
        try:
            ok, text, limit = self._run({p: str(arguments[p]) for p in self.parameters}, time_left_s)
        except Exception as e:  # a tool bug is an error observation, not a crashed episode
            ok, text, limit = False, f"error: {self.name} failed: {type(e).__name__}", None
        return ToolResult(ok, text, time.monotonic() - start, limit)

    @abstractmethod
    def _run(self, arguments: Mapping[str, str], time_left_s: float) -> tuple[bool, str, str | None]:
        """(ok, text, limit) for checked arguments."""

    def signature(self) -> str:
        """One line for a system prompt."""
        args = ", ".join(f'"{p}": {d}' for p, d in self.parameters.items())
        return f"{self.name}: {self.description} Arguments: {{{args}}}"


class CalculatorTool(Tool):
    """Exact arithmetic (``engine.envs.calculator``)."""

    name = "calculator"
    description = "exact arithmetic on integers and fractions with + - * / // % ** and parentheses."
    parameters = {"expression": "the expression, e.g. \"(1234 + 5) * 678\""}

    def __init__(self, limits: CalculatorLimits = CalculatorLimits()) -> None:
        self.limits = limits

    def _run(self, arguments: Mapping[str, str], time_left_s: float) -> tuple[bool, str, str | None]:
        try:
            return True, format_value(evaluate(arguments["expression"], self.limits)), None
        except CalculatorError as e:
            return False, f"error: {e}", None


class PythonTool(Tool):
    """A Python snippet in the sandbox; its output (capped) is the answer."""

    name = "python"
    description = ("runs a Python 3 snippet (standard library only, no network, no files kept) "
                   "and returns what it prints.")
    parameters = {"code": "the program text"}

    def __init__(self, sandbox: Sandbox | None = None, limits: SandboxLimits | None = None) -> None:
        self.sandbox = sandbox or Sandbox(limits)

    def _run(self, arguments: Mapping[str, str], time_left_s: float) -> tuple[bool, str, str | None]:
        result = self.sandbox.run(arguments["code"], wall_s=time_left_s)
        if result.ok:
            return True, result.output, None
        text = result.output if result.limit not in ("isolation", "code_bytes") else ""
        if text and not text.endswith("\n"):
            text += "\n"
        return False, f"{text}error: {result.describe()}", result.limit


def cap_text(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` with a marker saying so."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[truncated: the tool answer was longer than {max_chars} characters]"


def tool_table(tools: Sequence[Tool]) -> dict[str, Tool]:
    """Name -> tool; duplicate names are a configuration error."""
    table: dict[str, Tool] = {}
    for tool in tools:
        if tool.name in table:
            raise ValueError(f"two tools are named {tool.name!r}")
        table[tool.name] = tool
    return table
