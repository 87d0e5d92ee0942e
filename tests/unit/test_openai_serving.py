"""The OpenAI-compatible endpoint's path through the coordinator: request -> serve job -> completion.

A chat request is rendered with the run's chat template into a job of kind ``serve`` that goes
out before the "before" eval and any training job, sampled as the request asks over exact
activations; its result comes back as an OpenAI completion (stop / length, stop strings, usage,
the stream form) and is never stored as a rollout; a failed serve job is retried while its
request's attempts allow, then answered 503; the queue is bounded. The tiny tied Llama with its
BPE tokenizer and ChatML template stands for a chat model; nodes are a recording outbox.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.rl.objective import ObjectiveConfig
from engine.rl.rollout import SamplingConfig
from engine.rl.run_task import ChatRunTask, make_run_task
from engine.rl.tasks import TaskConfig
from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm import openai_wire as wire
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.openai_api import OpenAIEndpoint
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.scheduler import SERVE_IN_FLIGHT, GenerationScheduler
from engine.swarm.serve_queue import ServeQueue, ServeRefused, ServeRequest
from engine.swarm.store import Store
from tests.support.recording_links import RecordingLinks
from tests.support.tiny_tied_llama import IM_END, write_tiny_tied_llama

pytest.importorskip("reasoning_gym")

ROUTE = ["peer0000", "peer1111"]
CHAIN_SUM = TaskConfig(name="reasoning_gym:chain_sum", eval_size=4,
                       options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_tied_llama(tmp_path_factory.mktemp("tiny-tied"))


@pytest.fixture()
def serving(tmp_path, model_dir):
    task = make_run_task(CHAIN_SUM, model_dir)
    assert isinstance(task, ChatRunTask)
    run = RunConfig(task=CHAIN_SUM, group_size=2, prompts_per_step=1, prompts_per_job=1, generations_in_flight=4,
                    sampling=SamplingConfig(temperature=0.7, max_new_tokens=24))
    store, links = Store(tmp_path / "c.db"), RecordingLinks(ROUTE)
    book = RunBook(store)
    generation = GenerationScheduler(run, UpdateRules(objective=ObjectiveConfig()), task, store, book,
                                     EvalScheduler(task, store), links, vocab_size=task.codec.vocab_size)
    endpoint = OpenAIEndpoint(generation.serve, task.codec, model_id="tiny", max_tokens_cap=24, context_tokens=2048,
                              has_route=lambda: True, run_id="run1")
    yield task, generation, endpoint, store, links
    store.close()


def _request(**fields) -> wire.ChatRequest:
    return wire.decode_request(json.dumps({"model": "tiny", "messages": CHAT, **fields}).encode(), max_tokens_cap=24)


def _done(job: messages.Gen, rows: list[list[int]]) -> messages.GenDone:
    return messages.GenDone(job=job.job, tokens=rows, logprobs=[[-0.5] * len(r) for r in rows], versions=[0, 0])


def test_a_chat_request_renders_with_the_models_template_and_becomes_a_serve_job_before_evals_and_training(serving):
    task, generation, endpoint, _, links = serving

    async def main():
        serve = endpoint.serve_request(_request(n=3, max_tokens=10, temperature=0.3, top_p=0.9, seed=-5))
        await generation.fill()
        return serve

    serve = asyncio.run(main())
    kinds = [m.job[0] for _, m in links.sent if isinstance(m, messages.Gen)]
    assert kinds[0] == "s" and "e" in kinds  # the serve job first, then the "before" eval
    job = links.sent[0][1]
    want = task.codec.encode(task.codec.template.render(CHAT, add_generation_prompt=True))
    assert task.codec.decode(want, skip_special=False).endswith("<|im_start|>assistant\n")
    assert list(serve.prompt_ids) == want and job.prompt_ids == [want] * 3  # n rows of one prompt
    p = job.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.seed, p.exact_activations) == (10, 0.3, 0.9, 2**63 - 5, True)
    assert p.stop_ids == list(task.stop_ids) and generation.jobs[job.job].kind == "serve"


def test_a_request_does_not_wait_behind_a_route_full_of_other_jobs_but_its_extra_room_is_bounded(serving):
    _, generation, endpoint, _, links = serving

    generation.pacer.limit = lambda route, cap: 1  # type: ignore[method-assign]  # a budget of one job

    async def main():
        await generation.fill()  # the route's budget: one eval job
        others = len(generation.jobs)
        for _ in range(SERVE_IN_FLIGHT + 2):
            endpoint.serve_request(_request())
        await generation.fill()
        return others

    others = asyncio.run(main())
    serving_jobs = [j for j in generation.jobs.values() if j.kind == "serve"]
    assert others == 1
    assert len(serving_jobs) == SERVE_IN_FLIGHT and len(generation.serve) == 2  # the rest wait their turn


def test_a_serve_result_becomes_an_openai_completion_and_is_never_stored_as_a_rollout(serving):
    task, generation, endpoint, store, links = serving
    im_end = task.codec.tokenizer.token_to_id(IM_END)
    text = task.codec.encode("3 + 4 = 7. Done")

    async def main():
        chat = _request(n=2, stop=["Done"], stream=True, stream_options={"include_usage": True})
        serve = endpoint.serve_request(chat)
        await generation.fill()
        job = next(m for _, m in links.sent if isinstance(m, messages.Gen) and m.job.startswith("s"))
        generation.on_gen_done(ROUTE[-1], _done(job, [text + [im_end], text[:4]]))
        result = await asyncio.wait_for(serve.future, 5)
        return chat, serve, result

    chat, serve, result = asyncio.run(main())
    completion = endpoint.completion(chat, serve, result)
    body = wire.completion_body(completion)
    assert [c["message"]["content"] for c in body["choices"]] == ["3 + 4 = 7. ", task.codec.decode(text[:4])]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"] == {"prompt_tokens": len(serve.prompt_ids), "completion_tokens": len(text) + 1 + 4,
                             "total_tokens": len(serve.prompt_ids) + len(text) + 5}
    assert (body["object"], body["model"], body["system_fingerprint"]) == ("chat.completion", "tiny", "polis-run1-v0")
    events = [e.decode() for e in wire.stream_events(completion, include_usage=True)]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert events[-1] == "data: [DONE]\n\n" and all(e.endswith("\n\n") for e in events)
    assert [c["choices"][0]["delta"].get("content") for c in chunks[:4:2]] == [c["message"]["content"]
                                                                               for c in body["choices"]]
    assert chunks[-1]["usage"] == body["usage"] and chunks[-1]["choices"] == []
    assert store.ready_group_count() == 0 and generation.received_rollouts == 0 and not generation.samples
    assert generation.book.counters["serve_jobs_done"] == 1 and generation.serve.served == 1


def test_a_failed_serve_job_is_retried_then_answered_503(serving):
    _, generation, endpoint, _, links = serving

    async def main():
        serve = endpoint.serve_request(_request())
        jobs = []
        for _ in range(generation.serve.max_attempts):
            await generation.fill()
            job = [m for _, m in links.sent if isinstance(m, messages.Gen) and m.job.startswith("s")][-1]
            assert job.job not in jobs  # each attempt is a new job
            jobs.append(job.job)
            generation.on_job_failed(ROUTE[0], job.job, "node left")
        with pytest.raises(ServeRefused) as refused:
            await asyncio.wait_for(serve.future, 5)
        return jobs, refused.value

    jobs, refused = asyncio.run(main())
    assert len(jobs) == 3 and refused.status == 503 and "node left" in refused.message
    assert not generation.jobs or all(not j.startswith("s") for j in generation.jobs)


def test_a_serve_job_whose_caller_gave_up_leaves_the_books_and_its_route_is_told_to_stop(serving):
    _, generation, endpoint, _, links = serving

    async def main():
        serve = endpoint.serve_request(_request())
        await generation.fill()
        job = next(m for _, m in links.sent if isinstance(m, messages.Gen) and m.job.startswith("s"))
        generation.serve.abandon(serve)  # as the handler does past the deadline or when the client left
        generation.expire_jobs()
        await asyncio.sleep(0)  # the cancel goes out
        generation.on_gen_done(ROUTE[-1], _done(job, [[5, 6]]))  # a late result is discarded
        return job

    job = asyncio.run(main())
    assert job.job not in generation.jobs and generation.book.counters["serve_jobs_abandoned"] == 1
    assert any(isinstance(m, messages.GenRelease) and m.job == job.job and m.cancel for _, m in links.sent)
    assert generation.book.counters["unexpected_results"] == 1 and generation.serve.served == 0


def test_the_queue_is_bounded_and_a_request_past_its_deadline_is_answered_504():
    async def main():
        queue = ServeQueue(max_queued=2)
        loop = asyncio.get_running_loop()

        def request(deadline: float) -> ServeRequest:
            return ServeRequest((1, 2), 1, 4, 1.0, 1.0, None, deadline, loop.create_future())

        first, second = request(0.0), request(1e12)
        queue.submit(first)
        queue.submit(second)
        with pytest.raises(ServeRefused) as full:
            queue.submit(request(1e12))
        taken = queue.next_request()  # the first is past its deadline: answered on the way
        with pytest.raises(ServeRefused) as late:
            await first.future
        return queue, full.value, late.value, taken is second

    queue, full, late, second_taken = asyncio.run(main())
    assert full.status == 429 and late.status == 504 and second_taken
    assert queue.stats() == {"queued": 0, "in_flight": 0, "served": 0, "refused_full": 1, "expired": 1,
                                  "failed": 0}


@pytest.mark.parametrize("fields, status, param", [
    ({"max_tokens": 25}, 400, "max_tokens"),  # over the run's completion budget
    ({"max_completion_tokens": 10_000}, 400, "max_tokens"),
    ({"messages": []}, 400, None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({"messages": [{"role": "user", "content": "x"}] * (wire.MAX_MESSAGES + 1)}, 400, None),
    ({"messages": [{"role": "user", "content": "x" * (wire.MAX_MESSAGE_CHARS // 2)}] * 3}, 400, "messages"),
    ({"temperature": 3}, 400, None),
    ({"n": wire.MAX_N + 1}, 400, None),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, 400,
     "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    ({"logprobs": True}, 400, "logprobs"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"model": ""}, 400, None),
])
def test_malformed_or_oversize_requests_are_refused_with_400_naming_the_field(fields, status, param):
    body = {"model": "tiny", "messages": CHAT, **fields}
    with pytest.raises(wire.ApiError) as refused:
        wire.decode_request(json.dumps(body).encode(), max_tokens_cap=24)
    assert refused.value.status == status and refused.value.param == param
    assert refused.value.body()["error"]["type"] == "invalid_request_error"


def test_text_parts_developer_messages_and_unknown_keys_are_read_as_openai_servers_read_them():
    body = {"model": "m", "user": "u-1", "metadata": {"k": "v"},
            "messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text",
                                                                                            "text": "2 + 2?"}]}]}
    chat = wire.decode_request(json.dumps(body).encode(), max_tokens_cap=8)
    assert wire.chat_turns(chat) == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "What is 2 + 2?"}]
    assert wire.requested_max_tokens(chat) is None and wire.stop_strings(chat) == []


def test_a_prompt_that_does_not_fit_the_context_or_a_run_without_a_chat_template_is_refused(serving):
    task, generation, endpoint, _, _ = serving
    small = OpenAIEndpoint(generation.serve, task.codec, model_id="tiny", max_tokens_cap=24, context_tokens=30,
                           has_route=lambda: True, run_id="r")
    no_template = OpenAIEndpoint(generation.serve, None, model_id="tiny", max_tokens_cap=24, context_tokens=2048,
                                 has_route=lambda: True, run_id="r")
    no_route = OpenAIEndpoint(generation.serve, task.codec, model_id="tiny", max_tokens_cap=24, context_tokens=2048,
                              has_route=lambda: False, run_id="r")

    async def statuses():
        out = []
        for endpoint in (small, no_template, no_route):
            with pytest.raises(wire.ApiError) as refused:
                endpoint.serve_request(_request())
            out.append((refused.value.status, refused.value.code))
        return out

    assert asyncio.run(statuses()) == [(400, "context_length_exceeded"), (501, None), (503, None)]
    assert len(generation.serve) == 0
