"""Clipped policy-gradient losses: PPO, dual-clip, DAPO clip-higher; entropy bonus; KL in loss.

One function, `ppo_policy_loss`, implements all three clips; the registry names are presets of
it (`ppo`: symmetric clip; `dual_clip`: adds the dual clip with c = 3; `clip_higher`: DAPO's
decoupled `clip_high = 0.28`). Any preset still accepts every keyword, so the names only change
defaults.

Metrics are a dict of detached 0-dim tensors, computed on this rank's tokens only (the logger
averages over ranks). `pg_loss` is the aggregated clip loss as returned (so with a DP `group`
it is this rank's share, see `rl3d.algos.core`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from rl3d.algos.core import aggregate_loss, check_same_shape, masked_mean, masked_var, zero_padding
from rl3d.algos.kl import KL_ESTIMATORS, kl_k3
from rl3d.algos.registry import POLICY_LOSSES

Tensor = torch.Tensor

# Bounds log(pi/pi_old) so exp() stays finite when a stale sample is very unlikely now.
_MAX_LOG_RATIO = 20.0


def _check_clips(clip_low: float, clip_high: float, dual_clip_c: float | None) -> None:
    if not 0.0 < clip_low < 1.0:
        raise ValueError(f"clip_low must be in (0, 1), got {clip_low}")
    if clip_high <= 0.0:
        raise ValueError(f"clip_high must be > 0, got {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")


def ppo_policy_loss(
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    entropy_BT: Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logp_BT: Tensor | None = None,
    kl_loss_coef: float = 0.0,
    kl_estimator: str = "k3",
    weights_BT: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with optional dual clip, entropy bonus and KL-in-loss.

    With `rho_t = pi(y_t) / pi_old(y_t)` and advantage `A_t`, the per-token loss is
        L_t = max(-A_t * rho_t, -A_t * clip(rho_t, 1 - clip_low, 1 + clip_high))   (Schulman 2017;
              `clip_high = clip_low` unless given, DAPO's clip-higher, Yu et al. 2025)
    and with dual clip (Ye et al. 2020), for A_t < 0 only: L_t <- min(L_t, -c * A_t).
    `weights_BT` (a rollout-mismatch correction, `rl3d.algos.rollout_correction`) scales each
    token's L_t; a token weighted 0 drops out of the surrogate but still counts in the
    aggregation's denominator, so masking never re-weights the other tokens.
    The objective is `agg(L) - entropy_coef * agg(H) + kl_loss_coef * agg(KL(pi || pi_ref))`,
    `agg` being `loss_agg_mode` (over `group` when given).

    Metrics: `pg_loss`, `pg_clipfrac` (tokens where the clip is active), `pg_clipfrac_lower`
    (tokens where the dual clip is active), `approx_kl` (k3 estimate of KL(pi_old || pi)),
    `adv_mean`, `adv_std`; `entropy` when `entropy_BT` is given; `kl_loss` when `ref_logp_BT` is.
    """
    clip_high = clip_low if clip_high is None else clip_high
    _check_clips(clip_low, clip_high, dual_clip_c)
    check_same_shape(mask_BT, logp_BT=logp_BT, old_logp_BT=old_logp_BT, adv_BT=adv_BT)
    check_same_shape(mask_BT, entropy_BT=entropy_BT, ref_logp_BT=ref_logp_BT, weights_BT=weights_BT)
    if kl_loss_coef != 0.0 and ref_logp_BT is None:
        raise ValueError("kl_loss_coef is set but ref_logp_BT was not given")
    if entropy_coef != 0.0 and entropy_BT is None:
        raise ValueError("entropy_coef is set but entropy_BT was not given")

    # Zeroing every input at padding first (selecting, not multiplying) keeps NaN/inf there out
    # of the loss and of every gradient, including the gradient at padding positions.
    logp_BT, old_logp_BT, adv_BT = (zero_padding(x, mask_BT) for x in (logp_BT, old_logp_BT, adv_BT))
    log_ratio_BT = (logp_BT - old_logp_BT).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio_BT = torch.exp(log_ratio_BT)

    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_losses_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_active_BT = torch.zeros_like(mask_BT, dtype=torch.bool)
    if dual_clip_c is not None:
        dual_bound_BT = -adv_BT * dual_clip_c
        dual_active_BT = (adv_BT < 0) & (pg_losses_BT > dual_bound_BT)
        pg_losses_BT = torch.where(dual_active_BT, dual_bound_BT, pg_losses_BT)
    if weights_BT is not None:
        pg_losses_BT = pg_losses_BT * zero_padding(weights_BT.detach(), mask_BT)

    pg_loss = aggregate_loss(pg_losses_BT, mask_BT, mode=loss_agg_mode, group=group)
    loss = pg_loss
    metrics = {
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": masked_mean((clipped_BT > unclipped_BT).float(), mask_BT).detach(),
        "pg_clipfrac_lower": masked_mean(dual_active_BT.float(), mask_BT).detach(),
        "approx_kl": masked_mean(kl_k3(old_logp_BT, logp_BT), mask_BT).detach(),
        "adv_mean": masked_mean(adv_BT, mask_BT).detach(),
        "adv_std": masked_var(adv_BT, mask_BT).sqrt().detach(),
    }
    if entropy_BT is not None:
        entropy_BT = zero_padding(entropy_BT, mask_BT)
        loss = loss - entropy_coef * aggregate_loss(entropy_BT, mask_BT, mode=loss_agg_mode, group=group)
        metrics["entropy"] = masked_mean(entropy_BT, mask_BT).detach()
    if ref_logp_BT is not None:
        kl_BT = KL_ESTIMATORS.get(kl_estimator)(logp_BT, zero_padding(ref_logp_BT, mask_BT))
        kl_loss = aggregate_loss(kl_BT, mask_BT, mode=loss_agg_mode, group=group)
        loss = loss + kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    return loss, metrics


POLICY_LOSSES.register("ppo", ppo_policy_loss)
POLICY_LOSSES.register("dual_clip", functools.partial(ppo_policy_loss, dual_clip_c=3.0))
POLICY_LOSSES.register("clip_higher", functools.partial(ppo_policy_loss, clip_low=0.2, clip_high=0.28))
