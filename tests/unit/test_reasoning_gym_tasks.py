"""reasoning_gym:<dataset> and mixture tasks: fixed held-out split, disjoint seeded stream, prompts."""

import subprocess
import sys
from collections import Counter

import pytest

from engine.rl.tasks import MixtureEntry, TaskConfig, make_chat_task
from engine.rl.tasks.reasoning_gym_task import load_reasoning_gym

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # only 200 distinct questions


def chain_sum(**kwargs):
    return make_chat_task(TaskConfig(name="reasoning_gym:chain_sum", options=CHAIN, **{"eval_size": 64, **kwargs}))


@pytest.fixture(scope="module")
def task():
    return chain_sum()


def test_held_out_split_is_the_same_in_every_instance_and_has_distinct_questions(task):
    items = task.eval_items()
    again = chain_sum().eval_items()
    assert items == again and len(items) == 64
    assert len({i.question for i in items}) == 64
    assert all(task.is_held_out(i.question) for i in items)
    assert all(i.dataset == "chain_sum" and i.item_id.startswith("chain_sum/eval/") for i in items)


def test_training_stream_never_yields_a_held_out_question_although_the_generator_repeats_them(task):
    held_out = {i.question for i in task.eval_items()}
    train = [next(s) for s in [task.train_items(seed=7)] for _ in range(3000)]
    assert not held_out & {i.question for i in train}
    # why the split is by question text: the same generator under other seeds does repeat held-out items
    rg = load_reasoning_gym()
    raw = rg.create_dataset("chain_sum", **CHAIN, seed=12345, size=3000)
    assert held_out & {raw[i]["question"] for i in range(3000)}


def test_training_stream_is_reproducible_from_its_seed(task):
    a, b, c = task.train_items(3), task.train_items(3), task.train_items(4)
    first = [next(a) for _ in range(50)]
    assert first == [next(b) for _ in range(50)]
    assert first != [next(c) for _ in range(50)]
    assert all(i.answer == i.entry["answer"] and i.question == i.entry["question"] for i in first)


def test_prompt_is_system_then_one_worked_example_then_the_question(task):
    item = task.eval_items()[0]
    roles = [m.role for m in item.prompt.messages]
    assert roles == ["system", "user", "assistant", "user"]
    example_q, example_a = item.prompt.messages[1].content, item.prompt.messages[2].content
    assert not task.is_held_out(example_q)
    expression = example_q.split(":")[-1].rstrip(" =").strip()
    assert example_a.startswith(f"{expression} = ") and example_a.endswith("</answer>")
    assert item.prompt.as_dicts()[-1] == {"role": "user", "content": item.question}


@pytest.mark.parametrize("kwargs, roles, reply_start", [
    ({"example": "bare"}, ["system", "user", "assistant", "user"], "<answer>"),
    ({"example": "none"}, ["system", "user"], None),
    ({"system_prompt": ""}, ["user", "assistant", "user"], None),
])
def test_prompt_variants(kwargs, roles, reply_start):
    item = chain_sum(**kwargs).eval_items()[0]
    assert [m.role for m in item.prompt.messages] == roles
    if reply_start:
        assert item.prompt.messages[2].content.startswith(reply_start)


def test_a_small_task_space_keeps_half_its_questions_for_training(caplog):
    task = chain_sum(eval_size=400)  # asks for more than the 200 questions that exist
    held_out = {i.question for i in task.eval_items()}
    assert len(held_out) == 100 and "a small task space" in caplog.text
    stream = task.train_items(0)
    train = {next(stream).question for _ in range(2000)}
    assert len(train) == 100 and not train & held_out


@pytest.mark.parametrize("name, options, match", [
    ("chain_sums", {}, "did you mean chain_sum"),
    ("chain_sum", {"max_term": 3}, "unknown options.*max_terms"),
    ("chain_sum", {"min_terms": 0}, "min_terms must be positive"),
    ("chain_sum", {"min_terms": 2.5}, "integer"),
    ("chain_sum", {"allow_negation": 1}, "true or false"),
])
def test_bad_dataset_names_and_options_say_what_is_wrong(name, options, match):
    with pytest.raises(ValueError, match=match):
        make_chat_task(TaskConfig(name=f"reasoning_gym:{name}", options=options))


def test_other_datasets_build_and_score_their_own_gold_answers():
    for name in ("letter_counting", "basic_arithmetic", "spell_backward"):
        task = make_chat_task(TaskConfig(name=f"reasoning_gym:{name}", eval_size=16))
        for item in task.eval_items():
            score = task.score(item, f"Let me see. <answer>{item.answer}</answer>")
            assert score.strict == 1.0 and score.well_formed, (name, item.answer)


def test_mixture_draws_by_weight_holds_out_per_dataset_and_scores_by_dataset():
    config = TaskConfig(name="mixture", eval_size=40, mixture=(
        MixtureEntry("chain_sum", 3.0, CHAIN), MixtureEntry("letter_counting", 1.0)))
    task = make_chat_task(config)
    held = task.eval_items()
    assert Counter(i.dataset for i in held) == {"chain_sum": 30, "letter_counting": 10}
    stream = task.train_items(5)
    train = [next(stream) for _ in range(800)]
    share = Counter(i.dataset for i in train)["chain_sum"] / len(train)
    assert 0.70 <= share <= 0.80
    assert not {i.question for i in held} & {i.question for i in train}
    again = make_chat_task(config).train_items(5)
    assert [next(again) for _ in range(100)] == train[:100]
    for item in held[:5] + held[-5:]:
        assert task.score(item, f"<answer>{item.answer}</answer>").strict == 1.0


def test_generating_items_opens_no_network_connection():
    code = (
        "import socket\n"
        "def refuse(*a, **k): raise RuntimeError('network access')\n"
        "socket.socket.connect = refuse; socket.create_connection = refuse; socket.getaddrinfo = refuse\n"
        "from engine.rl.tasks import TaskConfig, make_chat_task\n"
        "for name in ('chain_sum', 'letter_counting', 'basic_arithmetic', 'spell_backward'):\n"
        "    t = make_chat_task(TaskConfig(name='reasoning_gym:' + name, eval_size=8))\n"
        "    it = t.eval_items()[0]; next(t.train_items(0)); t.score(it, '<answer>1</answer>')\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_importing_the_task_modules_does_not_import_reasoning_gym():
    code = ("import sys, engine.rl.tasks, engine.rl.tasks.mixture, engine.rl.tasks.reasoning_gym_task, "
            "engine.rl.shortcuts\nprint('reasoning_gym' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


class _CharDecoder:
    """A stand-in for the model's codec: one id per character, id 0 ends the turn."""

    chars = "\x00<>/answer 0123456789-."

    def completion_ids(self, ids):
        ids = [int(i) for i in ids]
        return (ids[:ids.index(0)], True) if 0 in ids else (ids, False)

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids if 0 < i < len(self.chars))

    def encode(self, text):
        return [self.chars.index(c) for c in text]


def test_scoring_from_tokens_stops_at_the_first_stop_id_and_an_unfinished_turn_loses_the_format_part(task):
    item = task.eval_items()[0]
    codec = _CharDecoder()
    right = codec.encode(f"<answer>{item.answer}</answer>")
    finished = task.score_tokens(item, right + [0] + codec.encode(" 9"), codec)
    assert finished.strict == 1.0 and finished.parts["format"] > 0
    unfinished = task.score_tokens(item, right, codec)
    assert unfinished.strict == 1.0 and unfinished.parts["format"] == 0.0 and not unfinished.well_formed
    assert task.score_tokens(item, [0] + right, codec).reward == 0.0
    assert task.score_tokens(item, ["x"], codec).reward == 0.0
