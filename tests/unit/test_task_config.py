"""TaskConfig: chat-task fields validate by shape and survive a trip through JSON and a run config."""

import json
from dataclasses import asdict

import pytest

from engine.rl.tasks import MixtureEntry, TaskConfig, is_chat_task_name, make_chat_task, make_task
from engine.swarm.run_config import RunConfig, apply_overrides, run_config_from_dict

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


@pytest.mark.parametrize("config", [
    TaskConfig(),
    TaskConfig(name="addition", min_digits=2, max_digits=3),
    TaskConfig(name="reasoning_gym:chain_sum", options=CHAIN, eval_size=64, format_weight=0.1, example="bare"),
    TaskConfig(name="mixture", mixture=(MixtureEntry("chain_sum", 3, CHAIN), MixtureEntry("letter_counting", 1))),
])
def test_task_config_survives_json_and_a_run_config(config):
    data = json.loads(json.dumps(asdict(config)))
    assert TaskConfig(**data) == config
    assert data == asdict(config)  # saved run states compare the dicts themselves
    run = RunConfig(task=config)
    assert run_config_from_dict(json.loads(json.dumps(run.to_dict()))).task == config


def test_run_overrides_reach_the_chat_fields():
    run = RunConfig(task=TaskConfig(name="reasoning_gym:chain_sum", options=dict(CHAIN)))
    changed = apply_overrides(run, ["task.format_weight=0.2", "task.options.max_terms=3"])
    assert changed.task.format_weight == 0.2 and changed.task.options["max_terms"] == 3


def test_mixture_accepts_plain_lists_and_objects():
    config = TaskConfig(name="mixture", mixture=[{"dataset": "chain_sum", "weight": 2}, ["letter_counting", 1.0, {}]])
    assert config.mixture == [MixtureEntry("chain_sum", 2.0), MixtureEntry("letter_counting", 1.0)]


@pytest.mark.parametrize("kwargs, match", [
    ({"name": "reversal", "options": {"min_terms": 2}}, "digit task"),
    ({"name": "reasoning_gym:chain_sum", "options": {"seed": 3}}, "set by Polis"),
    ({"name": "reasoning_gym:chain_sum", "options": {"size": 3}}, "set by Polis"),
    ({"name": "reasoning_gym:chain_sum", "options": {"x": float("nan")}}, "finite"),
    ({"name": "reasoning_gym:chain_sum", "options": {"x": {"nested": 1}}}, "numbers, booleans"),
    ({"name": "reasoning_gym:chain_sum", "options": {"not an id": 1}}, "identifiers"),
    ({"name": "reasoning_gym:chain_sum", "options": {f"k{i}": 1 for i in range(40)}}, "at most"),
    ({"name": "reasoning_gym:chain_sum", "max_digits": 6}, "digit tasks only"),
    ({"name": "reasoning_gym:", }, "reasoning_gym:<dataset>"),
    ({"name": "reasoning_gym:chain_sum", "mixture": [{"dataset": "chain_sum"}]}, "use name='mixture'"),
    ({"name": "mixture"}, "at least one dataset"),
    ({"name": "mixture", "mixture": [{"dataset": "chain_sum"}, {"dataset": "chain_sum"}]}, "at most once"),
    ({"name": "mixture", "mixture": [{"dataset": "chain_sum", "weight": 0}]}, "weight"),
    ({"name": "mixture", "mixture": [{"dataset": "chain_sum", "weight": True}]}, "weight"),
    ({"name": "reasoning_gym:chain_sum", "format_weight": 2.0}, "format_weight"),
    ({"name": "reasoning_gym:chain_sum", "example": "three"}, "example"),
    ({"name": "reasoning_gym:chain_sum", "system_prompt": "x" * 5000}, "system_prompt"),
])
def test_bad_task_configs_are_refused_with_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TaskConfig(**kwargs)


def test_digit_and_chat_registries_point_to_each_other():
    assert is_chat_task_name("reasoning_gym:chain_sum") and is_chat_task_name("mixture")
    assert not is_chat_task_name("reversal")
    with pytest.raises(ValueError, match="make_chat_task"):
        make_task(TaskConfig(name="reasoning_gym:chain_sum"))
    with pytest.raises(ValueError, match="make_task"):
        make_chat_task(TaskConfig(name="reversal"))


def test_configs_with_options_stay_hashable_so_they_can_be_dataclass_defaults():
    a = TaskConfig(name="mixture", mixture=[{"dataset": "chain_sum", "options": {"max_terms": 3, "min_terms": 2}}])
    b = TaskConfig(name="mixture", mixture=[{"dataset": "chain_sum", "options": {"min_terms": 2, "max_terms": 3}}])
    assert a == b and hash(a) == hash(b)
    with_options = TaskConfig(name="reasoning_gym:chain_sum", options=CHAIN)
    assert hash(with_options) != hash(TaskConfig(name="reasoning_gym:chain_sum"))
