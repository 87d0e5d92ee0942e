"""The coordinator's OpenAI-compatible endpoint: ``POST /v1/chat/completions`` and ``GET /v1/models``.

Any OpenAI client (or a ``verifiers`` environment) can ask the swarm's current policy for chat
completions. Both routes sit behind the coordinator's admin token (``Authorization: Bearer
<token>``, the one check of ``Coordinator._admin``): an answer spends contributors' compute.

A request is decoded and bounded by ``engine.swarm.openai_wire``, its messages rendered with the
run's own chat template and tokenized by the run's codec (``engine.rl.codec.ChatCodec``, the same
path every training prompt takes), and queued (``engine.swarm.serve_queue``); the generation
scheduler runs it as a job of kind ``serve`` on a pipeline route before any eval or training job,
and the sampled ids come back here, decoded up to the first stop id, cut at the first ``stop``
string, and answered as a ``chat.completion`` (``finish_reason`` "stop" when a stop id or
string ended it, "length" when the budget did) or, with ``stream``, as the same completion in
server-sent chunks once it is done. ``system_fingerprint`` names the run and the oldest policy
version that served it.

Refusals: 400 for a malformed or oversize request (``max_tokens`` over the run's
``sampling.max_new_tokens``, a prompt that with ``max_tokens`` does not fit the model's context),
401 without the token, 413 for a body over the coordinator's cap, 429 when ``MAX_QUEUED`` requests
already wait, 501 when the run's model has no chat template (the tiny digit base), 503 when no
complete route serves or generation kept failing, 504 past the request's deadline.

What it does not know: routes, nodes, jobs (the scheduler's), how tokens are sampled.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Callable

from aiohttp import web

from engine.rl.codec import ChatCodec, CodecError
from engine.swarm import openai_wire as wire
from engine.swarm.messages import MAX_TOKENS
from engine.swarm.serve_queue import ServeQueue, ServeRefused, ServeRequest, ServeResult

log = logging.getLogger(__name__)

#: how long a request may wait for the swarm, queue and generation together (seconds)
DEADLINE_S = 180.0
#: what a 429 / 503 asks the client to wait before retrying (seconds)
RETRY_AFTER_S = {429: 5, 503: 30}


class OpenAIEndpoint:
    """The two routes' handlers over one run's queue and codec."""

    def __init__(self, queue: ServeQueue, codec: ChatCodec | None, *, model_id: str, max_tokens_cap: int,
                 context_tokens: int, has_route: Callable[[], bool], run_id: str,
                 deadline_s: float = DEADLINE_S) -> None:
        self.queue, self.codec = queue, codec
        self.model_id, self.max_tokens_cap, self.context_tokens = model_id, max_tokens_cap, context_tokens
        self.has_route, self.run_id, self.deadline_s = has_route, run_id, deadline_s
        self.created_s = int(time.time())

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(wire.models_body(self.model_id, self.created_s))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            try:
                body = await request.read()  # capped by the app's client_max_size
            except web.HTTPRequestEntityTooLarge as exc:
                raise wire.ApiError(413, f"the body is over the coordinator's cap: {exc.text}") from None
            chat = wire.decode_request(body, max_tokens_cap=self.max_tokens_cap)
            serve = self.serve_request(chat)
            result = await self._wait(serve)
        except wire.ApiError as exc:
            return _error(exc)
        completion = self.completion(chat, serve, result)
        if not chat.stream:
            return web.json_response(wire.completion_body(completion))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        include_usage = chat.stream_options is not None and chat.stream_options.include_usage
        for event in wire.stream_events(completion, include_usage=include_usage):
            await response.write(event)
        await response.write_eof()
        return response

    def serve_request(self, chat: wire.ChatRequest) -> ServeRequest:
        """``chat`` rendered through the run's chat template as a queued request, or ApiError."""
        if self.codec is None or self.codec.template is None:
            raise wire.ApiError(501, "this run's model has no chat template, so it cannot serve chat completions "
                                     "(run a chat model, e.g. --set model=smollm2-135m)", type="not_supported")
        try:
            ids = self.codec.encode_messages(wire.chat_turns(chat))
        except CodecError as exc:
            raise wire.ApiError(400, f"the messages do not render with the model's chat template: {exc}",
                                param="messages") from None
        max_new = wire.requested_max_tokens(chat) or self.max_tokens_cap
        if len(ids) > MAX_TOKENS or len(ids) + max_new > self.context_tokens:
            raise wire.ApiError(400, f"the prompt is {len(ids)} tokens; with max_tokens {max_new} it does not fit "
                                     f"the model's context of {self.context_tokens} tokens (prompts of at most "
                                     f"{MAX_TOKENS})", param="messages", code="context_length_exceeded")
        if not self.has_route():
            raise wire.ApiError(503, "no complete pipeline route serves generation now; retry when nodes have "
                                     "joined", type="service_unavailable")
        loop = asyncio.get_running_loop()
        serve = ServeRequest(prompt_ids=tuple(ids), n=chat.n or 1, max_new_tokens=max_new,
                             temperature=1.0 if chat.temperature is None else chat.temperature,
                             top_p=1.0 if chat.top_p is None else chat.top_p,
                             seed=None if chat.seed is None else chat.seed % 2**63,
                             deadline=time.monotonic() + self.deadline_s, future=loop.create_future())
        try:
            self.queue.submit(serve)
        except ServeRefused as exc:
            raise wire.ApiError(exc.status, exc.message, type="rate_limit_exceeded") from None
        return serve

    async def _wait(self, serve: ServeRequest) -> ServeResult:
        try:
            return await asyncio.wait_for(asyncio.shield(serve.future), max(0.0, serve.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise wire.ApiError(504, f"the swarm did not answer within {self.deadline_s:.0f} s",
                                type="timeout") from None
        except ServeRefused as exc:
            raise wire.ApiError(exc.status, exc.message, type="service_unavailable") from None
        finally:
            if not serve.future.done() or serve.future.cancelled():
                self.queue.abandon(serve)  # deadline passed or the client went away: the swarm need not go on

    def completion(self, chat: wire.ChatRequest, serve: ServeRequest, result: ServeResult) -> wire.Completion:
        """The sampled rows of ``result`` as OpenAI's completion of ``chat``."""
        assert self.codec is not None
        stops = wire.stop_strings(chat)
        texts, reasons = [], []
        for ids in result.tokens:
            body, stopped = self.codec.completion_ids(ids)
            text, cut = wire.cut_at_stop(self.codec.decode(body), stops)
            texts.append(text)
            reasons.append("stop" if stopped or cut else "length")
        version = min(result.versions) if result.versions else 0
        return wire.Completion(id=f"chatcmpl-{secrets.token_hex(12)}", model=self.model_id,
                               created_s=int(time.time()), texts=texts, finish_reasons=reasons,
                               prompt_tokens=len(serve.prompt_ids),
                               completion_tokens=sum(len(t) for t in result.tokens),
                               fingerprint=f"polis-{self.run_id}-v{version}")


def _error(exc: wire.ApiError) -> web.Response:
    retry = RETRY_AFTER_S.get(exc.status)
    headers = {"Retry-After": str(retry)} if retry else None
    if exc.status >= 500:
        log.info("chat completion refused (%d): %s", exc.status, exc.message)
    return web.json_response(exc.body(), status=exc.status, headers=headers)


def served_model_id(model: str, checkpoint_name: str) -> str:
    """The id ``/v1/models`` lists: the run's model name (a path's last part), else the checkpoint's folder."""
    name = model.rstrip("/").rsplit("/", 1)[-1] if model else ""
    return name or checkpoint_name
