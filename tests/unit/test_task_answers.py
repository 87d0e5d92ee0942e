"""Reading answers from free text: last tag wins, stated answers, format, and any input is safe."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.rl.tasks.answers import stated_answer, tagged_answer, well_formed


@pytest.mark.parametrize("text, gold, expected", [
    ("<answer>7</answer>", "7", "7"),
    ("3 + 4 = 7. <answer> 7 </answer>", "7", "7"),
    ("<answer>1</answer> no wait <answer>2</answer>", "2", "2"),  # last tag wins
    ("<answer><answer>7</answer>", "7", "7"),
    ("<answer>7", "7", None),
    ("</answer>7<answer>", "7", None),
    ("<answer></answer>", "7", None),
    ("<answer>   </answer>", "7", None),
    ("<answer>3 + 4</answer>", "7", None),  # not a number where a number is due
    ("<answer>0123456789</answer>", "7", "0123456789"),  # a number, so the dataset's scorer decides
    ("<answer>7 or 8</answer>", "7", None),
    ("<answer>olleh there</answer>", "olleh", None),  # two words where one is due
    ("<answer>" + "9" * 100 + "</answer>", "7", None),  # far longer than any answer
    ("<answer>-1,000</answer>", "-1000", "-1,000"),
    ("<answer>-3.</answer>", "-3", "-3."),  # the dataset's scorer reads it as -3
    ("<answer>Infinity</answer>", "7", None),
])
def test_tagged_answer(text, gold, expected):
    assert tagged_answer(text, gold) == expected


@pytest.mark.parametrize("text, gold, expected", [
    ("7 + 4 = 11", "11", "11"),
    ("0 - 9 = -9.", "-9", "-9"),
    ("9-5 is 4", "4", "4"),
    ("so <answer>11</answer>", "11", "11"),
    ("the total is 1,000.", "1000", "1,000"),
    ("no number here", "3", None),
    ("The word backwards is: olleh.", "olleh", "olleh"),
    ("sorted:\napple, banana\n", "apple, banana", "apple, banana"),
])
def test_stated_answer_ignores_tags(text, gold, expected):
    assert stated_answer(text, gold) == expected


@pytest.mark.parametrize("text, ok", [
    ("4 + 3 = 7. <answer>7</answer>", True),
    ("<answer>7</answer>\n", True),
    ("<answer>7</answer> and more", False),
    ("<answer>7</answer><answer>7</answer>", False),
    ("<answer></answer>", False),
    ("<answer>seven</answer>", False),
    ("7", False),
])
def test_well_formed(text, ok):
    assert well_formed(text, "7") is ok


def test_megabytes_of_garbage_are_read_in_linear_time():
    hostile = "<answer>" * 200_000 + "1 " * 300_000 + "</answer" * 50_000
    start = time.perf_counter()
    for gold in ("7", "olleh", "a b c"):
        tagged_answer(hostile, gold), stated_answer(hostile, gold), well_formed(hostile, gold)
    assert time.perf_counter() - start < 2.0


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("<>/answer 0123456789-.,\n")) | st.characters(), max_size=300),
       gold=st.sampled_from(["7", "-12", "olleh", "a, b", "3.5"]))
def test_any_text_yields_none_or_a_bounded_answer(text, gold):
    for answer in (tagged_answer(text, gold), stated_answer(text, gold)):
        assert answer is None or (isinstance(answer, str) and 0 < len(answer) <= len(text))
    assert well_formed(text, gold) in (True, False)
