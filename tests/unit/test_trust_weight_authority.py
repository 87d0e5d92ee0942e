"""Finding 3 of issue 14: weights are agreed by full hashes from every replica, never by "the smallest id".

The vote itself (``engine.swarm.weight_votes``) is tested directly; then a 3-replica stage end to end:
three real ``Node`` objects (replica step, gradient shares, resync, weight checks) wired in memory
(``tests.support.memory_wire``), driven by the coordinator's real ``StepRunner`` and ``Membership``
(``apply`` naming the leader, ``stepped`` digests, the vote, ``sync``, eviction) over sockets that
only decode. The stage runtime is a few fp32 tensors with seeded gradients, so a clean run is exact.
The liar has the smallest peer id and was admitted first: the old rules would have made it leader.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

from backends.base import StageSpec
from engine.paths import base_checkpoint_dir
from engine.rl.codec import TaskCodec
from engine.rl.run_task import DigitRunTask
from engine.rl.tasks import make_task
from engine.rl.update import UpdateRules
from engine.swarm import messages, tensor_bundle
from engine.swarm.eval_scheduler import EvalScheduler
from engine.swarm.membership import Membership, NodeSession
from engine.swarm.node import Node, NodeConfig
from engine.swarm.run_book import RunBook
from engine.swarm.run_config import RunConfig
from engine.swarm.step_runner import StepRunner
from engine.swarm.store import Store
from engine.swarm.weight_votes import WeightAuthority, weights_digest
from tests.support.hostile_node import ServesRandomWeights, claim_honest_digest
from tests.support.memory_wire import MemoryWire

LIAR, A, B = "aaaa-liar", "bbbb-honest", "cccc-honest"  # the liar sorts first
SHAPES = {"model.layers.0.mlp.up_proj.weight": (24, 16), "model.layers.0.input_layernorm.weight": (16,)}


# ---------------------------------------------------------------- the vote
def test_weights_digest_sees_every_bit_of_every_tensor():
    rng = np.random.default_rng(0)
    w = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    same = {n: a.copy() for n, a in w.items()}
    assert weights_digest(w) == weights_digest(same)
    flipped = {n: a.copy() for n, a in w.items()}
    flipped["model.layers.0.mlp.up_proj.weight"].view(np.uint32)[7, 3] ^= 1  # one low bit, far from a sample
    assert weights_digest(flipped) != weights_digest(w)
    renamed = {"x" + n: a for n, a in w.items()}
    assert weights_digest(renamed) != weights_digest(w)


def test_the_leader_is_the_earliest_admitted_and_the_majority_not_the_smallest_id_decides():
    auth = WeightAuthority(evict_after=2)
    trainers = [(2.0, "0000-keygen-winner"), (1.0, "zzzz-first")]
    assert auth.leader(0, trainers) == "zzzz-first"  # generating a small id wins nothing
    vote = auth.vote(0, {"0000-keygen-winner": "aa" * 16, "zzzz-first": "bb" * 16})
    # two cannot tell by count: before any majority the named leader is the incumbent, never the keygen winner
    assert vote.majority == "bb" * 16 and vote.resync == [("0000-keygen-winner", "zzzz-first")]
    assert auth.counters["incumbent_decisions"] == 1 and auth.counters["splits"] == 0
    trainers.append((3.0, "mmmm-third"))
    vote = auth.vote(0, {"0000-keygen-winner": "aa" * 16, "zzzz-first": "bb" * 16, "mmmm-third": "aa" * 16})
    assert vote.majority == "aa" * 16 and vote.resync == [("zzzz-first", "0000-keygen-winner")]
    assert auth.leader(0, trainers) == "0000-keygen-winner"  # the outvoted leader loses the lead
    vote = auth.vote(0, {"0000-keygen-winner": "cc" * 16, "zzzz-first": "bb" * 16, "mmmm-third": "cc" * 16})
    assert vote.evict == ["zzzz-first"]  # outvoted twice in a row: it ignored its resync


def test_a_trainer_that_joined_behind_a_lone_incumbent_is_resynced_from_it_and_cannot_take_the_stage_over():
    """A trainer that finished loading after training began holds weights versions old: with two
    replicas no vote has a strict majority, so without this it split every vote for good."""
    auth = WeightAuthority(evict_after=3)
    for version in (1, 2, 3):  # the incumbent trained alone
        assert auth.vote(0, {"incumbent": f"{version:02d}" * 16}, version).majority == f"{version:02d}" * 16
    vote = auth.vote(0, {"incumbent": "04" * 16, "late-joiner": "00" * 16}, 4)
    assert vote.majority == "04" * 16 and vote.resync == [("late-joiner", "incumbent")]
    assert auth.counters["incumbent_decisions"] == 1 and auth.counters["splits"] == 0
    # once in the majority both are incumbents: a later disagreement between them decides nothing
    assert auth.vote(0, {"incumbent": "05" * 16, "late-joiner": "05" * 16}, 5).majority == "05" * 16
    vote = auth.vote(0, {"incumbent": "06" * 16, "late-joiner": "66" * 16}, 6)
    assert vote.majority is None and not vote.resync and auth.counters["splits"] == 1


def test_a_refusal_counts_only_for_the_sync_sent_and_two_followers_evict():
    auth = WeightAuthority()
    h, x = "11" * 16, "22" * 16
    trainers = [(1.0, "liar"), (2.0, "f1"), (3.0, "f2"), (4.0, "ok")]
    assert auth.leader(0, trainers) == "liar"
    assert auth.refused("liar", "f1") is False and auth.counters["refusals_ignored"] == 1  # never sent there
    assert auth.leader(0, trainers) == "liar"
    assert auth.vote(0, {"liar": h, "f1": x, "f2": x, "ok": h, "ok2": h}).resync == [("f1", "liar"), ("f2", "liar")]
    assert auth.refused("liar", "f1") is False  # one follower's word: the lead goes, no eviction
    assert auth.leader(0, trainers) == "ok"
    assert auth.refused("liar", "f2") is True
    vote = auth.vote(0, {"liar": h, "f1": x, "f2": h, "ok": h})
    assert vote.resync == [("f1", "ok")]  # never sent back to the one it refused


def test_an_inference_replicas_full_load_that_misses_the_majority_costs_the_leader_its_lead():
    auth = WeightAuthority()
    h, x = "11" * 16, "22" * 16
    trainers = [(1.0, "lead"), (2.0, "ok1"), (3.0, "ok2")]
    assert auth.leader(0, trainers) == "lead"
    auth.vote(0, {"lead": h, "ok1": h, "ok2": h}, version=5)
    assert auth.served(0, 5, h, "lead") and auth.served(0, 4, x, "lead")  # agrees / no vote to check against
    assert not auth.served(0, 5, x, "lead") and auth.counters["served_mismatch"] == 1
    assert auth.leader(0, trainers) == "ok1"


# ---------------------------------------------------------------- a 3-replica stage end to end
class SeededRuntime:
    """A stage runtime that is named fp32 tensors; node ``seed``'s gradient at each version is seeded."""

    tied_names = ()

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(1234)
        self.weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
        self.version, self.seed = 0, seed
        self.backend = object()
        self.model_config = SimpleNamespace(to_hf_dict=lambda: {"model_type": "llama"})

    def state_dict(self):
        return {n: w.copy() for n, w in self.weights.items()}

    def snapshot(self):
        return self.state_dict(), self.version

    def snapshot_with_moments(self):  # plain SGD steps: AdamW moments of zeros travel with the weights
        moments = {}
        for n, w in self.weights.items():
            moments.update({f"{n}.exp_avg": np.zeros_like(w), f"{n}.exp_avg_sq": np.zeros_like(w),
                            f"{n}.step": np.float32(self.version)})
        return self.state_dict(), self.version, moments

    def load_optimizer_state(self, moments):
        self.moments_loaded = moments

    def shapes(self):
        return {n: w.shape for n, w in self.weights.items()}

    def set_weights(self, weights, version):
        self.weights = {n: np.array(weights[n], np.float32) for n in self.weights}
        self.version = version

    def checksum(self):
        return tensor_bundle.checksum(self.weights)

    def grads(self):
        rng = np.random.default_rng([self.seed, self.version])
        return {n: rng.standard_normal(w.shape).astype(np.float32) for n, w in sorted(self.weights.items())}

    def apply(self, agg, max_grad_norm, version, tied_norm=None):
        self.weights = {n: (w - np.float32(0.01) * agg[n]).astype(np.float32) for n, w in self.weights.items()}
        self.version = version
        return 1.0


class NodeSocket:
    """The coordinator's websocket to a node: the text is decoded and handed to the node."""

    def __init__(self, node: Node) -> None:
        self.node, self.closed = node, False

    async def send_str(self, text: str) -> None:
        self.node.on_coordinator(messages.decode_from_coordinator(text))

    async def close(self) -> None:
        self.closed = True


class ToCoordinator:
    """A node's ``CoordinatorSender``: its ``stepped`` and ``weights_refused`` reach the real parts."""

    def __init__(self, peer: str, swarm: SimpleNamespace) -> None:
        self.peer, self.swarm = peer, swarm

    async def send(self, message) -> None:
        m = messages.decode_from_node(messages.encode(message))
        if isinstance(m, messages.Stepped):
            self.swarm.steps.on_stepped(self.peer, m)
        elif isinstance(m, messages.WeightsRefused):
            await self.swarm.members.weights_refused(self.peer, m.source, m.version)


async def _quiet(nodes, timeout_s: float = 20.0) -> None:
    deadline, calm = time.monotonic() + timeout_s, 0
    while calm < 5:
        assert time.monotonic() < deadline, "the nodes did not settle"
        await asyncio.sleep(0.005)
        calm = calm + 1 if all(not n.ctx.tasks.pending() for n in nodes) else 0


def _stage_of_three(tmp_path, liar: str | None) -> SimpleNamespace:
    """Coordinator parts and three real nodes of one stage; ``liar``: None, "own" or "honest" digest."""
    codec = TaskCodec.from_dir(base_checkpoint_dir())
    run = RunConfig(update_encoding="fp32", checkpoint_every_versions=1000)
    store = Store(tmp_path / f"c-{liar}.db")
    members = Membership(1)
    swarm = SimpleNamespace(members=members, store=store, wire=MemoryWire(), nodes={})
    swarm.steps = StepRunner(run, UpdateRules(), DigitRunTask(make_task(run.task), codec), store, RunBook(store),
                             EvalScheduler(DigitRunTask(make_task(run.task), codec), store), members,
                             step_timeout_s=10.0)
    for admitted, (peer, seed) in enumerate(((LIAR, 0), (A, 1), (B, 2))):
        node = Node(NodeConfig("http://127.0.0.1:9", share_timeout_s=10.0), SimpleNamespace(peer_id=peer),
                    peers=swarm.wire.sender(peer), coordinator=ToCoordinator(peer, swarm))
        swarm.wire.attach(peer, node.on_peer)
        node.ctx.stage.rt = SeededRuntime(seed)
        if peer == LIAR and liar is not None:
            node.ctx.stage.rt = ServesRandomWeights(node.ctx.stage.rt)
            if liar == "honest":
                claim_honest_digest(node)
        node.ctx.stage.spec, node.ctx.stage.run_cfg = StageSpec(0, 1, 0, 1), run
        node.ctx.membership.update([[LIAR, A, B]], [])
        node.replicas.new_weights(fresh=True)
        swarm.nodes[peer] = node
        members.sessions[peer] = NodeSession(peer, NodeSocket(node), "torch", "cpu", stage=0, ready=True,
                                             joined=float(admitted))
    return swarm


def _run(tmp_path, liar: str | None, steps: int, drift_b_at: int | None = None,
         third_leaves_at: int | None = None) -> SimpleNamespace:
    """``steps`` optimiser steps; B's weights drift before step ``drift_b_at``; in a clean run the
    third replica leaves before ``third_leaves_at`` (where an attacked run evicted the liar)."""
    swarm = _stage_of_three(tmp_path, liar)
    nodes = list(swarm.nodes.values())

    async def scenario():
        for step in range(steps):
            if step == drift_b_at:  # one honest replica drifts (a fault): it must be resynced, from whom?
                rt = swarm.nodes[B].ctx.stage.rt
                rt.weights = {n: w + np.float32(1e-3) for n, w in rt.weights.items()}
            if step == third_leaves_at:
                swarm.members.sessions[LIAR].ready = False
            assert await swarm.steps._apply(step)
            await _quiet(nodes)

    async def bounded():
        try:
            await asyncio.wait_for(scenario(), 120)
        finally:
            for node in nodes:
                await node.ctx.tasks.cancel_all()
                node.compute.stop()
            swarm.store.close()
    asyncio.run(bounded())
    return swarm


def _bits(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[n].view(np.uint32), b[n].view(np.uint32)) for n in a)


def _weights(swarm, peer: str) -> dict:
    rt = swarm.nodes[peer].ctx.stage.rt
    return getattr(rt, "inner", rt).weights


@pytest.mark.parametrize("lie", ["own", "honest"])
def test_a_lowest_id_replica_serving_random_weights_cannot_steer_the_two_honest_ones(tmp_path, lie):
    """``own``: it reports the digest of what it serves (the old rules resynced the others to it), is
    outvoted at every step, ignores its resyncs and is evicted at the third vote; the clean run's
    third replica leaves there too. ``honest``: it reports the honest digest, so no vote can see it;
    a drifted honest replica told to fetch from it (the first admitted, so the leader) refuses what
    it sends, and the lead and the resync go to an honest replica."""
    drift, leaves = (None, 3) if lie == "own" else (2, None)
    clean = _run(tmp_path, None, steps=6, drift_b_at=drift, third_leaves_at=leaves)
    attacked = _run(tmp_path, lie, steps=6, drift_b_at=drift)
    for peer in (A, B):  # the honest two: bit-identical to the clean run at every tensor
        assert attacked.nodes[peer].ctx.stage.rt.version == 6
        assert _bits(_weights(attacked, peer), _weights(clean, peer))
    assert _bits(_weights(clean, A), _weights(clean, B))
    auth, liar_session = attacked.members.authority, attacked.members.sessions[LIAR]
    assert attacked.members.leader(0) == A  # the first admitted honest replica, named by the votes
    if lie == "own":
        assert auth.counters["evicted"] == 1 and liar_session.ws.closed and not liar_session.ready
        assert auth.counters["resyncs"] == 2 and clean.members.authority.counters["resyncs"] == 0
    else:
        assert auth.counters["refused_transfers"] == 1 and LIAR in auth.distrusted
        assert any("majority" in r for r in attacked.wire.strikes[(B, LIAR)])
        assert auth.counters["resyncs"] == 2 and clean.members.authority.counters["resyncs"] == 1
        assert attacked.nodes[LIAR].ctx.membership.leader_of(0) == A  # announced in 'members'
