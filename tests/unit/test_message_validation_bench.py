"""The validation bench compares like with like: the frozen old validator and the typed structs
agree on the benched messages, and ``polis bench transport --only validation`` reports every figure."""

import argparse
import json
import random

import msgpack
import pytest

from engine.bench import legacy_validation as legacy
from engine.bench import message_validation as bench
from engine.bench import transport
from engine.net.errors import ProtocolViolation
from engine.swarm import messages


def _both_refuse(text_new, old):
    with pytest.raises(ProtocolViolation):
        text_new()
    with pytest.raises(ProtocolViolation):
        old()


def test_old_and_new_paths_accept_the_benched_messages_and_refuse_the_same_corruptions():
    rng = random.Random(1)
    train_out, gen_done, act = bench._train_out(8, 4, rng), bench._gen_done(8, 4, rng), bench._act()
    assert legacy.COORDINATOR_TO_NODE.validate(train_out) and messages.COORDINATOR_TO_NODE.convert(train_out)
    assert legacy.NODE_TO_COORDINATOR.validate(gen_done) and messages.NODE_TO_COORDINATOR.convert(gen_done)
    assert legacy.PEER_MESSAGES.validate(act) and messages.decode_peer_header(msgpack.packb(act))
    for bad in ({**train_out, "advantages": [1e5] * 8}, {**train_out, "mask": [[1] * 4] * 8},
                {**train_out, "extra": 1}, {k: v for k, v in train_out.items() if k != "targets"}):
        _both_refuse(lambda: messages.decode_from_coordinator(json.dumps(bad)),
                     lambda: legacy.COORDINATOR_TO_NODE.validate(bad))
    for bad in ({**gen_done, "tokens": [[-1]]}, {**gen_done, "versions": []}):
        _both_refuse(lambda: messages.decode_from_node(json.dumps(bad)),
                     lambda: legacy.NODE_TO_COORDINATOR.validate(bad))
    for bad in ({**act, "hop": 0}, {**act, "kind": "other"}):
        _both_refuse(lambda: messages.decode_peer_header(msgpack.packb(bad)),
                     lambda: legacy.PEER_MESSAGES.validate(bad))


def test_only_validation_prints_every_figure_for_every_benched_message(capsys):
    parser = argparse.ArgumentParser()
    transport.add_arguments(parser)
    assert transport.run(parser.parse_args(["--only", "validation", "--quick", "--json"])) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    figures = result["message_validation_ms"]
    assert set(figures) == {"train_out_512x16", "gen_done_128x8", "peer_act_header", "control_stats_event"}
    for row in figures.values():
        assert row["after_ms"] > 0 and row["before_ms"] > 0 and row["parse_only_ms"] > 0 and row["bytes"] > 0
        assert row["speedup"] == pytest.approx(row["before_ms"] / row["after_ms"])
