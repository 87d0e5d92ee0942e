import numpy as np
import pytest

from engine.rl.objective import ObjectiveConfig, compute_objective, effective_sample_size, group_advantages


def _case(seed=0, shape=(6, 9), spread=0.6):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.5, 0.5, size=shape)
    proximal = logp + rng.normal(0, 0.3, size=shape)
    behaviour = proximal + rng.normal(0, spread, size=shape)
    adv = rng.normal(0, 1, size=shape[0])
    mask = rng.random(shape) < 0.8
    ref = logp + rng.normal(0, 0.2, size=shape)
    return logp, proximal, behaviour, adv, mask, ref


def _torch_reference(logp, proximal, behaviour, adv, mask, cfg, ref=None, n=None):
    """The objective written directly with autograd (independent of the closed form)."""
    torch = pytest.importorskip("torch")
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    p, b = torch.tensor(proximal, dtype=torch.float64), torch.tensor(behaviour, dtype=torch.float64)
    a = torch.tensor(adv, dtype=torch.float64)[:, None]
    m = torch.tensor(mask)
    if cfg.decoupled:
        ratio_pb = torch.exp(p - b)
        keep = m & (ratio_pb >= cfg.mask_low) & (ratio_pb <= cfg.mask_high)
        w = torch.clamp(ratio_pb, max=cfg.is_cap)
        anchor = p
    else:
        keep, w, anchor = m, torch.ones_like(p), b
    u = torch.exp(lp - anchor)
    inner = torch.minimum(u * a, torch.clamp(u, 1 - cfg.eps_low, 1 + cfg.eps_high) * a)
    obj = w * torch.where(a < 0, torch.maximum(inner, cfg.dual_clip * a), inner)  # dual clip
    n = float(m.sum()) if n is None else n
    loss = -(obj * keep).sum() / n
    if ref is not None and cfg.kl_coef > 0:
        r = torch.tensor(ref, dtype=torch.float64)
        k3 = torch.exp(r - lp) - (r - lp) - 1
        loss = loss + cfg.kl_coef * (k3 * m).sum() / n
    loss.backward()
    return float(loss.detach()), lp.grad.numpy()


@pytest.mark.parametrize("cfg", [
    ObjectiveConfig(),
    ObjectiveConfig(decoupled=False),
    ObjectiveConfig(kl_coef=0.1),
    ObjectiveConfig(is_cap=1.2, mask_low=0.8, mask_high=1.5, eps_low=0.1, eps_high=0.1),
], ids=["decoupled", "uncorrected", "kl", "tight"])
def test_loss_and_gradient_match_autograd_reference(cfg):
    logp, prox, behav, adv, mask, ref = _case()
    result = compute_objective(logp, prox, behav, adv, mask, cfg, ref_logp=ref)
    loss, grad = _torch_reference(logp, prox, behav, adv, mask, cfg, ref)
    assert result.loss == pytest.approx(loss, rel=1e-9, abs=1e-12)
    np.testing.assert_allclose(result.grad, grad, rtol=1e-5, atol=1e-7)
    assert result.grad.dtype == np.float32 and result.grad.shape == logp.shape


def test_gradient_matches_finite_differences_away_from_clip_kinks():
    logp, prox, behav, adv, mask, _ = _case(seed=3, spread=0.2)
    cfg = ObjectiveConfig()
    grad = compute_objective(logp, prox, behav, adv, mask, cfg).grad
    h = 1e-6
    for idx in [(0, 0), (1, 3), (4, 7), (5, 8)]:
        up, down = logp.copy(), logp.copy()
        up[idx] += h
        down[idx] -= h
        fd = (compute_objective(up, prox, behav, adv, mask, cfg).loss
              - compute_objective(down, prox, behav, adv, mask, cfg).loss) / (2 * h)
        assert grad[idx] == pytest.approx(fd, abs=1e-6)


def test_tokens_outside_the_band_are_masked_and_counted():
    logp = np.zeros((1, 4))
    behaviour = np.log(np.array([[1.0, 1 / 0.4, 1 / 6.0, 1.0]]))  # exp(p - b) = 1, 0.4, 6, 1
    mask = np.array([[True, True, True, False]])
    result = compute_objective(logp, logp, behaviour, np.array([1.0]), mask, ObjectiveConfig())
    assert result.stats.masked_fraction == pytest.approx(2 / 3)
    assert result.grad[0, 1] == 0.0 and result.grad[0, 2] == 0.0 and result.grad[0, 3] == 0.0
    assert result.grad[0, 0] == pytest.approx(-1 / 3)  # w = 1, u = 1, A = 1, N = 3 completion tokens


def test_importance_weight_is_truncated_at_the_cap():
    logp = np.zeros((1, 2))
    behaviour = np.log(np.array([[1 / 1.5, 1 / 4.0]]))  # exp(p - b) = 1.5 and 4 (cap 2)
    result = compute_objective(logp, logp, behaviour, np.array([1.0]), np.ones((1, 2), bool), ObjectiveConfig())
    np.testing.assert_allclose(result.grad[0], [-1.5 / 2, -2.0 / 2])
    assert result.stats.mean_weight == pytest.approx(1.75)


def test_clip_removes_the_gradient_only_when_the_clipped_term_is_smaller():
    cfg = ObjectiveConfig()
    prox = np.zeros((4, 1))
    logp = np.log(np.array([[1.5], [1.5], [0.5], [0.5]]))  # u above and below the clip range
    adv = np.array([1.0, -1.0, 1.0, -1.0])
    result = compute_objective(logp, prox, prox, adv, np.ones((4, 1), bool), cfg)
    # A > 0 with u > 1 + eps_high, and A < 0 with u < 1 - eps_low: clipped, no gradient.
    assert result.grad[0, 0] == 0.0 and result.grad[3, 0] == 0.0
    # The other two keep the unclipped surrogate's gradient u * A (negated, / N).
    assert result.grad[1, 0] == pytest.approx(1.5 / 4)
    assert result.grad[2, 0] == pytest.approx(-0.5 / 4)
    assert result.stats.clipped_fraction == pytest.approx(0.5)


def test_uncorrected_objective_takes_the_behaviour_policy_as_anchor():
    logp = np.zeros((1, 3))
    behaviour = np.log(np.array([[1.0, 1 / 1.1, 1 / 10.0]]))
    result = compute_objective(logp, logp, behaviour, np.array([1.0]), np.ones((1, 3), bool),
                               ObjectiveConfig(decoupled=False))
    assert result.stats.masked_fraction == 0.0
    # u = pi / mu: 1 and 1.1 unclipped; 10 is clipped for a positive advantage.
    np.testing.assert_allclose(result.grad[0], [-1 / 3, -1.1 / 3, 0.0], rtol=1e-6)


def test_token_level_normalisation_makes_micro_batches_add_up_to_the_batch():
    logp, prox, behav, adv, mask, _ = _case(seed=5)
    cfg = ObjectiveConfig()
    whole = compute_objective(logp, prox, behav, adv, mask, cfg)
    n = mask.sum()
    parts = [compute_objective(logp[s], prox[s], behav[s], adv[s], mask[s], cfg, normaliser=n)
             for s in (slice(0, 2), slice(2, 6))]
    assert sum(p.loss for p in parts) == pytest.approx(whole.loss)
    np.testing.assert_allclose(np.concatenate([p.grad for p in parts]), whole.grad, rtol=1e-6)


def test_kl_needs_reference_logprobs():
    logp, prox, behav, adv, mask, _ = _case()
    with pytest.raises(ValueError, match="reference"):
        compute_objective(logp, prox, behav, adv, mask, ObjectiveConfig(kl_coef=0.1))


def test_group_advantages_centre_scale_and_drop_zero_variance_groups():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.2, 0.4, 0.6, 0.8]])
    adv, keep = group_advantages(rewards)
    assert keep.tolist() == [True, False, True]
    np.testing.assert_allclose(adv[0], [0.5, -0.5, -0.5, 0.5])
    np.testing.assert_allclose(adv[1], 0.0)
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-12)
    scaled, _ = group_advantages(rewards, scale_by_std=True)
    np.testing.assert_allclose(scaled[0], [1, -1, -1, 1], atol=1e-5)
    assert scaled[2].std() == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError):
        group_advantages(np.array([1.0, 2.0]))
    with pytest.raises(ValueError):
        group_advantages(np.array([[np.nan, 1.0]]))


def test_effective_sample_size_is_one_for_equal_weights_and_small_when_one_dominates():
    assert effective_sample_size(np.ones(10)) == pytest.approx(1.0)
    assert effective_sample_size(np.array([100.0] + [1e-3] * 9)) < 0.11


def test_invalid_configs_are_refused():
    for bad in (dict(eps_low=1.0), dict(is_cap=0.0), dict(mask_low=1.5), dict(mask_high=0.9), dict(kl_coef=-1)):
        with pytest.raises(ValueError):
            ObjectiveConfig(**bad)


def test_forged_proximal_and_behaviour_log_probs_cannot_produce_a_huge_gradient():
    """Issue 14 finding 4: b = -40, p = -40 + ln 2 passes the band (exp(p - b) = 2) and made
    u = exp(logp - p) ~ e^40; with A < 0 the plain branch gave a per-token gradient ~1e17."""
    shape = (4, 8)
    logp = np.full(shape, -0.1)
    behaviour = np.full(shape, -40.0)
    proximal = behaviour + np.log(2.0)
    adv = np.array([-1.0, -0.5, 0.5, 1.0])
    mask = np.ones(shape, dtype=bool)
    cfg = ObjectiveConfig()
    result = compute_objective(logp, proximal, behaviour, adv, mask, cfg)
    bound = cfg.is_cap * max(cfg.dual_clip, 1.0) * np.abs(adv).max() / mask.sum()
    assert np.all(np.isfinite(result.grad)) and np.abs(result.grad).max() <= bound + 1e-12
    assert abs(result.loss) <= cfg.is_cap * cfg.dual_clip * np.abs(adv).max()


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError):
        ObjectiveConfig(dual_clip=1.0)
