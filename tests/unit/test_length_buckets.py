"""A generation job's prompts have one token length: ``LengthBuckets`` gathers keys by length."""

import pytest

from engine.rl.prompt_keys import LengthBuckets


def test_length_buckets_hand_out_one_lengths_keys_oldest_first_and_hold_the_others():
    buckets = LengthBuckets(2, len)
    assert buckets.add("aa") is None
    assert buckets.add("bbb") is None
    assert buckets.add("cc") == ["aa", "cc"]
    assert buckets.add("dd") is None  # the bucket of length 2 started again
    assert buckets.take(iter(["eee"])) == ["bbb", "eee"]  # held keys count
    assert buckets.take(iter(["f", "gg"])) == ["dd", "gg"]
    assert buckets.take(iter(["h"])) == ["f", "h"]


def test_length_buckets_take_draws_only_what_one_batch_needs():
    stream = iter(["a", "bb", "c", "dd", "e"])
    assert LengthBuckets(2, len).take(stream) == ["a", "c"]
    assert list(stream) == ["dd", "e"]


def test_length_buckets_refuse_an_empty_batch():
    with pytest.raises(ValueError):
        LengthBuckets(0, len)
