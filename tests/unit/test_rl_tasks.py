import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.tokenizer import CharTokenizer
from engine.rl.codec import CodecError, TaskCodec
from engine.rl.tasks import ALPHABET, RewardKind, TaskConfig, make_task, task_names
from engine.rl.tasks.rewards import exact_match, token_reward
from engine.rl.tasks.scoring import lcs_length, text_reward


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    CharTokenizer.build(ALPHABET).save(directory)
    return TaskCodec.from_dir(directory)


def test_registry_has_reversal_sorting_and_addition():
    assert {"reversal", "sorting", "addition"} <= set(task_names())
    with pytest.raises(ValueError, match="unknown task"):
        make_task(TaskConfig(name="chess"))


@pytest.mark.parametrize("prompt, answer", [
    ("rev:12345=", "54321"), ("rev:120=", "021"), ("sort:31412=", "11234"), ("add:123+45=", "168"),
    ("add:0+7=", "7"), ("add:999+1=", "1000"),
])
def test_tasks_answer_their_prompts(prompt, answer):
    name = {"rev": "reversal", "sort": "sorting", "add": "addition"}[prompt.split(":")[0]]
    assert make_task(TaskConfig(name=name)).solve(prompt) == answer


@pytest.mark.parametrize("name, prompt", [
    ("reversal", "rev:12a="), ("reversal", "sort:123="), ("sorting", "sort:="), ("addition", "add:01+2="),
    ("addition", "add:1+2"), ("reversal", ""),
])
def test_malformed_prompts_have_no_answer_and_score_zero(name, prompt):
    task = make_task(TaskConfig(name=name))
    assert task.solve(prompt) is None
    assert task.reward_text(prompt, "123") == 0.0


@pytest.mark.parametrize("name", ["reversal", "sorting", "addition"])
def test_random_prompts_are_well_formed_and_within_the_configured_size(name):
    task = make_task(TaskConfig(name=name, min_digits=2, max_digits=4))
    rng = np.random.default_rng(0)
    for _ in range(200):
        ex = task.example(task.random_prompt(rng))
        assert set(ex.prompt) <= set(task.alphabet) and set(ex.answer) <= set(task.alphabet)
        assert 1 <= len(ex.answer) <= task.max_answer_chars()


def test_eval_split_is_fixed_and_disjoint_from_the_train_stream():
    config = TaskConfig(name="reversal", min_digits=2, max_digits=3, eval_size=300)
    first, second = make_task(config).eval_split(), make_task(config).eval_split()
    assert first == second and len(first) == 300
    held_out = {e.prompt for e in first}
    stream = make_task(config).train_stream(seed=1)
    train = [next(stream).prompt for _ in range(2000)]
    assert not held_out & set(train)


def test_train_stream_is_reproducible_from_its_seed():
    task = make_task(TaskConfig(name="addition"))
    a, b, c = task.train_stream(3), task.train_stream(3), task.train_stream(4)
    first = [next(a) for _ in range(20)]
    assert first == [next(b) for _ in range(20)]
    assert first != [next(c) for _ in range(20)]


def test_reward_kinds_on_hand_made_answers():
    assert text_reward("12345", "12345", RewardKind.EXACT, max_chars=5) == 1.0
    assert text_reward("12345", "12344", RewardKind.EXACT, max_chars=5) == 0.0
    assert text_reward("12345", "12045", RewardKind.PER_POSITION, max_chars=5) == pytest.approx(0.8)
    assert text_reward("12345", "123", RewardKind.PER_POSITION, max_chars=5) == pytest.approx(0.6)
    assert lcs_length("12345", "1345") == 4
    assert text_reward("12345", "1345", RewardKind.LCS, max_chars=5) == pytest.approx(8 / 9)
    assert text_reward("12345", "", RewardKind.LCS, max_chars=5) == 0.0
    assert text_reward("12", "1234567", RewardKind.PER_POSITION, max_chars=5) == 0.0


def test_token_reward_needs_eos_and_only_answer_characters(codec):
    task = make_task(TaskConfig(name="reversal", reward=RewardKind.PER_POSITION))
    right = codec.encode("321") + [codec.eos_id]
    assert token_reward(task, "rev:123=", right, codec) == 1.0
    assert exact_match(task, "rev:123=", right, codec)
    assert token_reward(task, "rev:123=", codec.encode("321"), codec) == 0.0  # never finished
    assert token_reward(task, "rev:123=", [codec.eos_id], codec) == 0.0  # empty
    assert token_reward(task, "rev:123=", codec.encode("3a1") + [codec.eos_id], codec) == 0.0  # not a digit
    assert token_reward(task, "rev:123=", [codec.bos_id] + right, codec) == 0.0  # special inside
    assert token_reward(task, "rev:123=", codec.encode("3") + [codec.eos_id] + codec.encode("21"), codec) \
        == pytest.approx(1 / 3)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(min_value=-2**70, max_value=2**70), st.integers(0, 40)), max_size=40),
       name=st.sampled_from(["reversal", "sorting", "addition"]),
       kind=st.sampled_from(list(RewardKind)))
def test_any_completion_scores_in_unit_interval_without_raising(codec, ids, name, kind):
    task = make_task(TaskConfig(name=name, reward=kind))
    prompt = task.random_prompt(np.random.default_rng(len(ids)))
    r = token_reward(task, prompt, ids, codec)
    assert 0.0 <= r <= 1.0
    assert exact_match(task, prompt, ids, codec) in (True, False)


def test_codec_matches_the_model_tokenizer(codec, tmp_path):
    tok = CharTokenizer.build(ALPHABET)
    assert codec.encode("rev:12=") == tok.encode("rev:12=")
    assert (codec.eos_id, codec.pad_id, codec.bos_id) == (tok.eos_id, tok.pad_id, tok.bos_id)
    assert codec.decode_strict(tok.encode("add:1+2=")) == "add:1+2="
    assert codec.decode_strict([tok.unk_id]) is None
    with pytest.raises(CodecError):
        codec.encode("x")
    with pytest.raises(CodecError, match="missing"):
        TaskCodec.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CodecError, match="unreadable"):
        TaskCodec.from_dir(tmp_path)
