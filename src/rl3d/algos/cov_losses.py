"""Covariance-based policy losses: Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism
of Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617).

Policy entropy falls where a token's log-probability and its advantage covary: a likely token
with a high advantage sharpens the distribution. Both losses restrain the update of the few
tokens with the largest centred product

    cov_t = (A_t - mean A) * (log pi(y_t) - mean log pi)

(means over this micro-batch's valid tokens, detached): Clip-Cov drops a random `cov_ratio`
share of those with `cov_lb < cov_t < cov_ub` from the gradient, KL-Cov adds `kl_cov_coef *
|log r_t|` to the top `cov_ratio` share. Defaults are the paper's (Clip-Cov r = 2e-4 in
(1, 5); KL-Cov k = 2e-3 with coefficient 1, its 7B setting). The selection is per rank and
micro-batch, as in the paper's reference implementation; Clip-Cov's draw uses torch's
global generator (seeded by the trainer).
"""

from __future__ import annotations

import torch

from rl3d.algos.core import masked_mean
from rl3d.algos.policy_loss import clip_active, finish, prepare, ratio_stats
from rl3d.algos.registry import POLICY_LOSSES

Tensor = torch.Tensor


def _covariance(logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor) -> Tensor:
    logp, adv = logp_BT.detach(), adv_BT.detach()
    return (adv - masked_mean(adv, mask_BT)) * (logp - masked_mean(logp, mask_BT))


def _num_selected(ratio: float, mask_BT: Tensor) -> int:
    return max(int(ratio * int(mask_BT.bool().sum())), 1)


def _check_ratio(cov_ratio: float) -> None:
    if not 0.0 < cov_ratio <= 1.0:
        raise ValueError(f"cov_ratio must be in (0, 1], got {cov_ratio}")


def clip_cov_policy_loss(
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    cov_ratio: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    **shared: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate, with `max(1, floor(cov_ratio * tokens))` tokens drawn at random
    among those not already clipped with `cov_lb < cov_t < cov_ub` taken out of the gradient:

        L_t = c_t * max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high)),  c_t in {0, 1}

    Metrics: `pg_clipfrac` (PPO's clip), `cov_clipfrac` (tokens with c_t = 0), `cov_mean`,
    `ratio_mean`/`_min`/`_max`.
    """
    clip_high = clip_low if clip_high is None else clip_high
    if not 0.0 < clip_low < 1.0 or clip_high <= 0.0:
        raise ValueError(f"clip_low must be in (0, 1) and clip_high > 0, got {clip_low}, {clip_high}")
    _check_ratio(cov_ratio)
    if not cov_lb < cov_ub:
        raise ValueError(f"cov_lb must be < cov_ub, got {cov_lb}, {cov_ub}")
    logp_BT, old_logp_BT, adv_BT, log_ratio_BT = prepare(logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)
    ratio_BT = torch.exp(log_ratio_BT)
    low, high = 1.0 - clip_low, 1.0 + clip_high
    pg_losses_BT = torch.maximum(-adv_BT * ratio_BT, -adv_BT * ratio_BT.clamp(low, high))
    clipped_BT = clip_active(ratio_BT, adv_BT, low, high)
    cov_BT = _covariance(logp_BT, adv_BT, mask_BT)
    in_band_BT = mask_BT.bool() & ~clipped_BT & (cov_BT > cov_lb) & (cov_BT < cov_ub)
    eligible = in_band_BT.flatten().nonzero()[:, 0]
    draw = torch.randperm(eligible.numel(), device=eligible.device)
    chosen = eligible[draw[: _num_selected(cov_ratio, mask_BT)]]
    keep_BT = torch.ones(mask_BT.numel(), dtype=torch.bool, device=mask_BT.device)
    keep_BT[chosen] = False
    keep_BT = keep_BT.view(mask_BT.shape)
    pg_losses_BT = torch.where(keep_BT, pg_losses_BT, pg_losses_BT.detach())
    metrics = {
        "pg_clipfrac": masked_mean(clipped_BT.float(), mask_BT).detach(),
        "cov_clipfrac": masked_mean((~keep_BT).float(), mask_BT).detach(),
        "cov_mean": masked_mean(cov_BT, mask_BT),
        **ratio_stats(ratio_BT, mask_BT),
    }
    return finish(pg_losses_BT, metrics, logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)


def kl_cov_policy_loss(
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    cov_ratio: float = 2e-3,
    kl_cov_coef: float = 1.0,
    **shared: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The unclipped surrogate with a KL penalty on the `max(1, floor(cov_ratio * tokens))`
    tokens of largest covariance:

        L_t = -A_t r_t + [t in top-k cov] * kl_cov_coef * |log r_t|

    Metrics: `kl_cov_frac` (penalised tokens), `kl_cov_penalty` (mean |log r| over them),
    `cov_mean`, `ratio_mean`/`_min`/`_max`.
    """
    _check_ratio(cov_ratio)
    if kl_cov_coef < 0:
        raise ValueError(f"kl_cov_coef must be >= 0, got {kl_cov_coef}")
    logp_BT, old_logp_BT, adv_BT, log_ratio_BT = prepare(logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)
    ratio_BT = torch.exp(log_ratio_BT)
    cov_BT = _covariance(logp_BT, adv_BT, mask_BT)
    valid = mask_BT.bool().flatten().nonzero()[:, 0]
    num = min(_num_selected(cov_ratio, mask_BT), valid.numel())
    top = valid[cov_BT.flatten()[valid].topk(num).indices]
    penalised_BT = torch.zeros(mask_BT.numel(), dtype=torch.bool, device=mask_BT.device)
    penalised_BT[top] = True
    penalised_BT = penalised_BT.view(mask_BT.shape)
    abs_log_ratio_BT = log_ratio_BT.abs()
    pg_losses_BT = -adv_BT * ratio_BT + torch.where(
        penalised_BT, kl_cov_coef * abs_log_ratio_BT, torch.zeros_like(abs_log_ratio_BT)
    )
    metrics = {
        "kl_cov_frac": masked_mean(penalised_BT.float(), mask_BT).detach(),
        "kl_cov_penalty": masked_mean(abs_log_ratio_BT.detach(), penalised_BT),
        "cov_mean": masked_mean(cov_BT, mask_BT),
        **ratio_stats(ratio_BT, mask_BT),
    }
    return finish(pg_losses_BT, metrics, logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)


POLICY_LOSSES.register("clip_cov", clip_cov_policy_loss)
POLICY_LOSSES.register("kl_cov", kl_cov_policy_loss)
