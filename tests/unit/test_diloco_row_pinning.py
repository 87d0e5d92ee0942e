"""Under DiLoCo a row trains on the route whose weights gave its proximal log-probs.

Between syncs every replica of a stage is its own policy, so ``u = exp(logp - p)`` is only the
update's own ratio when ``logp`` and ``p`` come from the same route. Real micro-batch
dispatcher over a recording 2 stages x 2 replicas outbox; real ``pin_rows``.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np

from engine.rl.batch import TrainBatch
from engine.swarm import messages
from engine.swarm.microbatches import MicrobatchDispatcher
from engine.swarm.step_runner import lineage_routes, pin_rows, spread_by_generator
from tests.support.recording_links import RecordingLinks

ROUTE_A, ROUTE_B = ("a0", "b0"), ("a1", "b1")


def _batch(rows: int) -> TrainBatch:
    ids = np.arange(rows, dtype=np.int64)[:, None].repeat(3, axis=1)  # row i holds token i: traceable
    return TrainBatch(inputs=ids, targets=ids, mask=np.ones((rows, 3), bool),
                      behaviour=np.full((rows, 3), -1.0, np.float32), advantages=np.ones(rows, np.float32),
                      staleness=np.zeros(rows, np.int64))


def _answering_dispatcher(links: RecordingLinks, micro_batch_rows: int) -> MicrobatchDispatcher:
    dispatcher = MicrobatchDispatcher(links, Counter(), micro_batch_rows=micro_batch_rows, timeout_s=10.0,
                                      mb_timeout_s=5.0)

    def answer(peer, message):
        if isinstance(message, messages.TrainOut):
            asyncio.get_running_loop().call_soon(dispatcher.on_mb_done, message.route[0],
                                                 messages.MbDone(step=message.step, mb=message.mb))
    links.on_send = answer
    return dispatcher


def test_pin_rows_orders_each_mini_batch_by_route_and_keeps_every_row_with_its_proximal_log_probs():
    mini = _batch(5)
    prox = np.arange(15, dtype=np.float32).reshape(5, 3)
    routes = [ROUTE_B, ROUTE_A, ROUTE_B, ROUTE_A, ROUTE_A]
    batches, proximal, pinned = pin_rows([mini], [prox], [routes])
    assert pinned[0] == [ROUTE_A] * 3 + [ROUTE_B] * 2
    rows = batches[0].inputs[:, 0].tolist()
    assert sorted(rows) == [0, 1, 2, 3, 4] and [routes[r] for r in rows] == pinned[0]
    assert np.array_equal(proximal[0], prox[rows])  # each row's p moved with it


def test_pinned_rows_are_sent_to_their_route_and_a_gone_route_falls_back_to_a_healthy_one():
    links = RecordingLinks.grid([["a0", "a1"], ["b0", "b1"]])
    dispatcher = _answering_dispatcher(links, micro_batch_rows=8)
    pins = [ROUTE_A, ROUTE_B, ROUTE_B, ROUTE_B, ROUTE_B]

    def sent_rows() -> dict[tuple[str, ...], list[int]]:
        out: dict[tuple[str, ...], list[int]] = {}
        for _, m in links.sent:
            if isinstance(m, messages.TrainIn):
                out.setdefault(tuple(m.route), []).extend(row[0] for row in m.inputs)
        return out

    assert asyncio.run(dispatcher.run(0, _batch(5), None, pinned=pins)) == []
    assert sent_rows() == {ROUTE_A: [0], ROUTE_B: [1, 2, 3, 4]}
    # unpinned, a fresh dispatcher splits the rows evenly whatever route their p came from:
    links.sent.clear()
    assert asyncio.run(_answering_dispatcher(links, micro_batch_rows=8).run(1, _batch(5), None)) == []
    assert sent_rows() != {ROUTE_A: [0], ROUTE_B: [1, 2, 3, 4]}
    dispatcher = _answering_dispatcher(links, micro_batch_rows=8)

    links.evict("a1", "test")  # route B is gone: its rows go to a route that is left
    links.sent.clear()
    assert asyncio.run(dispatcher.run(2, _batch(5), None, pinned=pins)) == []
    sent = sent_rows()
    assert sent[ROUTE_A][:1] == [0] and sorted(r for rows in sent.values() for r in rows) == [0, 1, 2, 3, 4]
    assert set(sent) <= {tuple(r) for r in links.routes()} and ROUTE_B not in sent


def test_a_rows_lineage_route_is_the_live_route_ending_at_its_generator_unless_the_audit_already_ran_there():
    routes = [["a0", "b0"], ["a1", "b1"]]
    gens = ["b0", "b1", None, "b9", "b0"]
    audited = [ROUTE_B, ROUTE_A, ROUTE_A, ROUTE_A, ROUTE_A]
    assert lineage_routes(gens, audited, routes) == [ROUTE_A, ROUTE_B, None, None, None]


def test_spreading_a_batch_by_generator_gives_every_cut_of_it_each_generators_share():
    # a buffer in arrival order: a job of 6 groups from b1, then 2 from b0, then 4 from b1 and 4 from b0
    generators = [["b1"] * 4] * 6 + [["b0"] * 4] * 2 + [["b1"] * 4] * 4 + [["b0"] * 4] * 4
    order = spread_by_generator(generators)
    assert sorted(order) == list(range(len(generators)))  # a permutation: no group lost or doubled
    for gen in ("b0", "b1"):  # each generator's groups keep their age order
        own = [g for g in order if generators[g][0] == gen]
        assert own == sorted(own)
    for cut in np.array_split(np.array(order), 4):  # the planner's mini-batches: contiguous cuts
        counts = Counter(generators[g][0] for g in cut)
        assert counts["b1"] in (2, 3) and counts["b0"] in (1, 2), counts
    in_arrival_order = np.array_split(np.arange(len(generators)), 4)  # what it replaces: one-route cuts
    assert any(len({generators[g][0] for g in cut}) == 1 for cut in in_arrival_order)
