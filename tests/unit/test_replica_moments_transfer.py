"""A trainer that joins a stage which has stepped, or is resynced, takes the same next step as its siblings.

Weights alone are not enough: AdamW's moments decide the step. Real torch nodes wired in memory
(``tests.support.memory_wire``) step together, a third joins from a replica (or one is resynced
after its moments went astray), and after the next step all hold the very same bits. The bundle
format (``engine.swarm.adamw_transfer``) refuses partial or invalid moments before installing any.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.net.errors import ProtocolViolation
from engine.swarm import adamw_transfer, messages
from engine.swarm.node import Node
from engine.swarm.run_config import RunConfig
from tests.support.memory_wire import MemoryWire

A, B, C = "peer0000", "peer1111", "peer2222"
INPUTS = {A: [[1, 5, 6, 9, 11], [1, 7, 8, 10, 12]], B: [[1, 9, 8, 7, 6], [1, 12, 11, 10, 5]],
          C: [[1, 6, 5, 9, 11], [1, 8, 7, 10, 12]]}
TARGETS = {p: [row[1:] + [2] for row in rows] for p, rows in INPUTS.items()}
MASK = [[False, False, True, True, True]] * 2


# ---------------------------------------------------------------------------- the bundle format

def _shapes() -> dict[str, tuple[int, ...]]:
    return {"b.weight": (3, 2), "a.bias": (4,)}


def _moments(step: float = 5.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for name, shape in _shapes().items():
        out[f"{name}.exp_avg"] = rng.standard_normal(shape).astype(np.float32)
        out[f"{name}.exp_avg_sq"] = rng.random(shape).astype(np.float32)
        out[f"{name}.step"] = np.asarray(step, np.float32)
    return out


def test_moments_travel_as_three_flat_tensors_and_come_back_exactly():
    weights = {n: np.ones(s, np.float32) for n, s in _shapes().items()}
    bundle, attached = adamw_transfer.attach(weights, _moments(), max_bytes=1 << 20)
    assert attached and len(bundle) == len(weights) + 3
    assert {n: a.shape for n, a in bundle.items() if n.startswith("adamw:")} == \
        adamw_transfer.expected_shapes(_shapes())
    got_weights, got = adamw_transfer.split(bundle, _shapes(), "sender")
    assert set(got_weights) == set(weights)
    assert all(np.array_equal(got[k], v) for k, v in _moments().items()) and set(got) == set(_moments())


def test_moments_too_large_for_one_message_are_left_out_and_weights_go_alone():
    weights = {n: np.ones(s, np.float32) for n, s in _shapes().items()}
    bundle, attached = adamw_transfer.attach(weights, _moments(), max_bytes=64)
    assert not attached and set(bundle) == set(weights)
    assert adamw_transfer.split(bundle, _shapes(), "sender")[1] is None


@pytest.mark.parametrize("spoil", ["missing", "negative", "nan", "fractional_step"])
def test_partial_or_invalid_moments_are_refused_as_a_protocol_violation(spoil):
    weights = {n: np.ones(s, np.float32) for n, s in _shapes().items()}
    bundle, _ = adamw_transfer.attach(weights, _moments(), max_bytes=1 << 20)
    if spoil == "missing":
        del bundle["adamw:step"]
    elif spoil == "negative":
        bundle["adamw:exp_avg_sq"] = -bundle["adamw:exp_avg_sq"] - 1
    elif spoil == "nan":
        bundle["adamw:exp_avg"] = bundle["adamw:exp_avg"] * np.nan
    else:
        bundle["adamw:step"] = bundle["adamw:step"] + 0.5
    with pytest.raises(ProtocolViolation, match="AdamW moments from mallory"):
        adamw_transfer.split(bundle, _shapes(), "mallory")


# ---------------------------------------------------------------------------- real nodes

def _welcome(run: RunConfig, source: str = "checkpoint", source_peer: str | None = None) -> dict:
    return {"type": "welcome", "stage": 0, "num_stages": 1, "layer_start": 0, "layer_end": 2, "num_layers": 2,
            "source": source, "source_peer": source_peer, "stage_checkpoint": None, "version": 0,
            "run": run.to_dict(), "run_id": "run-moments", "signal_url": "ws://127.0.0.1:9/s"}


async def _step(nodes: dict[str, Node], step: int, run: RunConfig, behaviour: dict) -> None:
    from tests.unit.test_node_pipeline import _send, _sent, _until

    for peer, node in nodes.items():  # each replica trains on its own micro-batch
        _send(node, {"type": "train_in", "step": step, "mb": 0, "route": [peer], "inputs": INPUTS[peer]})
        _send(node, {"type": "train_out", "step": step, "mb": 0, "route": [peer], "targets": TARGETS[peer],
                     "mask": MASK, "behaviour": behaviour[peer], "advantages": [1.0, -1.0], "normaliser": 12.0})
    stepped = {p: len(_sent(n, messages.Stepped)) for p, n in nodes.items()}
    for peer, node in nodes.items():
        await _until("mb_done", lambda n=node, d=stepped[peer]: len(_sent(n, messages.MbDone)) > d)
    for node in nodes.values():
        _send(node, {"type": "apply", "step": step, "version": step + 1, "replicas": sorted(nodes),
                     "checkpoint": False})
    for peer, node in nodes.items():
        await _until("stepped", lambda n=node, d=stepped[peer]: len(_sent(n, messages.Stepped)) > d)


def _same(x: dict[str, np.ndarray], y: dict[str, np.ndarray]) -> bool:
    return set(x) == set(y) and all(np.array_equal(x[n], y[n]) for n in x)


@pytest.mark.parametrize("how", ["joins", "resynced"])
def test_a_trainer_that_joins_or_is_resynced_takes_the_same_next_step_as_its_siblings(how):
    pytest.importorskip("torch")
    from tests.unit.test_node_pipeline import _node, _run, _send, _sent, _until

    run = RunConfig(lr=1e-2, activation_encoding="fp32")
    wire = MemoryWire()
    nodes: list[Node] = []
    result: dict[str, object] = {}

    async def scenario():
        a, b = _node(A, wire), _node(B, wire)
        nodes.extend([a, b])
        for node in (a, b):
            await node.start_compute()
            _send(node, {"type": "members", "stages": [[A, B]], "version": 0})
            _send(node, _welcome(run))
        await _until("both replicas ready", lambda: _sent(a, messages.Ready) and _sent(b, messages.Ready))
        behaviour = {p: (await a.compute.run(a.rt.prox_logprobs, np.asarray(INPUTS[p]), np.asarray(TARGETS[p]),
                                             run.sampling.temperature)).tolist() for p in (A, B, C)}
        for step in range(3):
            await _step({A: a, B: b}, step, run, behaviour)
        if how == "joins":
            c = _node(C, wire)
            nodes.append(c)
            await c.start_compute()
            for node in (a, b, c):
                _send(node, {"type": "members", "stages": [[A, B, C]], "version": 3})
            _send(c, _welcome(run, source="peer", source_peer=A))
            await _until("the joiner is ready", lambda: _sent(c, messages.Ready))
            stepping = {A: a, B: b, C: c}
        else:  # b's moments go astray (as after a resync with weights alone), then it is resynced from a
            moments = await b.compute.run(b.rt.backend.optimizer_state)
            await b.compute.run(b.rt.load_optimizer_state, {k: np.zeros_like(v) for k, v in moments.items()})
            weights = await b.compute.run(b.rt.state_dict)
            await b.compute.run(b.rt.set_weights, {n: w + 1.0 for n, w in weights.items()}, 3)
            _send(b, {"type": "sync", "source_peer": A})
            await _until("resynced", lambda: np.array_equal(b.rt.state_dict()["model.norm.weight"],
                                                             a.rt.state_dict()["model.norm.weight"]))
            stepping = {A: a, B: b}
        result["before"] = {p: await n.compute.run(n.rt.state_dict) for p, n in stepping.items()}
        result["moments"] = {p: await n.compute.run(n.rt.backend.optimizer_state) for p, n in stepping.items()}
        await _step(stepping, 3, run, behaviour)
        result["after"] = {p: await n.compute.run(n.rt.state_dict) for p, n in stepping.items()}
        result["strikes"] = dict(wire.strikes)

    _run(scenario, nodes)
    late = C if how == "joins" else B
    assert _same(result["before"][A], result["before"][late])  # it starts from A's weights...
    assert _same(result["moments"][A], result["moments"][late])  # ...and A's moments (step counts too)
    assert float(result["moments"][late]["model.norm.weight.step"]) == 3.0
    after = result["after"]
    assert not _same(after[A], result["before"][A])  # the step moved the weights
    assert all(_same(after[A], after[p]) for p in after)  # and every replica holds the same bits
    assert not result["strikes"]
