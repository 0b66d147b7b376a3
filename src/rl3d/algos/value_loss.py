"""Clipped value loss for the critic (and for Safe-RLHF's cost critic)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl3d.algos.core import aggregate_loss, check_same_shape, masked_mean, masked_var, zero_padding

Tensor = torch.Tensor


def explained_variance(
    values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor, *, group: dist.ProcessGroup | None = None
) -> Tensor:
    """`1 - Var(R - V) / Var(R)` over valid tokens: 1 is a perfect critic, 0 no better than a
    constant, negative worse. NaN when the returns are constant (the ratio is undefined)."""
    var_returns = masked_var(returns_BT, mask_BT, group=group)
    var_residual = masked_var(returns_BT - values_BT, mask_BT, group=group)
    # torch.where, not an `if`, so that a GPU metric does not force a host sync.
    ratio = var_residual / torch.where(var_returns > 0, var_returns, torch.ones_like(var_returns))
    return torch.where(var_returns > 0, 1.0 - ratio, torch.full_like(ratio, float("nan"))).detach()


def clipped_value_loss(
    *,
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    mask_BT: Tensor,
    clip_range: float | None = 0.2,
    loss_agg_mode: str = "token-mean",
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO value loss with clipping around the rollout-time values.

        V_clip = V_old + clip(V - V_old, -clip_range, clip_range)
        L_t    = 1/2 * max((V - R)^2, (V_clip - R)^2)

    `clip_range=None` gives the plain `1/2 (V - R)^2`. Metrics (detached 0-dim tensors, this
    rank's tokens): `vf_loss`, `vf_clipfrac` (tokens whose clip binds: |V - V_old| past the
    range and the clipped term the larger; `V_clip` can differ from `V` by rounding inside it),
    `vf_explained_var`, `values_mean`, `returns_mean`.
    """
    check_same_shape(mask_BT, values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT)
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"value clip_range must be > 0 or None, got {clip_range}")
    values_BT, old_values_BT, returns_BT = (
        zero_padding(x, mask_BT) for x in (values_BT, old_values_BT, returns_BT)
    )
    unclipped_BT = (values_BT - returns_BT) ** 2
    if clip_range is None:
        losses_BT = unclipped_BT
        clip_active_BT = torch.zeros_like(mask_BT, dtype=torch.bool)
    else:
        clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip_range, clip_range)
        clipped_BT = (clipped_values_BT - returns_BT) ** 2
        losses_BT = torch.maximum(unclipped_BT, clipped_BT)
        outside_BT = (values_BT - old_values_BT).abs() > clip_range
        clip_active_BT = outside_BT & (clipped_BT > unclipped_BT)
    loss = 0.5 * aggregate_loss(losses_BT, mask_BT, mode=loss_agg_mode, group=group)
    metrics = {
        "vf_loss": loss.detach(),
        "vf_clipfrac": masked_mean(clip_active_BT.float(), mask_BT).detach(),
        "vf_explained_var": explained_variance(values_BT.detach(), returns_BT, mask_BT),
        "values_mean": masked_mean(values_BT, mask_BT).detach(),
        "returns_mean": masked_mean(returns_BT, mask_BT).detach(),
    }
    return loss, metrics
