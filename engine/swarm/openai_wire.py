"""OpenAI's chat-completions JSON as the coordinator's endpoint reads and writes it: typed and bounded.

``decode_request(body, max_tokens_cap=...)`` turns the bytes of a ``POST /v1/chat/completions``
into a :class:`ChatRequest` (msgspec: types and ranges checked in one pass) and then checks what
the types cannot say: a size cap on messages and characters, ``max_tokens`` within the run's
completion budget, and no feature the swarm cannot honour. A refused request raises
:class:`ApiError` with the HTTP status and OpenAI's error shape (``{"error": {"message", "type",
"param", "code"}}``). What is read:

* ``messages`` (``system``, ``developer`` — read as ``system`` —, ``user``, ``assistant``,
  ``tool``; content as text or a list of ``{"type": "text"}`` parts), ``model`` (any id: the
  swarm serves one model and answers with its own id), ``max_tokens`` /
  ``max_completion_tokens``, ``temperature``, ``top_p``, ``n``, ``stop``, ``seed``, ``stream`` and
  ``stream_options.include_usage``; other keys are ignored, as OpenAI-compatible servers do;
* refused with 400: tools and tool calls (the swarm has no tool-call parser: a model's tool
  call stays text), images and audio, ``logprobs``, ``logit_bias``, non-zero penalties and a
  ``response_format`` other than ``text``.

``completion_body`` and ``stream_events`` write the answer: a ``chat.completion`` object, or the
same completion as ``chat.completion.chunk`` server-sent events (one content delta per choice,
its ``finish_reason``, the usage when asked, ``[DONE]``). The swarm returns a job's tokens when
the job ends, so a stream carries the whole answer at once: it is accepted for clients that only
speak streams, not incremental. ``cut_at_stop`` applies ``stop`` strings to decoded text (the
pipeline stops on token ids only).

What it does not know: tokens, chat templates, jobs, HTTP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Iterator, Literal

import msgspec
from msgspec import Meta

#: most messages in one request
MAX_MESSAGES = 256
#: most characters summed over the messages' contents
MAX_MESSAGE_CHARS = 256 * 1024
#: most samples (``n``) of one request
MAX_N = 16
#: most ``stop`` strings, and characters of each
MAX_STOPS = 4
MAX_STOP_CHARS = 64

Text = Annotated[str, Meta(max_length=MAX_MESSAGE_CHARS)]


class ApiError(Exception):
    """A request the endpoint refuses: its HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message[:1000], "type": self.type, "param": self.param, "code": self.code}}


class ContentPart(msgspec.Struct, frozen=True):
    type: Annotated[str, Meta(max_length=64)]
    text: Text | None = None


class ChatMessage(msgspec.Struct, frozen=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[ContentPart], Meta(max_length=MAX_MESSAGES)] | None = None
    name: Annotated[str, Meta(max_length=256)] | None = None
    tool_calls: Annotated[list[Any], Meta(max_length=64)] | None = None
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class ResponseFormat(msgspec.Struct, frozen=True):
    type: Annotated[str, Meta(max_length=64)] = "text"


class ChatRequest(msgspec.Struct, frozen=True):
    """A chat-completions request, as far as the swarm reads it (see the module docstring)."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    max_tokens: Annotated[int, Meta(ge=1, le=1 << 20)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1, le=1 << 20)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    stop: Annotated[str, Meta(max_length=MAX_STOP_CHARS)] | \
        Annotated[list[Annotated[str, Meta(max_length=MAX_STOP_CHARS)]], Meta(max_length=MAX_STOPS)] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: Annotated[list[Any], Meta(max_length=128)] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    logit_bias: Annotated[dict[str, Any], Meta(max_length=1024)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None


@dataclass(frozen=True)
class Completion:
    """What the endpoint answers: one text and finish reason per choice, and the token counts."""

    id: str
    model: str
    created_s: int
    texts: list[str]
    finish_reasons: list[str]  #: "stop" or "length", per choice
    prompt_tokens: int
    completion_tokens: int
    fingerprint: str  #: which run and policy version answered


def decode_request(body: bytes, *, max_tokens_cap: int) -> ChatRequest:
    """The request in ``body``, checked; ``ApiError`` (400) says what is wrong with it."""
    try:
        request = msgspec.json.decode(body, type=ChatRequest)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    _refuse_unsupported(request)
    chars = 0
    for i, m in enumerate(request.messages):
        if m.tool_calls:
            raise ApiError(400, "tool calls are not supported: this endpoint has no tool-call parser "
                                "(a model's call stays text in its content)", param=f"messages[{i}].tool_calls")
        chars += sum(len(t) for t in _texts(m, i))
    if chars > MAX_MESSAGE_CHARS:
        raise ApiError(400, f"the messages hold {chars} characters, over the {MAX_MESSAGE_CHARS} cap",
                       param="messages", code="context_length_exceeded")
    wanted = requested_max_tokens(request)
    if wanted is not None and wanted > max_tokens_cap:
        raise ApiError(400, f"max_tokens is {wanted}, over this run's completion budget of {max_tokens_cap} "
                            f"tokens (the run's sampling.max_new_tokens)", param="max_tokens")
    return request


def _refuse_unsupported(r: ChatRequest) -> None:
    if r.tools:
        raise ApiError(400, "tools are not supported: this endpoint has no tool-call parser", param="tools")
    if r.logprobs or r.top_logprobs:
        raise ApiError(400, "logprobs are not returned by this endpoint", param="logprobs")
    if r.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(r, name):
            raise ApiError(400, f"{name} is not supported (only 0)", param=name)
    if r.response_format is not None and r.response_format.type != "text":
        raise ApiError(400, f"response_format {r.response_format.type!r} is not supported (only 'text')",
                       param="response_format")


def _texts(m: ChatMessage, i: int) -> list[str]:
    if m.content is None:
        return []
    if isinstance(m.content, str):
        return [m.content]
    out = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"content parts of type {part.type!r} are not supported (only text)",
                           param=f"messages[{i}].content")
        out.append(part.text)
    return out


def chat_turns(request: ChatRequest) -> list[dict[str, str]]:
    """The messages as ``{"role", "content"}`` turns for a chat template (``developer`` read as ``system``)."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": "".join(_texts(m, i))}
            for i, m in enumerate(request.messages)]


def requested_max_tokens(request: ChatRequest) -> int | None:
    """``max_completion_tokens`` (OpenAI's current name) or ``max_tokens``; None: neither given."""
    return request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens


def stop_strings(request: ChatRequest) -> list[str]:
    stop = request.stop
    return [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


def completion_body(c: Completion) -> dict[str, Any]:
    """A ``chat.completion`` object."""
    return {"id": c.id, "object": "chat.completion", "created": c.created_s, "model": c.model,
            "system_fingerprint": c.fingerprint,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": reason} for i, (text, reason) in enumerate(zip(c.texts, c.finish_reasons))],
            "usage": _usage(c)}


def stream_events(c: Completion, *, include_usage: bool) -> Iterator[bytes]:
    """The completion as server-sent ``chat.completion.chunk`` events, ending with ``[DONE]``."""
    head = {"id": c.id, "object": "chat.completion.chunk", "created": c.created_s, "model": c.model,
            "system_fingerprint": c.fingerprint}
    for i, (text, reason) in enumerate(zip(c.texts, c.finish_reasons)):
        yield _event({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": text},
                                           "logprobs": None, "finish_reason": None}]})
        yield _event({**head, "choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}]})
    if include_usage:
        yield _event({**head, "choices": [], "usage": _usage(c)})
    yield b"data: [DONE]\n\n"


def _usage(c: Completion) -> dict[str, int]:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def models_body(model_id: str, created_s: int) -> dict[str, Any]:
    """``GET /v1/models``: the one model the swarm serves."""
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created_s, "owned_by": "polis"}]}
