"""Two real nodes (torch, the shipped base, links in memory) on a ``basis`` activation scheme."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from engine.swarm import messages
from engine.swarm.boundary_basis import BoundaryCodec
from engine.swarm.run_config import RunConfig
from tests.support.memory_wire import MemoryWire
from tests.unit.test_node_pipeline import P0, P1, P2, PARAMS, _node, _run, _send, _sent, _until, _welcome

pytest.importorskip("torch")


def _basis_welcome(stage: int, scheme: str = "basis_r8") -> dict:
    return dict(_welcome(stage), run=RunConfig(activation_encoding=scheme).to_dict())


def _spy_on_encode(codec: BoundaryCodec, kind: str | None = None) -> tuple[list[dict], Callable[..., tuple]]:
    """(the headers ``codec`` encodes from now on, of ``kind`` or all; its real encode)."""
    headers: list[dict] = []
    real_encode = codec.encode

    def spy(*args, **kwargs):
        header, payload = real_encode(*args, **kwargs)
        if kind is None or args[0] == kind:
            headers.append(header)
        return header, payload
    codec.encode = spy  # type: ignore[method-assign]
    return headers, real_encode


async def _start_two(wire: MemoryWire, nodes: list, scheme: str, spy_kind: str | None = None, spy_last: bool = False):
    """Stage 0 on P0 (its first job calibrates its basis), stage 1 on P1, both ready; P2 a stage-0 member
    that runs no node. Returns (first, last, headers the spied node encodes, its real encode)."""
    first, last = _node(P0, wire), _node(P1, wire)
    nodes.extend([first, last])
    first.ctx.boundary = BoundaryCodec(calibration_rows=4)
    headers, real_encode = _spy_on_encode((last if spy_last else first).ctx.boundary, spy_kind)
    for node in nodes:
        await node.start_compute()
        _send(node, {"type": "members", "stages": [[P0, P2], [P1]], "version": 0})
    for stage, node in enumerate(nodes):
        _send(node, _basis_welcome(stage, scheme))
    await _until("both stages ready", lambda: _sent(first, messages.Ready) and _sent(last, messages.Ready))
    return first, last, headers, real_encode


def test_nodes_send_the_basis_once_then_coefficients_and_strike_a_sender_naming_one_never_sent():
    wire = MemoryWire()
    nodes: list = []

    async def scenario():
        first, last, sent_headers, real_encode = await _start_two(wire, nodes, "basis_r8")
        for job in ("g1", "g2"):
            _send(first, {"type": "gen", "job": job, "route": [P0, P1], "prompt_ids": [[1, 5, 6], [1, 7, 8]],
                          "params": PARAMS})
            await _until(f"{job} done", lambda j=job: [d for d in _sent(last, messages.GenDone) if d.job == j])
        inline = [h["params"]["inline"] for h in sent_headers]
        assert all(h["encoding"] == "basis" for h in sent_headers) and inline[0] and not any(inline[1:])
        assert not wire.strikes[(P1, P0)]

        # P2 (a stage-0 member) names P0's basis, which P1 holds from P0 only: refused, a strike against P2
        header, payload = real_encode("act", np.ones((2, 3, 64), np.float32), "basis_r8", P1)
        assert header["params"]["inline"] is False
        await wire.send(P2, P1, messages.Act(kind="gen", job="g3", route=[P2, P1], hop=1, versions=[0],
                                             tensor=header, step=0, mb=0, params=PARAMS), payload)
        assert "never received" in wire.strikes[(P1, P2)][0]

    _run(scenario, nodes)


def test_a_projected_gradient_scheme_trains_through_two_nodes_in_the_first_stages_own_basis():
    wire = MemoryWire()
    nodes: list = []

    async def scenario():
        first, last, grads, _ = await _start_two(wire, nodes, "basis_r128_gp", spy_kind="grad", spy_last=True)
        route = [P0, P1]
        _send(first, {"type": "gen", "job": "g1", "route": route, "prompt_ids": [[1, 5, 6], [1, 7, 8]],
                      "params": PARAMS})
        await _until("gen done", lambda: _sent(last, messages.GenDone))
        _send(first, {"type": "train_in", "step": 0, "mb": 0, "route": route, "inputs": [[1, 5, 6, 9], [1, 7, 8, 10]]})
        _send(last, {"type": "train_out", "step": 0, "mb": 0, "route": route, "targets": [[5, 6, 9, 2], [7, 8, 10, 2]],
                     "mask": [[False, True, True, True]] * 2, "behaviour": [[-1.0] * 4] * 2,
                     "advantages": [1.0, -1.0], "normaliser": 6.0})
        await _until("mb_done", lambda: _sent(first, messages.MbDone))
        own = first.ctx.boundary._own.latest()
        assert own is not None and [(g["encoding"], g["params"]["id"], g["params"]["centred"]) for g in grads] == \
            [("basis", own.basis_id, False)]
        assert not wire.strikes[(P0, P1)] and not wire.strikes[(P1, P0)]

    _run(scenario, nodes)


def test_a_token_predicted_scheme_sends_the_first_stages_token_ids_and_both_nodes_hold_the_bases_table():
    wire = MemoryWire()
    nodes: list = []

    async def scenario():
        first, last, sent_headers, _ = await _start_two(wire, nodes, "predicted_r128_gs64_b4", spy_kind="act")
        for job in ("g1", "g2"):
            _send(first, {"type": "gen", "job": job, "route": [P0, P1], "prompt_ids": [[1, 5, 6], [1, 7, 8]],
                          "params": PARAMS})
            await _until(f"{job} done", lambda j=job: [d for d in _sent(last, messages.GenDone) if d.job == j])
        tables = [node.ctx.boundary.token_table for node in (first, last)]
        assert tables[0] is not None and tables[1] is not None and tables[0].table_id == tables[1].table_id
        assert all(h["encoding"] == "basis" and h["params"]["tokens"] == 2 for h in sent_headers)
        assert [h["params"]["inline"] for h in sent_headers].count(True) == 1
        assert not wire.strikes[(P1, P0)]

    _run(scenario, nodes)
