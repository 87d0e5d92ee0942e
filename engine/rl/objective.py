"""The decoupled-PPO objective in numpy: loss and its closed-form gradient w.r.t. log-probs.

Per completion token t of sample i (all inputs are per-token arrays ``[B, T]``):

* ``u = exp(logp - p)``: current policy over the *proximal* policy (the weights at the
  start of this update, recomputed by the trainer);
* ``w = min(exp(p - b), C)``: truncated importance weight of the proximal policy over the
  *behaviour* policy that sampled the token (possibly several versions old);
* tokens whose ``exp(p - b)`` falls outside ``[mask_low, mask_high]`` are masked out;
* ``objective_t = w * min(u A_i, clip(u, 1 - eps_low, 1 + eps_high) A_i)``, and for
  ``A_i < 0`` at least ``dual_clip * A_i`` (dual clip): with ``w <= C`` this bounds every
  token's gradient by ``C * max(dual_clip, 1) * |A_i| / N`` whatever the proximal and
  behaviour log-probs say — a forged ``p`` far below the current log-prob (``u ~ e^40``)
  cannot produce a huge step;
* ``loss = -sum_t mask_t objective_t / N + kl_coef * sum_t mask_t k3_t / N`` with the
  k3 estimator ``k3 = exp(r - logp) - (r - logp) - 1`` of KL(pi || ref) and N the number
  of completion tokens in the whole batch (token-level normalisation).

With ``decoupled=False`` the objective is standard PPO that ignores staleness: the
behaviour log-prob plays the proximal role (``p := b``), ``w = 1`` and nothing is masked.

The last stage backpropagates ``grad = dloss/dlogp`` through the stage chain, so no
tensor library is needed here. What it does not know: models, tokens, rewards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ObjectiveConfig:
    """Hyper-parameters of the objective. Validated on construction.

    Fields:
      eps_low / eps_high: PPO clip range ``[1 - eps_low, 1 + eps_high]`` for ``u``.
      is_cap: C, the truncation of the importance weight ``exp(p - b)``.
      mask_low / mask_high: band of ``exp(p - b)`` outside which tokens are masked.
      decoupled: True = the decoupled objective above (staleness corrected);
        False = plain PPO against the behaviour policy (the uncorrected baseline).
      dual_clip: c > 1; for negative advantages the surrogate is floored at ``c * A``
        (no gradient there), which bounds the per-token gradient (a hostile-input guard).
      kl_coef: weight of the k3 KL penalty to a reference policy (0 disables it).
      scale_by_std: divide group advantages by the group's reward std (plus ``std_eps``).
      std_eps: added to the std before dividing; a value near the reward's resolution keeps
        near-unanimous groups (one miss in G) from dominating the batch.
    """

    eps_low: float = 0.2
    eps_high: float = 0.28
    is_cap: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 5.0
    decoupled: bool = True
    dual_clip: float = 3.0
    kl_coef: float = 0.0
    scale_by_std: bool = False
    std_eps: float = 1e-6

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low < 1.0 or self.eps_high < 0.0:
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.is_cap <= 0.0:
            raise ValueError(f"is_cap must be > 0, got {self.is_cap}")
        if not 0.0 <= self.mask_low < 1.0 < self.mask_high:
            raise ValueError(f"need 0 <= mask_low < 1 < mask_high, got [{self.mask_low}, {self.mask_high}]")
        if not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if not 0.0 < self.std_eps < 10.0:
            raise ValueError(f"std_eps must be in (0, 10), got {self.std_eps}")


@dataclass(frozen=True)
class ObjectiveStats:
    """Diagnostics of one evaluation of the objective (token counts over ``mask``)."""

    num_tokens: int  #: completion tokens (before the band mask)
    masked_fraction: float  #: share of them masked by the ``exp(p - b)`` band
    clipped_fraction: float  #: share of kept tokens whose gradient the PPO clip removed
    ess: float  #: effective sample size of the weights ``w`` over kept tokens, as a fraction in (0, 1]
    mean_weight: float  #: mean ``w`` over kept tokens
    kl: float  #: mean k3 estimate over completion tokens (0 without a reference)


@dataclass(frozen=True)
class ObjectiveResult:
    loss: float
    grad: np.ndarray  #: dloss/dlogp, float32, same shape as logp (zero off the mask)
    stats: ObjectiveStats


def group_advantages(rewards: np.ndarray, *, scale_by_std: bool = False,
                     eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """Group-relative advantages.

    ``rewards``: ``[groups, G]``. Returns ``(advantages [groups, G], keep [groups])``:
    ``A = r - mean(r_group)`` (divided by ``std + eps`` if ``scale_by_std``); groups whose
    rewards are all equal carry no signal, get ``keep = False`` and zero advantages.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 2 or rewards.shape[1] < 1:
        raise ValueError(f"rewards must be [groups, G], got shape {rewards.shape}")
    if not np.all(np.isfinite(rewards)):
        raise ValueError("rewards must be finite")
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, keepdims=True)
    keep = std[:, 0] > 1e-9
    adv = centred / (std + eps) if scale_by_std else centred
    adv[~keep] = 0.0
    return adv, keep


def effective_sample_size(weights: np.ndarray) -> float:
    """``(sum w)^2 / (n sum w^2)``: 1 when all weights are equal, -> 1/n when one dominates."""
    w = np.asarray(weights, dtype=np.float64).ravel()
    if w.size == 0 or not np.any(w > 0):
        return 1.0
    return float(w.sum() ** 2 / (w.size * np.square(w).sum()))


def compute_objective(logp: np.ndarray, proximal: np.ndarray, behaviour: np.ndarray,
                      advantages: np.ndarray, mask: np.ndarray, config: ObjectiveConfig, *,
                      ref_logp: np.ndarray | None = None, normaliser: float | None = None) -> ObjectiveResult:
    """Evaluate the loss and ``dloss/dlogp``.

    ``logp``, ``proximal``, ``behaviour``, ``mask``: ``[B, T]``; ``advantages``: ``[B]``
    (one per sample) or ``[B, T]``. ``normaliser`` is the token count N of the whole batch
    when ``logp`` is one micro-batch of it (default: ``mask.sum()``).
    """
    logp = np.asarray(logp, dtype=np.float64)
    shape = logp.shape
    proximal = np.broadcast_to(np.asarray(proximal, dtype=np.float64), shape)
    behaviour = np.broadcast_to(np.asarray(behaviour, dtype=np.float64), shape)
    mask = np.broadcast_to(np.asarray(mask, dtype=bool), shape)
    adv = np.asarray(advantages, dtype=np.float64)
    if adv.ndim == 1 and len(shape) == 2:
        adv = adv[:, None]
    adv = np.broadcast_to(adv, shape)
    if config.kl_coef > 0.0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs reference log-probs")
    num_tokens = int(mask.sum())
    n = float(normaliser) if normaliser is not None else float(max(num_tokens, 1))
    if n <= 0.0:
        raise ValueError(f"normaliser must be > 0, got {normaliser}")

    if config.decoupled:
        prox_over_behav = np.exp(np.clip(proximal - behaviour, -50.0, 50.0))
        in_band = (prox_over_behav >= config.mask_low) & (prox_over_behav <= config.mask_high)
        weight = np.minimum(prox_over_behav, config.is_cap)
        anchor = proximal
    else:
        in_band = np.ones(shape, dtype=bool)
        weight = np.ones(shape)
        anchor = behaviour
    kept = mask & in_band
    u = np.exp(np.clip(logp - anchor, -50.0, 50.0))
    u_clipped = np.clip(u, 1.0 - config.eps_low, 1.0 + config.eps_high)
    surr_plain, surr_clipped = u * adv, u_clipped * adv
    take_plain = surr_plain <= surr_clipped
    per_token = np.where(take_plain, surr_plain, surr_clipped)
    # d/dlogp of min(uA, clip(u)A): uA where the plain term is the minimum, 0 where the
    # clipped (constant) term is strictly smaller.
    dper_token = np.where(take_plain, surr_plain, 0.0)
    floor = config.dual_clip * adv  # only binds where adv < 0 (then per_token is <= 0)
    dual = (adv < 0) & (per_token < floor)
    per_token = np.where(dual, floor, per_token)
    dper_token = np.where(dual, 0.0, dper_token)
    loss = -float(np.sum(np.where(kept, weight * per_token, 0.0))) / n
    grad = -np.where(kept, weight * dper_token, 0.0) / n

    kl_mean = 0.0
    if ref_logp is not None:
        delta = np.clip(np.broadcast_to(np.asarray(ref_logp, dtype=np.float64), shape) - logp, -50.0, 50.0)
        k3 = np.exp(delta) - delta - 1.0
        kl_mean = float(k3[mask].mean()) if num_tokens else 0.0
        if config.kl_coef > 0.0:
            loss += config.kl_coef * float(np.sum(np.where(mask, k3, 0.0))) / n
            grad = grad + config.kl_coef * np.where(mask, 1.0 - np.exp(delta), 0.0) / n

    num_kept = int(kept.sum())
    stats = ObjectiveStats(
        num_tokens=num_tokens,
        masked_fraction=float((mask & ~in_band).sum()) / num_tokens if num_tokens else 0.0,
        clipped_fraction=float((kept & ~take_plain & (adv != 0)).sum()) / num_kept if num_kept else 0.0,
        ess=effective_sample_size(weight[kept]),
        mean_weight=float(weight[kept].mean()) if num_kept else 1.0,
        kl=kl_mean,
    )
    return ObjectiveResult(loss=loss, grad=grad.astype(np.float32), stats=stats)
