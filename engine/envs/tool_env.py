"""A multi-turn environment with tools over a chat question source; the calculator env is one.

Each episode opens with a system turn that lists the tools and the call format
(``engine.envs.tools``), optionally a worked example exchange (a question, the model's call, the
tool's answer, the tagged final answer: a small model copies a pattern it has seen far more
readily than one it was told about), and the question as the user turn. A model turn with a
``<tool_call>`` gets the tools' answers as one ``tool`` message and another turn; a turn
without one is the final answer and ends the episode. Malformed calls, unknown tools and tool
errors are observations (counted as tool errors), never exceptions.

Reward parts (their sum is the reward; a cut episode earns 0, see ``engine.envs.contract``):
``answer`` and ``format`` are the question source's own scores of the final turn (the source
keeps format small and separate, so format alone never pays like a right answer);
``tool_use`` (``tool_use_weight``) is paid only together with a right answer and at least one
tool call that worked, so calling a tool without solving the question earns nothing.

The question source is anything with ``train_items(seed)``, ``eval_items()`` and
``score(item, completion) -> .parts`` over items with ``item_id``, ``question`` and ``answer``
(``QuestionSource``): the chat tasks of ``engine.rl.tasks`` (``reasoning_gym:basic_arithmetic``,
``reasoning_gym:chain_sum``) have that shape.

What it does not know: tokens, templates, models, how the reward becomes an advantage.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Protocol, Sequence

from engine.envs.contract import Environment, EpisodeItem, EpisodeState, Message
from engine.envs.tools import (
    CalculatorTool,
    Tool,
    ToolCallFormat,
    cap_text,
    format_tool_call,
    parse_tool_calls,
    tool_table,
)


class QuestionItem(Protocol):
    item_id: str
    question: str
    answer: str


class QuestionScore(Protocol):
    parts: Mapping[str, float]


class QuestionSource(Protocol):
    """What a tool environment asks of a task (``engine.rl.tasks`` chat tasks fit)."""

    def train_items(self, seed: int) -> Iterator[QuestionItem]: ...

    def eval_items(self) -> list[QuestionItem]: ...

    def score(self, item: QuestionItem, completion: str) -> QuestionScore: ...


def tool_system_prompt(tools: Sequence[Tool]) -> str:
    """The system turn: the tools, the call format with an example, how to answer."""
    first = tools[0]
    example = format_tool_call(first.name, {p: "..." for p in first.parameters})
    lines = ["You can use tools. To call one, write exactly one line:", example,
             "and wait for its answer. Tools:"]
    lines += [f"- {t.signature()}" for t in tools]
    lines.append("When you know the result, give only the final answer inside <answer></answer> tags, "
                 "with no tool call in that turn.")
    return "\n".join(lines)


class ToolEnvironment(Environment):
    """Questions from ``source``, answered with the help of ``tools``."""

    def __init__(self, source: QuestionSource, tools: Sequence[Tool], *, name: str = "tools",
                 call_format: ToolCallFormat = ToolCallFormat(), tool_use_weight: float = 0.05,
                 example: Sequence[Message] = ()) -> None:
        if not tools:
            raise ValueError("a tool environment needs at least one tool")
        if not 0.0 <= tool_use_weight <= 0.5:
            raise ValueError(f"tool_use_weight must be in [0, 0.5], got {tool_use_weight}")
        self.source = source
        self.tools = tool_table(tools)
        self.name = name
        self.call_format = call_format
        self.tool_use_weight = tool_use_weight
        self.system_prompt = tool_system_prompt(list(tools))
        if example and (example[0].role != "user" or example[-1].role != "assistant"):
            raise ValueError("a worked example opens with the user's question and ends with the model's answer")
        self.example = tuple(example)

    def _item(self, q: QuestionItem, held_out: bool) -> EpisodeItem:
        messages = (Message("system", self.system_prompt), *self.example, Message("user", q.question))
        return EpisodeItem(item_id=q.item_id, messages=messages, answer=q.answer, held_out=held_out, source=q)

    def train_items(self, seed: int) -> Iterator[EpisodeItem]:
        for q in self.source.train_items(seed):
            yield self._item(q, False)

    def eval_items(self) -> list[EpisodeItem]:
        return [self._item(q, True) for q in self.source.eval_items()]

    def respond(self, state: EpisodeState, model_text: str) -> Message | None:
        parsed = parse_tool_calls(model_text, self.call_format)
        if not parsed.has_calls:
            return None
        if parsed.error is not None:
            state.note_tool(0.0, ok=False)
            return Message("tool", parsed.error)
        answers = []
        for call in parsed.calls:
            tool = self.tools.get(call.name)
            if tool is None:
                state.note_tool(0.0, ok=False)
                answers.append(f"error: no tool named {call.name[:64]!r}; the tools are {', '.join(self.tools)}")
                continue
            result = tool.call(call.arguments, time_left_s=state.tool_s_left)
            state.note_tool(result.seconds, ok=result.ok)
            state.scratch["good_calls"] = state.scratch.get("good_calls", 0) + (1 if result.ok else 0)
            answers.append(cap_text(result.text, self.call_format.max_result_chars))
        text = answers[0] if len(answers) == 1 else "\n".join(f"[{i + 1}] {a}" for i, a in enumerate(answers))
        return Message("tool", text)

    def score(self, state: EpisodeState) -> Mapping[str, float]:
        final = state.messages[-1].content if state.messages[-1].role == "assistant" else ""
        parts = {k: float(v) for k, v in self.source.score(state.item.source, final).parts.items()}
        solved = parts.get("answer", 0.0) > 0.0
        parts["tool_use"] = self.tool_use_weight if solved and state.scratch.get("good_calls", 0) > 0 else 0.0
        return parts


#: the calculator environment's worked example (numbers no held-out sum uses: they have 3-4 digits each)
EXAMPLE_EXPRESSION = "12345 + 67890"


def calculator_example(tool: Tool) -> tuple[Message, ...]:
    """A worked exchange: a sum, the call, the calculator's own answer, the answer in tags."""
    result = tool.call({"expression": EXAMPLE_EXPRESSION}, time_left_s=1.0)
    return (Message("user", f"State the final answer to the following arithmetic problem: {EXAMPLE_EXPRESSION} ="),
            Message("assistant", format_tool_call(tool.name, {"expression": EXAMPLE_EXPRESSION})),
            Message("tool", result.text), Message("assistant", f"<answer>{result.text}</answer>"))


def calculator_environment(source: QuestionSource, *, worked_example: bool = False, **kwargs) -> ToolEnvironment:
    """The calculator tool environment over an arithmetic question source (with a worked example if asked)."""
    tool = CalculatorTool()
    example = calculator_example(tool) if worked_example else ()
    return ToolEnvironment(source, [tool], name="calculator", example=example, **kwargs)
