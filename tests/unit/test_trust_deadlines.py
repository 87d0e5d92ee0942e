"""Finding 2 of issue 14: a trainer that ignores ``train_in`` costs a micro-batch deadline, not the step.

Real micro-batch dispatcher and route health; the swarm is a recording outbox (2 stages x 2
replicas) whose honest nodes answer as nodes do (``mb_loss`` from the last stage, ``mb_done``
from the first), and one node that never answers.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import numpy as np

from engine.rl.batch import TrainBatch
from engine.swarm import messages
from engine.swarm.microbatches import MicrobatchDispatcher
from engine.swarm.route_health import RouteHealth
from tests.support.recording_links import RecordingLinks

GRID = [["a0", "a1"], ["b0", "b1"]]
MB_TIMEOUT_S = 0.3
STEP_TIMEOUT_S = 30.0


def _batch(rows: int = 4, width: int = 3) -> TrainBatch:
    return TrainBatch(inputs=np.ones((rows, width), np.int64), targets=np.ones((rows, width), np.int64),
                      mask=np.ones((rows, width), bool), behaviour=np.full((rows, width), -1.0, np.float32),
                      advantages=np.ones(rows, np.float32), staleness=np.zeros(rows, np.int64))


def _swarm(silent: set[str], grid: list[list[str]] = GRID,
           with_loss: bool = True) -> tuple[RecordingLinks, MicrobatchDispatcher, Counter]:
    """Honest nodes answer every micro-batch of a route with no silent node on it (``mb_done``,
    and the last stage's ``mb_loss`` first when ``with_loss``)."""
    links, counters = RecordingLinks.grid(grid), Counter()
    dispatcher = MicrobatchDispatcher(links, counters, micro_batch_rows=2, timeout_s=STEP_TIMEOUT_S,
                                      mb_timeout_s=MB_TIMEOUT_S)

    def answer(peer, message):
        if not isinstance(message, messages.TrainOut) or silent & set(message.route):
            return
        loop = asyncio.get_running_loop()
        first, last = message.route[0], message.route[-1]
        if with_loss:
            loop.call_soon(dispatcher.on_mb_loss, last, messages.MbLoss(step=message.step, mb=message.mb, loss=0.0,
                                                                        tokens=1, masked_fraction=0.0, ess=1.0,
                                                                        clipped_fraction=0.0))
        loop.call_soon(dispatcher.on_mb_done, first, messages.MbDone(step=message.step, mb=message.mb))
    links.on_send = answer
    return links, dispatcher, counters


def test_with_no_misses_the_routes_are_the_membership_routes_and_suspects_are_spread():
    links = RecordingLinks.grid([["a0", "a1", "a2"], ["b0", "b1", "b2"]])
    health = RouteHealth(links, Counter())
    assert health.routes() == links.routes()
    health.misses.update({"a0": 1, "b0": 1})  # they shared the route that missed
    assert health.routes() == [["a0", "b1"], ["a1", "b0"], ["a2", "b2"]]  # never again on one route
    assert health.retry_route(["a0", "b0"], 0) and not {"a0", "b0"} & set(health.retry_route(["a0", "b0"], 0))


def test_a_trainer_that_ignores_train_in_costs_one_micro_batch_deadline_and_is_evicted_on_its_second():
    links, dispatcher, counters = _swarm(silent={"a0"})

    async def passes():
        seconds = []
        for step in range(3):
            started = time.monotonic()
            assert await dispatcher.run(step, _batch(), None) == []  # every pass completes
            seconds.append(time.monotonic() - started)
        return seconds
    seconds = asyncio.run(passes())
    assert links.evicted and [p for p, _ in links.evicted] == ["a0"]  # the honest b0 it was paired with stays
    assert "missed 2 deadlines" in links.evicted[0][1]
    assert counters["missed_deadlines"] == 2 and counters["evicted_trainers"] == 1
    # each of the first two passes waited one micro-batch deadline (not the step's); the third none
    assert all(MB_TIMEOUT_S <= s < 3 * MB_TIMEOUT_S for s in seconds[:2]), seconds
    assert seconds[2] < MB_TIMEOUT_S, seconds
    assert dispatcher.health.misses == Counter()  # b0 and b1 were cleared by their next micro-batches


def test_a_late_micro_batch_whose_loss_came_back_blames_only_the_stages_before_the_last():
    links, counters = RecordingLinks.grid(GRID), Counter()
    health = RouteHealth(links, counters)
    health.answered(["b1"])  # b1 is known to work: a miss beside it can only be a0's (once b1 answers again)
    assert health.missed(["a0", "b0"], "test", cleared=["b0"]) == []
    assert health.misses == Counter({"a0": 1})
    assert health.missed(["a0", "b1"], "test") == [] and not links.evicted
    assert sorted(health.routes()) == [["a1", "b0"], ["a1", "b1"]]  # a0, awaiting conviction, serves no route
    health.answered(["a1", "b1"])
    assert [p for p, _ in links.evicted] == ["a0"] and health.misses == Counter()


def test_suspects_get_routes_of_their_own_when_the_stages_are_of_different_widths():
    """Two of a 3-replica stage 1 missed with two of a 4-replica stage 0: a clean stage-1 trainer
    takes each stage-0 suspect, clean stage-0 trainers take the stage-1 suspects (the shifted
    columns of before put a0 with b1 on one route), and every trainer still serves."""
    links = RecordingLinks.grid([["a0", "a1", "a2", "a3"], ["b0", "b1", "b2"]])
    health = RouteHealth(links, Counter())
    health.misses.update({"a0": 1, "a1": 1, "b1": 1, "b2": 1})
    routes = health.routes()
    assert all(sum(1 for p in route if health.misses[p]) == 1 for route in routes), routes
    assert {p for route in routes for p in route} == {p for ids in links.stages for p in ids}


def test_a_trainer_known_to_work_is_not_evicted_for_misses_beside_two_silent_newcomers():
    """Hostile nodes that join together have never completed a micro-batch: an honest trainer paired
    with one and then another shares two misses, but neither miss was surely its own. A newcomer
    is evicted by a second miss beside a trainer that vouched for itself."""
    links, counters = RecordingLinks.grid([["a0", "a1"], ["b0", "b1", "b2"]]), Counter()
    health = RouteHealth(links, counters)
    health.answered(["a0", "a1", "b0"])  # the swarm before the newcomers b1, b2
    assert health.missed(["a0", "b1"], "test") == []
    assert health.missed(["a0", "b2"], "test") == []  # a0 has 2 misses, but b2 had never worked
    assert health.missed(["a1", "b1"], "test") == []  # a1 works and had no miss: b1, if a1 answers again
    assert health.missed(["a1", "b2"], "test") == []  # a1 had just missed (beside b1)
    health.answered(["a1", "b0"])  # a1 answers: b1 is convicted
    assert [p for p, _ in links.evicted] == ["b1"]
    assert health.missed(["a1", "b2"], "test") == []
    health.answered(["a1"])
    assert [p for p, _ in links.evicted] == ["b1", "b2"] and counters["evicted_trainers"] == 2


def test_a_trainer_that_worked_and_then_fell_silent_does_not_get_an_honest_one_evicted_in_its_place():
    """a0 (honest) shared one miss with x, which fell silent; its next route gave it y, which had
    worked until then and fell silent too. y vouched for itself at that miss, but never answers
    again, so a0 is not convicted; x and y are, on routes beside trainers that answer."""
    links, counters = RecordingLinks.grid([["a0", "a1", "a2"], ["x", "y", "b2"]]), Counter()
    health = RouteHealth(links, counters)
    health.answered(["a0", "a1", "a2", "x", "y", "b2"])
    health.missed(["a0", "x"], "test")
    health.missed(["a0", "y"], "test")  # a0's second miss in a row, beside y which vouched
    health.answered(["a1", "a2", "b2"])  # the rest of the swarm works on
    assert not links.evicted
    health.missed(["a1", "x"], "test")
    health.missed(["a2", "y"], "test")
    health.answered(["a1", "a2", "b2", "a0"])
    assert sorted(p for p, _ in links.evicted) == ["x", "y"] and counters["evicted_trainers"] == 2


def test_a_retry_goes_to_trainers_known_to_work_rather_than_to_newcomers():
    """Three newcomers joined a 2x2 swarm; a route through one of them missed: the retry takes
    trainers that have worked, whatever the turn (it took one of the routes, and a route through
    two newcomers missed too and failed the pass)."""
    links = RecordingLinks.grid([["a0", "a1", "n0", "n1"], ["b0", "b1", "n2"]])
    health = RouteHealth(links, Counter())
    health.answered(["a0", "a1", "b0", "b1"])
    health.misses.update({"a0": 1, "n2": 1})
    retries = [health.retry_route(["a0", "n2"], turn) for turn in range(4)]
    assert all(r[0] == "a1" and r[1] in ("b0", "b1") for r in retries), retries
    assert {r[1] for r in retries} == {"b0", "b1"}  # successive retries rotate among them


def test_micro_batches_queued_behind_one_that_missed_are_retried_at_once_without_a_miss_of_their_own():
    """A pass of 4 micro-batches over the routes of one stage [a0], [a1], a0 silent: both of a0's
    wait on the same silent trainer, so the pass costs one deadline and a0 one miss (it was
    waiting one deadline per micro-batch queued there, counting a miss for each)."""
    links, counters = RecordingLinks.grid([["a0", "a1"]]), Counter()
    dispatcher = MicrobatchDispatcher(links, counters, micro_batch_rows=1, timeout_s=STEP_TIMEOUT_S,
                                      mb_timeout_s=MB_TIMEOUT_S)

    def answer(peer, message):
        if isinstance(message, messages.TrainOut) and "a0" not in message.route:
            asyncio.get_running_loop().call_soon(dispatcher.on_mb_done, message.route[0],
                                                 messages.MbDone(step=message.step, mb=message.mb))
    links.on_send = answer

    async def one_pass():
        started = time.monotonic()
        assert await dispatcher.run(0, _batch(rows=4), None) == []
        return time.monotonic() - started
    seconds = asyncio.run(one_pass())
    assert seconds < 1.5 * MB_TIMEOUT_S, seconds
    assert counters["missed_deadlines"] == 1 and counters["retried_microbatches"] == 2
    assert dispatcher.health.misses == Counter({"a0": 1}) and not links.evicted


def test_honest_trainers_paired_with_two_silent_replicas_of_a_stage_keep_their_places():
    """The shape of the real-process test's hostile phase: stage 1 holds one honest and two silent
    replicas, stage 0 four honest ones, and each route has micro-batches queued on it. Only the
    silent two are evicted (the honest trainers they were first paired with were evicted too)."""
    links, dispatcher, _ = _swarm({"b1", "b2"}, [["a0", "a1", "a2", "a3"], ["b0", "b1", "b2"]], with_loss=False)
    dispatcher.health.answered(["a0", "a1", "a2", "a3", "b0"])  # they trained before b1, b2 joined

    async def passes():
        return [await dispatcher.run(step, _batch(rows=16), None) for step in range(4)]
    results = asyncio.run(passes())
    assert sorted(p for p, _ in links.evicted) == ["b1", "b2"], links.evicted
    assert results[-1] == []


def test_a_pass_whose_every_route_is_silent_fails_at_its_attempts_not_at_the_step_deadline():
    links, dispatcher, counters = _swarm(silent={"a0", "a1"})

    async def one_pass():
        started = time.monotonic()
        result = await dispatcher.run(0, _batch(), None)
        return result, time.monotonic() - started
    result, seconds = asyncio.run(one_pass())
    assert result is None and dispatcher.last_refused is False  # late is not a refusal: rollouts stay
    assert seconds < 4 * MB_TIMEOUT_S + 1.0


def test_two_silent_trainers_on_different_stages_of_a_2x3_swarm_are_the_only_ones_evicted():
    links, dispatcher, _ = _swarm({"a0", "b1"}, [["a0", "a1", "a2"], ["b0", "b1", "b2"]], with_loss=False)

    async def passes():
        return [await dispatcher.run(step, _batch(rows=6), None) for step in range(4)]
    results = asyncio.run(passes())
    assert sorted(p for p, _ in links.evicted) == ["a0", "b1"], links.evicted
    assert results[-1] == []  # the last pass ran on honest routes only


def test_an_evicted_node_is_refused_when_it_reconnects_and_told_when_it_may_rejoin(tmp_path):
    from engine.net.identity import Identity
    from engine.paths import base_checkpoint_dir
    from engine.swarm.coordinator import Coordinator, CoordinatorConfig
    from tests.support.hostile_node import join

    async def main():
        c = Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                          num_stages=2, port=0))
        url = await c.start()
        try:
            identity = Identity.generate()
            first = await join(url, identity)
            assert first.reply["type"] == "welcome"
            c.members.evict(identity.peer_id, "missed 2 deadlines in a row (test)")
            await first.close()
            again = await join(url, identity)
            assert again.reply["type"] == "shutdown" and "may rejoin in 300 s" in again.reply["reason"]
            await again.close()
            other = await join(url)  # nobody else is refused
            assert other.reply["type"] == "welcome"
            await other.close()
        finally:
            await c.stop()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_micro_batches_queued_on_one_route_get_a_deadline_each_so_a_slow_but_steady_trainer_is_not_evicted():
    """A route's trainers work through its micro-batches in turn (a real model on CPU takes seconds
    each): the k-th queued there is due after k deadlines, not one (a 30-minute SmolLM2 run had its
    only stage-1 trainer evicted at step 0 for the 4th of 4 micro-batches it was still working on)."""
    links, counters = RecordingLinks.grid([["a0"], ["b0"]]), Counter()
    dispatcher = MicrobatchDispatcher(links, counters, micro_batch_rows=1, timeout_s=STEP_TIMEOUT_S,
                                      mb_timeout_s=MB_TIMEOUT_S)
    per_mb_s = 0.7 * MB_TIMEOUT_S  # each well inside one deadline; the 4th ends at 2.8 deadlines
    answered: list[int] = []

    def answer(peer, message):
        if not isinstance(message, messages.TrainOut):
            return
        done_at = per_mb_s * (len(answered) + 1)
        answered.append(message.mb)
        loop = asyncio.get_running_loop()
        loop.call_later(done_at, dispatcher.on_mb_done, message.route[0],
                        messages.MbDone(step=message.step, mb=message.mb))
    links.on_send = answer

    async def one_pass():
        return await dispatcher.run(0, _batch(rows=4), None)
    assert asyncio.run(one_pass()) == []
    assert sorted(answered) == [0, 1, 2, 3]  # each sent once: no micro-batch was re-dispatched
    assert counters["missed_deadlines"] == 0 and not links.evicted


class _FakeStage:
    """A stage runtime with a fixed gradient; ``apply`` records the aggregate it was given."""

    tied_names: tuple = ()

    def __init__(self) -> None:
        self.version, self.applied = 0, []

    def grads(self):
        return {"w": np.ones((4, 4), np.float32)}

    def apply(self, grads, max_norm, version, *rest):
        self.applied.append(grads)
        self.version = version
        return 1.0

    def state_dict(self):
        return {"w": np.zeros((4, 4), np.float32)}


class _Peers:
    """Sends to ``stalled`` never return (its SCTP takes nothing in); the rest are recorded."""

    def __init__(self, stalled: set[str]) -> None:
        self.stalled, self.sent = stalled, []

    async def send(self, peer, header, payload=b"", channel="control"):
        if peer in self.stalled:
            await asyncio.Event().wait()
        self.sent.append(peer)


def _apply_among(replicas: list[str], shares: list[float], stalled: set[str], share_from: list[str],
                 peer_wait_s: float | None = None):
    """Replica "me" of stage 0 applies step 0 among ``replicas`` with ``shares``; the replicas in
    ``share_from`` sent their share first. Returns (seconds, what it sent the coordinator, peers sent to)."""
    from backends.base import StageSpec
    from engine.swarm import tensor_bundle
    from engine.swarm.compute_thread import ComputeThread
    from engine.swarm.node_context import HeldStage, NodeContext
    from engine.swarm.replica_step import ReplicaStep
    from engine.swarm.replica_sync import ReplicaCompressor
    from engine.swarm.run_config import RunConfig

    compute, peers, reports = ComputeThread(), _Peers(stalled), []

    class Coordinator:
        async def send(self, message):
            reports.append(message)

    ctx = NodeContext(peer_id="me", role="trainer", compute=compute, peers=peers, coordinator=Coordinator(),
                      stage=HeldStage(rt=_FakeStage(), spec=StageSpec(0, 2, 0, 1), run_cfg=RunConfig()))
    ctx.membership.update([list(replicas), ["b0"]], [])

    async def release(step):
        return None
    rs = ReplicaStep(ctx, share_timeout_s=3.0, data_dir=None, release_through=release, after_step=lambda m: None)
    rs.new_weights(fresh=True)
    encoded, _ = ReplicaCompressor("int8", 0.02).compress(_FakeStage().grads())
    entries, payload = tensor_bundle.pack(encoded)
    for peer in share_from:
        rs.on_share(peer, messages.Share(step=0, tensors=tensor_bundle.wire_entries(entries)), payload)

    async def main():
        started = time.monotonic()
        await rs._apply(messages.Apply(step=0, version=1, replicas=list(replicas), leader="me", checkpoint=False,
                                       token_shares=list(shares), inference=[], peer_wait_s=peer_wait_s))
        seconds = time.monotonic() - started
        await ctx.tasks.cancel_all()
        return seconds
    try:
        seconds = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        compute.stop()
    return seconds, reports, peers.sent


def test_a_replica_that_stopped_draining_holds_only_its_own_share_not_the_step():
    """Our share to a replica whose SCTP takes nothing in is sent in the background: the step goes
    on with the shares that came (it used to wait for every send first, up to the link's 120 s)."""
    seconds, reports, sent = _apply_among(["me", "honest", "stall"], [0.5, 0.5, 0.0], stalled={"stall"},
                                          share_from=["honest"])
    assert seconds < 1.0, seconds
    assert [type(m).__name__ for m in reports] == ["Stepped"] and sent == ["honest"]


def test_a_replica_that_trained_nothing_is_not_waited_for_its_share():
    """``apply`` gives it no token share, so the aggregate leaves it out: waiting for its share (a
    node that ignores train_in, or never reads its socket) only cost the step the share deadline."""
    seconds, reports, _ = _apply_among(["me", "honest", "idle"], [0.5, 0.5, 0.0], stalled=set(),
                                       share_from=["honest"])
    assert seconds < 1.0, seconds
    assert [type(m).__name__ for m in reports] == ["Stepped"]
    seconds, _, _ = _apply_among(["me", "honest", "idle"], [0.4, 0.4, 0.2], stalled=set(), share_from=["honest"])
    assert seconds >= 3.0  # a replica with a share is waited for, to the share deadline
    # when we trained nothing we send nothing (it would reach replicas that stepped: a strike each)
    seconds, reports, sent = _apply_among(["me", "honest", "other"], [0.0, 0.5, 0.5], stalled=set(),
                                          share_from=["honest", "other"])
    assert seconds < 1.0 and sent == [] and [type(m).__name__ for m in reports] == ["Stepped"]


def _apply_with_a_deaf_a1(tmp_path, trained: dict[str, int]):
    """A coordinator's apply of step 0 over stages [a0, a1], [b0]: a1 reads nothing, the others
    step at once. Returns (applied, seconds, the micro-batch health)."""
    import json

    from engine.paths import base_checkpoint_dir
    from engine.swarm.coordinator import Coordinator, CoordinatorConfig, NodeSession
    from engine.swarm.run_config import RunConfig

    c = Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                      num_stages=2, step_timeout_s=STEP_TIMEOUT_S,
                                      run=RunConfig(microbatch_timeout_s=MB_TIMEOUT_S)))

    class Ws:
        closed = False

        def __init__(self, peer):
            self.peer = peer

        async def send_str(self, text):
            message = json.loads(text)
            if message["type"] == "apply" and self.peer != "a1":  # a1 reads nothing (and trained nothing)
                asyncio.get_running_loop().call_soon(c.steps.on_stepped, self.peer, messages.Stepped(
                    step=message["step"], version=message["version"], grad_norm=0.0, checksum=1.0,
                    update_bytes=0, dense_bytes=0, checkpoint_path=None))
    for peer, stage in (("a0", 0), ("a1", 0), ("b0", 1)):
        c.sessions[peer] = NodeSession(peer, Ws(peer), "torch", "cpu", stage=stage, ready=True)
    c.steps.microbatches.trained_tokens.update(trained)

    async def apply():
        started = time.monotonic()
        ok = await c.steps._apply(0)
        return ok, time.monotonic() - started
    try:
        ok, seconds = asyncio.run(apply())
    finally:
        c.store.close()
    assert not ok or c.book.version == 1
    return ok, seconds, c.steps.microbatches.health


def test_a_trainer_that_trained_nothing_and_never_steps_costs_the_apply_one_micro_batch_deadline(tmp_path):
    ok, seconds, health = _apply_with_a_deaf_a1(tmp_path, {"a0": 10, "b0": 10})
    assert ok
    assert MB_TIMEOUT_S <= seconds < 3 * MB_TIMEOUT_S, seconds  # not the 30 s step deadline
    assert health.misses == Counter({"a1": 1})


def test_a_replica_that_trained_but_never_steps_costs_one_micro_batch_deadline_after_its_sibling_stepped(tmp_path):
    """A deaf trainer that got its micro-batches over WebRTC (so it trained) but reads no ``apply``:
    once its stage's other replica stepped it has one micro-batch deadline more, then it is a miss
    of its own. It used to hold every step it was in for the whole step deadline."""
    ok, seconds, health = _apply_with_a_deaf_a1(tmp_path, {"a0": 10, "a1": 10, "b0": 20})
    assert ok
    assert MB_TIMEOUT_S <= seconds < 3 * MB_TIMEOUT_S, seconds
    assert health.misses == Counter({"a1": 1})


def test_a_micro_batch_re_dispatched_to_a_first_stage_still_holding_its_first_try_replaces_it():
    """The first try of micro-batch 3:1 went [a0, silent]; the coordinator retries it on [a0, b1].
    a0 frees the first try's activations and forwards the retry (it used to refuse it, "training
    key '3:1' is already in flight", and the coordinator quarantined the step's rollouts)."""
    from backends.base import BackendError, StageSpec
    from engine.swarm.compute_thread import ComputeThread
    from engine.swarm.node_context import HeldStage, NodeContext
    from engine.swarm.run_config import RunConfig
    from engine.swarm.training import Training

    class Stage:  # the backend's rule for keys: one forward per key until released or backpropagated
        vocab_size, version = 100, 0

        def __init__(self):
            self.keys = set()

        def train_forward(self, key, x, segments=None):
            if key in self.keys:
                raise BackendError(f"training key '{key}' is already in flight")
            self.keys.add(key)
            return np.zeros((*x.shape, 4), np.float32)

        def release(self, key):
            self.keys.discard(key)

    class Peers:
        def __init__(self):
            self.sent = []

        async def send(self, peer, header, payload=b"", channel="control"):
            self.sent.append((peer, header.route))

    class Coordinator:
        def __init__(self):
            self.sent = []

        async def send(self, message):
            self.sent.append(message)

    compute, peers, coordinator, stage = ComputeThread(), Peers(), Coordinator(), Stage()
    ctx = NodeContext(peer_id="a0", role="trainer", compute=compute, peers=peers, coordinator=coordinator,
                      stage=HeldStage(rt=stage, spec=StageSpec(0, 2, 0, 1), run_cfg=RunConfig()))
    training = Training(ctx)

    async def main():
        for route in (["a0", "silent"], ["a0", "b1"]):
            training.on_train_in(messages.TrainIn(step=3, mb=1, route=route, inputs=[[1, 2, 3]]))
            while ctx.tasks.pending():
                await asyncio.sleep(0.01)
    try:
        asyncio.run(asyncio.wait_for(main(), 10))
    finally:
        compute.stop()
    assert coordinator.sent == []  # no mb_failed
    assert peers.sent == [("silent", ["a0", "silent"]), ("b1", ["a0", "b1"])]
    assert stage.keys == {"3:1"} and training._routes["3:1"] == ["a0", "b1"]  # a gradient comes back on the retry's


def test_a_replica_waits_for_a_silent_sibling_only_as_long_as_apply_allows_then_steps_in_time():
    """A sibling that trained (so its share is waited for) but sends nothing: the trainer steps once
    ``apply``'s ``peer_wait_s`` is over, not after its own share timeout (3 s here). With a share
    timeout as long as the coordinator's step deadline, an honest trainer waiting out a hostile
    sibling said ``stepped`` late, was blamed for the silence twice and evicted (a CI run)."""
    seconds, reports, _ = _apply_among(["me", "honest", "silent"], [0.4, 0.3, 0.3], stalled=set(),
                                       share_from=["honest"], peer_wait_s=0.5)
    assert 0.5 <= seconds < 1.5, seconds
    assert [type(m).__name__ for m in reports] == ["Stepped"]
    unbounded, _, _ = _apply_among(["me", "honest", "silent"], [0.4, 0.3, 0.3], stalled=set(),
                                   share_from=["honest"])
    assert unbounded >= 3.0, unbounded  # without it, the node's own share timeout


def test_a_silent_trainer_that_leaves_and_joins_again_resumes_its_misses_and_must_prove_itself_anew():
    """A deaf node's websocket is dropped and its process joins again: its miss stays, so the next
    one evicts it (it used to start over at each rejoin and stayed in the routes for minutes)."""
    links = RecordingLinks.grid([["a0", "a1"], ["b0", "b1"]])
    health = RouteHealth(links, Counter())
    health.answered(["a0", "a1", "b0", "b1"])
    assert health.missed(["b1"], "no 'stepped'") == []
    links.stages[1].remove("b1")
    health.routes()  # b1 is gone: it is no longer known to work
    links.stages[1].append("b1")
    assert health.misses["b1"] == 1 and "b1" not in health.proven
    assert health.missed(["b1"], "no 'stepped'") == ["b1"]
