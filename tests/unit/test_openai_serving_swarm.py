"""A chat completion served through a 2-stage swarm equals greedy decoding of the whole model in one process.

The coordinator's generation scheduler runs the request (rendered with the model's chat template)
as a ``serve`` job on two real torch nodes of the tiny tied Llama wired in memory; with
temperature 0 the completion's tokens are the in-process greedy tokens of the same prompt, its
text their decoding up to the end-of-turn token, and nothing is stored as a rollout.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from engine.rl.objective import ObjectiveConfig
from engine.rl.rollout import SamplingConfig
from engine.rl.run_task import make_run_task
from engine.rl.tasks import TaskConfig
from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm import openai_wire as wire
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.openai_api import OpenAIEndpoint
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.scheduler import GenerationScheduler
from engine.swarm.store import Store
from tests.unit.test_multi_turn_swarm_episode import (
    _Links,
    _model_that_ends_turns,
    _two_nodes,
    _welcome_two_stages,
)
from tests.unit.test_node_pipeline import _run, _until

pytest.importorskip("torch")
pytest.importorskip("reasoning_gym")

CHAIN_SUM = TaskConfig(name="reasoning_gym:chain_sum", eval_size=2,
                       options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 3 + 4?"}]


def _greedy_in_process(model_dir, prompt: list[int], max_new: int, stops: set[int]) -> list[int]:
    from engine.rl.pipeline import LocalPipeline

    pipe = LocalPipeline.from_checkpoint(model_dir, 1, "torch", device="cpu")
    logits = pipe.next_token_logits(np.asarray([prompt]), "greedy")
    ids: list[int] = []
    for _ in range(max_new):
        ids.append(int(np.argmax(logits[0])))
        if ids[-1] in stops:
            break
        logits = pipe.next_token_logits(np.asarray([[ids[-1]]]), "greedy")
    return ids


def test_a_greedy_chat_completion_through_two_stages_equals_in_process_greedy_decoding(tmp_path):
    model_dir = _model_that_ends_turns(tmp_path)
    run = RunConfig(task=CHAIN_SUM, group_size=2, prompts_per_job=1, prompts_per_step=1, generations_in_flight=2,
                    sampling=SamplingConfig(temperature=1.0, max_new_tokens=16), activation_encoding="int8_rowwise")
    task = make_run_task(CHAIN_SUM, model_dir)
    store = Store(tmp_path / "coord.db")
    book = RunBook(store)
    book.finished = True  # no training jobs: only the served request runs
    store.record_eval(0, 0.1, 10)  # the "before" eval is done
    evals = EvalScheduler(task, store)
    evals.wanted = None
    box: dict = {}
    nodes = _two_nodes(model_dir, box)
    links = _Links(nodes)
    scheduler = box["scheduler"] = GenerationScheduler(run, UpdateRules(objective=ObjectiveConfig()), task, store,
                                                       book, evals, links, vocab_size=task.codec.vocab_size)
    endpoint = OpenAIEndpoint(scheduler.serve, task.codec, model_id="tiny", max_tokens_cap=16, context_tokens=2048,
                              has_route=lambda: True, run_id="run-serve")
    chat = wire.decode_request(json.dumps({"model": "tiny", "messages": CHAT, "temperature": 0, "n": 2}).encode(),
                               max_tokens_cap=16)
    out: dict = {}

    async def scenario():
        await _welcome_two_stages(nodes, run, "run-serve")
        await _until("both stages ready", lambda: all(n.ctx.coordinator.of_type(messages.Ready)
                                                      for n in nodes.values()))
        serve = endpoint.serve_request(chat)
        deadline = asyncio.get_running_loop().time() + 60
        while not serve.future.done():
            assert asyncio.get_running_loop().time() < deadline, f"not served; counters {dict(book.counters)}"
            await scheduler.fill()
            await asyncio.sleep(0.02)
        out["serve"], out["result"] = serve, serve.future.result()

    _run(scenario, list(nodes.values()))
    serve, result = out["serve"], out["result"]
    sent = [m for _, m in links.sent if isinstance(m, messages.Gen)]
    assert [m.job[0] for m in sent] == ["s"] and sent[0].params.exact_activations  # over the run's int8 encoding
    want = _greedy_in_process(model_dir, list(serve.prompt_ids), 16, set(task.stop_ids))
    assert result.tokens == [want, want]
    body = wire.completion_body(endpoint.completion(chat, serve, result))
    body_ids, stopped = task.codec.completion_ids(want)
    assert [c["message"]["content"] for c in body["choices"]] == [task.codec.decode(body_ids)] * 2
    assert [c["finish_reason"] for c in body["choices"]] == ["stop" if stopped else "length"] * 2
    assert store.ready_group_count() == 0 and scheduler.received_rollouts == 0
    store.close()
