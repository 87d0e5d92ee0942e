"""A 3-turn episode through a 2-stage swarm equals the in-process episode runner, token for token.

The coordinator's generation scheduler (its turn driver, ``engine.swarm.episodes``) drives two real
torch nodes of the tiny tied Llama wired in memory: turn 1 of a group runs both rows in one job,
turn 2 recomputes each episode's prefix as its own job, turn 3 continues from that job's kept KV
caches. The rollouts stored for training carry the same ids, loss mask and behaviour log-probs as
``engine.envs.token_rollout.run_token_episode`` gives in one process with the same sampler seeds,
and every kept cache is freed when its episode ends.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, Mapping

import numpy as np
import pytest

from backends.base import sample_from_logits
from engine.envs.contract import Environment, EpisodeItem, EpisodeLimits, EpisodeState, Message
from engine.envs.token_rollout import Generation, run_token_episode
from engine.rl.codec import ChatCodec
from engine.rl.env_run_task import EnvRunTask
from engine.rl.rollout import SamplingConfig
from engine.rl.update import UpdateRules
from engine.swarm import messages
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.node import Node, NodeConfig
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.scheduler import GenerationScheduler
from engine.swarm.store import Store
from tests.support.memory_wire import MemoryWire
from tests.support.tiny_tied_llama import IM_END, write_tiny_tied_llama
from tests.unit.test_node_pipeline import _run, _until

pytest.importorskip("torch")

P0, P1 = "peer0000", "peer1111"
TURNS = 3


class ThreeTurns(Environment):
    """Answers the model's first two turns with an observation about them; the third ends it."""

    name = "three_turns"

    def _item(self, n: int, held_out: bool) -> EpisodeItem:
        return EpisodeItem(item_id=f"q{n}", messages=(Message("system", "Use the tool."),
                                                      Message("user", f"What is {n} + 4?")),
                           answer=str(n + 4), held_out=held_out)

    def train_items(self, seed: int) -> Iterator[EpisodeItem]:
        n = 10 + seed % 7
        while True:
            yield self._item(n, False)
            n += 1

    def eval_items(self) -> list[EpisodeItem]:
        return [self._item(1, True)]

    def respond(self, state: EpisodeState, model_text: str) -> Message | None:
        if state.turns >= TURNS:
            return None
        return Message("tool", f"turn {state.turns}: you wrote {len(model_text)} characters")

    def score(self, state: EpisodeState) -> Mapping[str, float]:
        return {"answer": float(state.item.answer in state.messages[-1].content)}


def _model_that_ends_turns(tmp_path: Path) -> Path:
    """The tiny model, its tied embedding nudged so that a turn ends (``<|im_end|>``) within a few tokens."""
    from safetensors.numpy import load_file, save_file

    model_dir = write_tiny_tied_llama(tmp_path / "tiny", num_layers=4)
    shard = next(model_dir.glob("*.safetensors"))
    weights = load_file(str(shard))
    table = weights["model.embed_tokens.weight"]
    u = np.random.default_rng(0).standard_normal(table.shape[1]).astype(np.float32)
    u /= np.linalg.norm(u)
    table = table + 0.3 * u[None, :]
    table[2] += 2.5 * u  # id 2 is <|im_end|>
    weights["model.embed_tokens.weight"] = table.astype(np.float32)
    save_file(weights, str(shard))
    return model_dir


class _Links:
    """The coordinator's ``NodeLinks`` over in-memory nodes: every message through its wire encoding."""

    def __init__(self, nodes: dict[str, Node]) -> None:
        self.nodes = nodes
        self.sent: list[tuple[str, object]] = []

    async def send(self, peer: str, message) -> bool:
        self.sent.append((peer, message))
        self.nodes[peer].on_coordinator(messages.decode_from_coordinator(messages.encode(message)))
        return True

    def routes(self) -> list[list[str]]:
        return [[P0, P1]]

    gen_routes = routes

    def stage_replicas(self) -> list[list[str]]:
        return [[P0], [P1]]

    def inference_replicas(self) -> list[list[str]]:
        return [[], []]

    def catching_up(self) -> bool:
        return False


class _ToScheduler:
    """A node's coordinator sender that hands results to the scheduler, as the coordinator does."""

    def __init__(self, peer: str, box: dict) -> None:
        self.peer, self.box = peer, box
        self.messages: list = []

    async def send(self, message) -> None:
        m = messages.decode_from_node(messages.encode(message))
        self.messages.append(m)
        scheduler = self.box.get("scheduler")
        if isinstance(m, messages.GenDone):
            scheduler.on_gen_done(self.peer, m)
        elif isinstance(m, messages.JobFailed):
            scheduler.on_job_failed(self.peer, m.job, m.reason)

    def of_type(self, kind: type) -> list:
        return [m for m in self.messages if isinstance(m, kind)]


def _two_nodes(model_dir: Path, box: dict) -> dict[str, Node]:
    """Two real torch nodes of ``model_dir`` (``P0``, ``P1``) wired to each other in memory; what they
    send the coordinator goes to ``box["scheduler"]`` (``_ToScheduler``)."""
    wire = MemoryWire()
    nodes: dict[str, Node] = {}
    for peer in (P0, P1):
        node = Node(NodeConfig("http://127.0.0.1:9", backend="torch", device="cpu", base_checkpoint=str(model_dir)),
                    SimpleNamespace(peer_id=peer), peers=wire.sender(peer), coordinator=_ToScheduler(peer, box))
        wire.attach(peer, node.on_peer)
        nodes[peer] = node
    return nodes


def _in_process(model_dir: Path, task: EnvRunTask, item: EpisodeItem, seeds: list[int], row: int, rows: int,
                run: RunConfig):
    """The in-process runner over the whole model, sampling as the last stage does with the same seeds."""
    from engine.rl.pipeline import LocalPipeline

    pipe = LocalPipeline.from_checkpoint(model_dir, 1, "torch", device="cpu")
    turn = iter(range(len(seeds)))
    stops = set(task.stop_ids)

    def generate(context, max_new_tokens):
        k = next(turn)
        width = rows if k == 0 else 1  # turn 1 ran the group's rows together: this row's draw is the row-th
        logits = pipe.next_token_logits(np.asarray([context]), f"ip{k}")
        ids, lps = [], []
        for step in range(max_new_tokens):
            rng = np.random.default_rng([seeds[k], step])
            tok, lp = sample_from_logits(np.repeat(logits, width, axis=0), rng,
                                         temperature=run.sampling.temperature, top_p=run.sampling.top_p)
            ids.append(int(tok[row if k == 0 else 0]))
            lps.append(float(lp[row if k == 0 else 0]))
            if ids[-1] in stops:
                break
            logits = pipe.next_token_logits(np.asarray([[ids[-1]]]), f"ip{k}")
        pipe.drop_cache(f"ip{k}")
        return Generation(tuple(ids), tuple(lps), ids[-1] in stops)

    def decode(ids):
        return task.codec.decode(ids, skip_special=False)

    return run_token_episode(task.env, item, task.renderer, generate, decode, limits=task.limits,
                             max_new_tokens=run.sampling.max_new_tokens)


async def _welcome_two_stages(nodes: dict, run, run_id: str) -> None:
    """Start each node's compute and tell it, as the coordinator would, its stage of a 2-stage run."""
    for stage, node in enumerate(nodes.values()):
        await node.start_compute()
        node.on_coordinator(messages.decode_from_coordinator(json.dumps(
            {"type": "members", "stages": [[P0], [P1]], "version": 0})))
        node.on_coordinator(messages.decode_from_coordinator(json.dumps(
            {"type": "welcome", "stage": stage, "num_stages": 2, "layer_start": 2 * stage,
             "layer_end": 2 * stage + 2, "num_layers": 4, "source": "checkpoint", "source_peer": None,
             "stage_checkpoint": None, "version": 0, "run": run.to_dict(), "run_id": run_id,
             "signal_url": "ws://127.0.0.1:9/s"})))


def test_a_three_turn_episode_through_two_stages_matches_the_in_process_runner_and_frees_its_caches(tmp_path):
    model_dir = _model_that_ends_turns(tmp_path)
    run = RunConfig(group_size=2, prompts_per_job=1, prompts_per_step=1, generations_in_flight=1,
                    sampling=SamplingConfig(temperature=1.0, max_new_tokens=16), activation_encoding="fp32")
    codec = ChatCodec.from_dir(model_dir)
    assert codec.tokenizer.id_to_token(codec.eos_id) == IM_END
    task = EnvRunTask(ThreeTurns(), codec, EpisodeLimits(max_turns=TURNS + 1, max_context_tokens=512))
    store = Store(tmp_path / "coord.db")
    book = RunBook(store)
    box: dict = {}
    nodes = _two_nodes(model_dir, box)
    links = _Links(nodes)
    evals = EvalScheduler(task, store)
    scheduler = box["scheduler"] = GenerationScheduler(
        run, UpdateRules(objective=run.objective), task, store, book, evals, links, vocab_size=codec.vocab_size)

    async def scenario():
        await _welcome_two_stages(nodes, run, "run-turns")
        await _until("both stages ready", lambda: all(n.ctx.coordinator.of_type(messages.Ready)
                                                      for n in nodes.values()))

        async def filled():
            await scheduler.fill()
            return store.complete_group_count(run.group_size) >= 1

        deadline = asyncio.get_running_loop().time() + 90
        while not await filled():
            assert asyncio.get_running_loop().time() < deadline, f"no group stored; counters {dict(book.counters)}"
            await asyncio.sleep(0.02)
        book.finished = True  # no more training jobs
        await _until("every kept cache released", lambda: all(
            not n.generation._cached and not n.generation._kept for n in nodes.values()))

    _run(scenario, list(nodes.values()))
    assert store.evals() and store.evals()[0]["n"] == 1  # the "before" eval ran its episode to the end
    rollouts = store.ready_rollouts(limit=10)
    group = rollouts[0].group_id
    rollouts = [r for r in rollouts if r.group_id == group]
    assert len(rollouts) == 2
    counters = book.counters
    assert counters["turns_recomputed"] >= 2 and counters["turns_from_cache"] >= 2, dict(counters)
    gens = [m for _, m in links.sent if isinstance(m, messages.Gen)]
    first = next(g for g in gens if g.job == group.split(":")[0])
    item = task._prompts.item(rollouts[0].prompt)  # the item behind the stored prompt key
    for row, stored in enumerate(rollouts):
        later = sorted((g for g in gens if g.job == f"{group}.{row}"), key=lambda g: g.params.turn)
        assert [g.params.turn for g in later] == [1, 2]
        assert later[0].params.cached_tokens == 0 and later[1].params.cached_tokens > 0  # recomputed, then reused
        assert len(later[1].prompt_ids[0]) < later[1].params.cached_tokens  # only what the caches lacked
        seeds = [first.params.seed, *(g.params.seed for g in later)]
        expected = _in_process(model_dir, task, item, seeds, row, run.group_size, run)
        assert expected.result.turns == TURNS and not expected.result.cuts
        start = len(task.prompt_ids(stored.prompt))
        assert stored.tokens == list(expected.trajectory.ids[start:])
        mask = stored.loss_mask if stored.loss_mask is not None else np.ones(len(stored.tokens), dtype=bool)
        assert mask.astype(int).tolist() == list(expected.trajectory.mask[start:])
        assert 0 < mask.sum() < len(mask)  # the observations are context
        np.testing.assert_allclose(stored.behaviour_logprobs, np.asarray(expected.logprobs[start:]), atol=1e-4)
        assert np.all(stored.behaviour_logprobs[~mask] == 0.0)


def test_a_turn_that_expects_a_cache_the_stage_does_not_hold_fails_as_a_cache_miss(tmp_path):
    model_dir = write_tiny_tied_llama(tmp_path / "tiny", num_layers=4)
    run = RunConfig(activation_encoding="fp32")
    box: dict = {}
    nodes = _two_nodes(model_dir, box)
    box["scheduler"] = SimpleNamespace(on_gen_done=lambda *a: None, on_job_failed=lambda *a: None)

    async def scenario():
        await _welcome_two_stages(nodes, run, "run-miss")
        await _until("ready", lambda: all(n.ctx.coordinator.of_type(messages.Ready) for n in nodes.values()))
        params = {"max_new_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": 1, "stop_ids": [2],
                  "turn": 1, "cached_tokens": 7, "keep_cache": True}
        nodes[P0].on_coordinator(messages.decode_from_coordinator(json.dumps(
            {"type": "gen", "job": "t1:0.0", "route": [P0, P1], "prompt_ids": [[5, 6]], "params": params})))
        failed = await _until("job_failed", lambda: nodes[P0].ctx.coordinator.of_type(messages.JobFailed))
        assert failed[0].reason.startswith("cache miss")

    _run(scenario, list(nodes.values()))
