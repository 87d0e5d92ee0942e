"""``backends.base.sample_from_logits``: the token drawn, its behaviour log-prob, greedy and top-p."""

import numpy as np

from backends.base import sample_from_logits


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_draws_follow_the_tempered_distribution_and_report_its_log_prob():
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]] * 20000, dtype=np.float32))
    tokens, logp = sample_from_logits(logits, np.random.default_rng(0), temperature=0.5)
    probs = np.exp(_log_softmax(np.log([0.1, 0.2, 0.3, 0.4]) / 0.5))
    np.testing.assert_allclose(np.bincount(tokens, minlength=4) / len(tokens), probs, atol=0.01)
    np.testing.assert_allclose(logp, np.log(probs)[tokens], rtol=1e-6)


def test_a_row_draws_by_its_own_uniform_whatever_rows_beside_it():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((6, 50)).astype(np.float32)
    draws = rng.random((6, 1))
    together, _ = sample_from_logits(logits, rng, temperature=1.0, draws=draws)
    alone = [sample_from_logits(logits[i:i + 1], rng, temperature=1.0, draws=draws[i:i + 1])[0][0] for i in range(6)]
    assert together.tolist() == alone
    edges = np.cumsum(np.exp(_log_softmax(logits.astype(np.float64))), axis=-1)
    assert together.tolist() == [int(np.searchsorted(e, d)) for e, d in zip(edges, draws[:, 0])]


def test_greedy_takes_the_argmax_and_top_p_keeps_the_nucleus_only():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 5000))
    tokens, logp = sample_from_logits(logits, np.random.default_rng(2), temperature=0.0)
    assert set(tokens.tolist()) == {0}
    np.testing.assert_allclose(logp, np.log(0.5), rtol=1e-6)
    tokens, logp = sample_from_logits(logits, np.random.default_rng(3), temperature=1.0, top_p=0.7)
    assert set(tokens.tolist()) == {0, 1}  # 0.5 + 0.3 covers 0.7; 0.15 and 0.05 never
    np.testing.assert_allclose(np.bincount(tokens) / len(tokens), [0.5 / 0.8, 0.3 / 0.8], atol=0.02)
    np.testing.assert_allclose(logp, np.log([0.5, 0.3])[tokens], rtol=1e-6)  # before top-p truncation
