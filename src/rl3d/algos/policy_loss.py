"""Policy-gradient losses: the terms every loss shares, and PPO's clipped surrogate.

Every registered policy loss computes a per-token surrogate `L_t` and hands it to `finish`,
which applies the rollout-correction weights, aggregates with `loss_agg_mode`, and adds the
entropy bonus and the KL-in-loss term, so that every loss composes with them the same way.
The other losses live in `rl3d.algos.ratio_losses` (GSPO, GMPO, SAPO, CISPO, GPG) and
`rl3d.algos.cov_losses` (Clip-Cov, KL-Cov).

`ppo_policy_loss` implements PPO's three clips; the registry names are presets of it (`ppo`:
symmetric clip; `dual_clip`: adds the dual clip with c = 3; `clip_higher`: DAPO's decoupled
`clip_high = 0.28`). Any preset still accepts every keyword, so the names only change defaults.

Metrics are a dict of detached 0-dim tensors, computed on this rank's tokens only (the logger
averages over ranks). `pg_loss` is the aggregated surrogate as returned (so with a DP `group`
it is this rank's share, see `rl3d.algos.core`). A clip fraction compares the unclipped ratio
with its bound, never the clipped value with the unclipped one: the two can differ by rounding
where no clip is active.
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
MAX_LOG_RATIO = 20.0


def _check_clips(clip_low: float, clip_high: float, dual_clip_c: float | None) -> None:
    if not 0.0 < clip_low < 1.0:
        raise ValueError(f"clip_low must be in (0, 1), got {clip_low}")
    if clip_high <= 0.0:
        raise ValueError(f"clip_high must be > 0, got {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")


def prepare(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    *,
    entropy_BT: Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logp_BT: Tensor | None = None,
    kl_loss_coef: float = 0.0,
    weights_BT: Tensor | None = None,
    **_: object,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Checks the inputs; returns `(logp, old_logp, adv, log_ratio)` with zeros at padding.

    Zeroing every input at padding first (selecting, not multiplying) keeps NaN/inf there out
    of the loss and of every gradient, including the gradient at padding positions."""
    check_same_shape(mask_BT, logp_BT=logp_BT, old_logp_BT=old_logp_BT, adv_BT=adv_BT)
    check_same_shape(mask_BT, entropy_BT=entropy_BT, ref_logp_BT=ref_logp_BT, weights_BT=weights_BT)
    if kl_loss_coef != 0.0 and ref_logp_BT is None:
        raise ValueError("kl_loss_coef is set but ref_logp_BT was not given")
    if entropy_coef != 0.0 and entropy_BT is None:
        raise ValueError("entropy_coef is set but entropy_BT was not given")
    logp_BT, old_logp_BT, adv_BT = (zero_padding(x, mask_BT) for x in (logp_BT, old_logp_BT, adv_BT))
    log_ratio_BT = (logp_BT - old_logp_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return logp_BT, old_logp_BT, adv_BT, log_ratio_BT


def finish(
    pg_losses_BT: Tensor,
    metrics: dict[str, Tensor],
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    entropy_BT: Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logp_BT: Tensor | None = None,
    kl_loss_coef: float = 0.0,
    kl_estimator: str = "k3",
    weights_BT: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The objective `agg(w * L) - entropy_coef * agg(H) + kl_loss_coef * agg(KL(pi || pi_ref))`
    from the per-token surrogate `L` (`pg_losses_BT`, zero at padding); `logp`, `old_logp` and
    `adv` as returned by `prepare`.

    `weights_BT` (a rollout-mismatch correction, `rl3d.algos.rollout_correction`) scales each
    token's L_t as a constant; a token weighted 0 drops out of the surrogate but still counts in
    the aggregation's denominator, so masking never re-weights the other tokens. `agg` is
    `loss_agg_mode`, over `group` when given. Adds `pg_loss`, `approx_kl` (k3 estimate of
    KL(pi_old || pi)), `adv_mean`, `adv_std`, and `entropy` / `kl_loss` when those are given, to
    the loss's own `metrics`."""
    if weights_BT is not None:
        pg_losses_BT = pg_losses_BT * zero_padding(weights_BT.detach(), mask_BT)
    pg_loss = aggregate_loss(pg_losses_BT, mask_BT, mode=loss_agg_mode, group=group)
    loss = pg_loss
    metrics = {
        "pg_loss": pg_loss.detach(),
        **metrics,
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


def clip_active(ratio_BT: Tensor, adv_BT: Tensor, low: float, high: float) -> Tensor:
    """Tokens whose clip binds: the ratio past `high` with A > 0, or below `low` with A < 0
    (where `max(-A r, -A clip(r))` takes the clipped term)."""
    return ((adv_BT > 0) & (ratio_BT > high)) | ((adv_BT < 0) & (ratio_BT < low))


def ratio_stats(ratio_BT: Tensor, mask_BT: Tensor, prefix: str = "ratio") -> dict[str, Tensor]:
    """`<prefix>_mean`, `_min`, `_max` of the ratio over valid positions (0 when there are none)."""
    valid = ratio_BT.detach()[mask_BT.bool()]
    empty = torch.zeros((), dtype=ratio_BT.dtype, device=ratio_BT.device)
    return {
        f"{prefix}_mean": valid.mean() if valid.numel() else empty,
        f"{prefix}_min": valid.min() if valid.numel() else empty,
        f"{prefix}_max": valid.max() if valid.numel() else empty,
    }


def ppo_policy_loss(
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip_c: float | None = None,
    **shared: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with optional dual clip; `shared` are `finish`'s keywords
    (`loss_agg_mode`, `entropy_BT`, `entropy_coef`, `ref_logp_BT`, `kl_loss_coef`,
    `kl_estimator`, `weights_BT`, `group`).

    With `rho_t = pi(y_t) / pi_old(y_t)` and advantage `A_t`, the per-token loss is
        L_t = max(-A_t * rho_t, -A_t * clip(rho_t, 1 - clip_low, 1 + clip_high))   (Schulman 2017;
              `clip_high = clip_low` unless given, DAPO's clip-higher, Yu et al. 2025)
    and with dual clip (Ye et al. 2020), for A_t < 0 only: L_t <- min(L_t, -c * A_t).

    Metrics: `pg_clipfrac` (tokens where the clip is active), `pg_clipfrac_lower` (tokens where
    the dual clip is active), and `finish`'s.
    """
    clip_high = clip_low if clip_high is None else clip_high
    _check_clips(clip_low, clip_high, dual_clip_c)
    logp_BT, old_logp_BT, adv_BT, log_ratio_BT = prepare(logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)
    ratio_BT = torch.exp(log_ratio_BT)

    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_losses_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_active_BT = torch.zeros_like(mask_BT, dtype=torch.bool)
    if dual_clip_c is not None:
        # For A < 0 the clipped loss is -A * max(rho, 1 - clip_low), past -c * A iff rho > c.
        dual_active_BT = (adv_BT < 0) & (ratio_BT > dual_clip_c)
        pg_losses_BT = torch.where(dual_active_BT, -adv_BT * dual_clip_c, pg_losses_BT)
    active_BT = clip_active(ratio_BT, adv_BT, 1.0 - clip_low, 1.0 + clip_high)
    metrics = {
        "pg_clipfrac": masked_mean(active_BT.float(), mask_BT).detach(),
        "pg_clipfrac_lower": masked_mean(dual_active_BT.float(), mask_BT).detach(),
    }
    return finish(pg_losses_BT, metrics, logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)


POLICY_LOSSES.register("ppo", ppo_policy_loss)
POLICY_LOSSES.register("dual_clip", functools.partial(ppo_policy_loss, dual_clip_c=3.0))
POLICY_LOSSES.register("clip_higher", functools.partial(ppo_policy_loss, clip_low=0.2, clip_high=0.28))
