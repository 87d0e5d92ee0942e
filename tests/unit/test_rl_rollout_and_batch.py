import numpy as np
import pytest

from engine.rl.batch import build_batch
from engine.rl.rollout import Group, Sample, SamplingConfig, generate_groups, greedy_completions
from engine.rl.staleness import LaggedQueue, filter_stale, group_staleness, histogram

EOS = 2
VOCAB = 7


class BigramPipeline:
    """A fake stage chain for these tests only: next-token logits depend on the last token."""

    num_stages = 2

    def __init__(self, seed=0):
        self.table = np.random.default_rng(seed).normal(0, 2, size=(VOCAB, VOCAB))
        self.caches: dict[str, int] = {}
        self.cache_rows: dict[str, int] = {}
        self.dropped: list[str] = []
        self.calls = 0
        self.prefills: list[tuple[int, int]] = []  #: (distinct rows computed, rows of the cache) per expand
        self.kept: list[int] = []  #: rows of the cache after each drop of finished rows
        self._versions = (3, 5)

    def next_token_logits(self, tokens, cache_id, expand=None, keep=None):
        self.calls += 1
        if keep is not None:
            assert len(keep) == tokens.shape[0] and max(keep) < self.cache_rows[cache_id]
            self.cache_rows[cache_id] = len(keep)
            self.kept.append(len(keep))
        if expand is not None:
            assert cache_id not in self.cache_rows, "only a fresh cache is expanded"
            self.prefills.append((tokens.shape[0], len(expand)))
            tokens = tokens[expand]
        rows = self.cache_rows.setdefault(cache_id, tokens.shape[0])
        assert rows == tokens.shape[0], "rows of a cache must not change"
        self.caches[cache_id] = self.caches.get(cache_id, 0) + tokens.shape[1]
        return self.table[tokens[:, -1]]

    def drop_cache(self, cache_id):
        self.dropped.append(cache_id)
        self.caches.pop(cache_id)

    def versions(self):
        return self._versions


def test_each_prompt_is_prefilled_once_for_all_its_samples():
    pipe = BigramPipeline()
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=4)
    groups = generate_groups(pipe, ["a", "b", "c"], [[1, 3], [1, 4], [1, 4, 4]], 4, sampling, EOS,
                             np.random.default_rng(0))
    assert sorted(pipe.prefills) == [(1, 4), (2, 8)]  # two prompts of length 2 in one cache, one of length 3
    assert [len(g.samples) for g in groups] == [4, 4, 4]
    greedy_completions(pipe, [[1, 3], [1, 4]], max_new_tokens=3, stop_ids=EOS)
    assert len(pipe.prefills) == 2  # distinct prompts: nothing to share


def test_rows_that_finished_leave_the_cache_and_every_row_samples_what_it_would_have(monkeypatch):
    from engine.rl import rollout

    def run():
        pipe = BigramPipeline(seed=3)
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
        groups = generate_groups(pipe, ["a", "b"], [[1, 3], [1, 4]], 8, sampling, EOS, np.random.default_rng(5))
        return pipe, [(s.completion_ids.tolist(), s.behaviour_logprobs.tolist(), s.versions.tolist())
                      for g in groups for s in g.samples]

    dropping, dropped = run()
    monkeypatch.setattr(rollout, "DROP_FINISHED_SHARE", 2.0)  # never drop
    keeping, kept = run()
    assert dropping.kept and not keeping.kept
    assert dropping.kept == sorted(dropping.kept, reverse=True) and dropping.kept[-1] < 16
    assert dropped == kept
    assert len({len(ids) for ids, _, _ in dropped}) > 1  # rows did finish at different steps


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_groups_have_g_samples_ending_at_eos_with_behaviour_logprobs_and_versions():
    pipe = BigramPipeline()
    prompts = ["a", "bb", "c"]
    ids = [[1, 3], [1, 4, 4], [1, 5]]
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=6)
    groups = generate_groups(pipe, prompts, ids, 4, sampling, EOS, np.random.default_rng(0))
    assert [g.prompt for g in groups] == prompts
    for g, prompt_ids in zip(groups, ids):
        assert len(g.samples) == 4
        for s in g.samples:
            seq = list(prompt_ids) + s.completion_ids.tolist()
            assert 1 <= len(s.completion_ids) <= 6
            assert s.finished == (s.completion_ids[-1] == EOS)
            assert EOS not in s.completion_ids[:-1].tolist()
            expected = [_log_softmax(pipe.table[seq[i - 1]] / 0.8)[seq[i]] for i in range(len(prompt_ids), len(seq))]
            np.testing.assert_allclose(s.behaviour_logprobs, expected, rtol=1e-5)
            assert s.versions.shape == (len(s.completion_ids), 2) and (s.versions == [3, 5]).all()
    # Prompts of equal length share one cache; every cache is dropped afterwards.
    assert len(pipe.dropped) == 2 and not pipe.caches


def test_rows_per_cache_are_capped():
    pipe = BigramPipeline()
    sampling = SamplingConfig(max_new_tokens=2, max_rows_per_cache=8)
    generate_groups(pipe, ["x"] * 5, [[1, 3]] * 5, 4, sampling, EOS, np.random.default_rng(0))
    assert len(pipe.dropped) == 3 and max(pipe.cache_rows.values()) <= 8


def test_greedy_completions_follow_the_argmax_and_stop_at_eos():
    pipe = BigramPipeline(seed=4)
    outs = greedy_completions(pipe, [[1, 3], [1, 6, 6]], max_new_tokens=5, stop_ids=EOS)
    for prompt, out in zip([[1, 3], [1, 6, 6]], outs):
        prev = prompt[-1]
        for tok in out:
            assert tok == int(np.argmax(pipe.table[prev]))
            prev = tok
        assert len(out) == 5 or out[-1] == EOS


def _sample(ids, lps, versions):
    ids = np.asarray(ids)
    return Sample(completion_ids=ids, behaviour_logprobs=np.asarray(lps, np.float32),
                  versions=np.tile(np.asarray(versions), (len(ids), 1)), finished=True, reward=0.0)


def test_batch_aligns_targets_mask_and_behaviour_logprobs_with_completions():
    g = Group(prompt="p", prompt_ids=np.array([1, 9, 8]),
              samples=[_sample([4, EOS], [-0.1, -0.2], [7]), _sample([5, 6, EOS], [-0.3, -0.4, -0.5], [6])])
    batch = build_batch([g], [np.array([1.0, -1.0])], pad_id=0, trainer_versions=[8])
    # The longest row comes first.
    np.testing.assert_array_equal(batch.inputs[0], [1, 9, 8, 5, 6])
    np.testing.assert_array_equal(batch.targets[0], [9, 8, 5, 6, EOS])
    np.testing.assert_array_equal(batch.mask[0], [False, False, True, True, True])
    np.testing.assert_allclose(batch.behaviour[0], [0, 0, -0.3, -0.4, -0.5])
    np.testing.assert_array_equal(batch.inputs[1], [1, 9, 8, 4, 0])
    np.testing.assert_array_equal(batch.mask[1], [False, False, True, True, False])
    np.testing.assert_allclose(batch.advantages, [-1.0, 1.0])
    np.testing.assert_array_equal(batch.staleness, [2, 1])
    assert batch.num_tokens == 5


def test_staleness_is_the_largest_lag_over_stages_and_stale_groups_are_dropped():
    fresh = Group("a", np.array([1]), [_sample([EOS], [-1], [10, 9])])
    stale = Group("b", np.array([1]), [_sample([EOS], [-1], [10, 4])])
    assert group_staleness(fresh, [10, 10]) == 1
    assert group_staleness(stale, [10, 10]) == 6
    kept, seen, dropped = filter_stale([fresh, stale], [10, 10], max_staleness=4)
    assert kept == [fresh] and seen == [1, 6] and dropped == 1
    assert histogram(seen + [1]) == {1: 2, 6: 1}


def test_lagged_queue_releases_an_item_only_after_lag_newer_ones():
    q: LaggedQueue[int] = LaggedQueue(2)
    out = []
    for i in range(6):
        q.push(i)
        out.append(q.pop_ready())
    assert out == [None, None, 0, 1, 2, 3]
    assert LaggedQueue(0).pop_ready() is None
    with pytest.raises(ValueError):
        LaggedQueue(-1)


def test_a_completion_ends_at_the_first_of_several_stop_ids():
    pipe = BigramPipeline(seed=1)
    stops = (EOS, 5)
    groups = generate_groups(pipe, ["a"], [[1, 3]], 32, SamplingConfig(temperature=1.5, max_new_tokens=8),
                             stops, np.random.default_rng(0))
    ends = set()
    for s in groups[0].samples:
        ids = s.completion_ids.tolist()
        assert not set(ids[:-1]) & set(stops)  # nothing after a stop id
        assert s.finished == (ids[-1] in stops)
        if s.finished:
            ends.add(ids[-1])
    assert ends == set(stops)  # both ids end completions (a lone EOS check would run past 5)
