"""``/v1/chat/completions`` and ``/v1/models`` on a real coordinator: the admin token, HTTP statuses.

Without the admin token (the coordinator's one check) both routes answer 401; a malformed body
400, an oversize one 413; with no route 503; a full queue 429 (with ``Retry-After``) and a request
nobody served before its deadline 504; a run on the character-level base, which has no chat
template, 501. ``/v1/models`` lists the one model the swarm serves.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from engine.paths import base_checkpoint_dir
from engine.rl.rollout import SamplingConfig
from engine.rl.tasks import TaskConfig
from engine.swarm.coordinator import Coordinator, CoordinatorConfig
from engine.swarm.run_config import RunConfig
from tests.support.tiny_tied_llama import write_tiny_tied_llama

pytest.importorskip("reasoning_gym")

TOKEN = {"Authorization": "Bearer s3cret"}
CHAIN_SUM = TaskConfig(name="reasoning_gym:chain_sum", eval_size=4,
                       options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 8}


def _coordinator(tmp_path, checkpoint: str, run: RunConfig | None = None) -> Coordinator:
    return Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=checkpoint, num_stages=2,
                                         port=0, admin_token="s3cret", run=run or RunConfig()))


def _chat_coordinator(tmp_path) -> Coordinator:
    model = write_tiny_tied_llama(tmp_path / "tiny")
    return _coordinator(tmp_path, str(model), RunConfig(task=CHAIN_SUM, sampling=SamplingConfig(max_new_tokens=16)))


async def _post(http: aiohttp.ClientSession, url: str, body: bytes | dict, headers: dict | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url + "/v1/chat/completions", data=data,
                         headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.json(content_type=None), r.headers.get("Retry-After")


def test_without_the_admin_token_both_routes_answer_401_and_models_lists_the_served_model(tmp_path):
    async def main():
        c = _chat_coordinator(tmp_path)
        url = await c.start()
        try:
            async with aiohttp.ClientSession() as http:
                out = []
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer s\u00e9cret"}):
                    out.append((await _post(http, url, CHAT, headers))[0])
                    async with http.get(url + "/v1/models", headers=headers) as r:
                        out.append(r.status)
                async with http.get(url + "/v1/models", headers=TOKEN) as r:
                    models = (r.status, await r.json())
            return out, models
        finally:
            await c.stop()

    statuses, (status, models) = asyncio.run(asyncio.wait_for(main(), 60))
    assert statuses == [401] * 6
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"] and models["object"] == "list"


def test_malformed_oversize_and_unroutable_requests_get_400_413_and_503(tmp_path):
    async def main():
        c = _chat_coordinator(tmp_path)
        url = await c.start()
        try:
            async with aiohttp.ClientSession() as http:
                return [await _post(http, url, b"{not json", TOKEN),
                        await _post(http, url, {**CHAT, "max_tokens": 17}, TOKEN),  # over the run's 16
                        await _post(http, url, {**CHAT, "messages": [{"role": "user", "content": "x" * (2 << 20)}]},
                                    TOKEN),
                        await _post(http, url, CHAT, TOKEN)]  # no node has joined
        finally:
            await c.stop()

    malformed, over_budget, oversize, unroutable = asyncio.run(asyncio.wait_for(main(), 60))
    assert malformed[0] == 400 and "not JSON" in malformed[1]["error"]["message"]
    assert over_budget[0] == 400 and over_budget[1]["error"]["param"] == "max_tokens"
    assert oversize[0] == 413 and "cap" in oversize[1]["error"]["message"]
    assert unroutable[0] == 503 and unroutable[2] == "30" and "route" in unroutable[1]["error"]["message"]


def test_a_full_queue_answers_429_and_a_request_nobody_serves_answers_504_at_its_deadline(tmp_path):
    async def main():
        c = _chat_coordinator(tmp_path)
        c.openai.has_route = lambda: True  # as if a route existed, but no node ever takes the job
        c.openai.deadline_s = 1.5
        c.generation.serve.max_queued = 1
        url = await c.start()
        try:
            async with aiohttp.ClientSession() as http:
                waiting = asyncio.ensure_future(_post(http, url, CHAT, TOKEN))
                while not len(c.generation.serve):
                    await asyncio.sleep(0.01)
                full = await _post(http, url, CHAT, TOKEN)
                return full, await waiting, len(c.generation.serve)
        finally:
            await c.stop()

    full, late, left = asyncio.run(asyncio.wait_for(main(), 60))
    assert full[0] == 429 and full[2] == "5"
    assert late[0] == 504 and "did not answer" in late[1]["error"]["message"] and left == 0


def test_a_run_on_the_character_level_base_answers_501(tmp_path):
    async def main():
        c = _coordinator(tmp_path, str(base_checkpoint_dir()))
        url = await c.start()
        try:
            async with aiohttp.ClientSession() as http:
                return await _post(http, url, CHAT, TOKEN)
        finally:
            await c.stop()

    status, body, _ = asyncio.run(asyncio.wait_for(main(), 60))
    assert status == 501 and "chat template" in body["error"]["message"]
