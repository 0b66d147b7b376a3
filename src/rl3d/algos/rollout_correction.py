"""Rollout-training mismatch correction: importance weights between the policy the trainer
computes (pi_old) and the one the rollout engine sampled from (pi_rollout).

A rollout engine in another precision or with other kernels (SGLang in bf16), or a stale policy,
samples from pi_rollout != pi_old; PPO's ratio pi / pi_old then corrects for the update but not
for the sampling, and the gradient is biased. With the per-token ratio r_t = pi_old(y_t) /
pi_rollout(y_t) and a threshold C:

    tis       w_t = min(r_t, C)                                  (truncated importance sampling)
    mis       w_t = 1 where 1/C <= r_t <= C, else the token is masked out of the loss
    seq_tis   w_t = min(prod_t r_t, C) for every token of the sequence

The policy loss multiplies each token's surrogate by w_t (a constant: no gradient through it)
and drops masked tokens from its aggregation, so the correction composes with every policy-loss
preset and every aggregation mode.
"""

from __future__ import annotations

import torch

from rl3d.algos.core import masked_mean, zero_padding
from rl3d.algos.kl import kl_k3

Tensor = torch.Tensor
MODES = ("none", "tis", "mis", "seq_tis")
_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: far past any threshold, and finite


def rollout_weights(
    old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, *, mode: str, threshold: float
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """(weights_BT, mask_BT, metrics): the importance weights of `mode`, the loss mask with the
    tokens `mis` drops removed, and `weight_mean`, `weight_max`, `clipped_frac`, `masked_frac`
    (over the response tokens) plus `kl_k3` (rollout vs trainer log-probs)."""
    if mode not in MODES:
        raise ValueError(f"rollout correction mode {mode!r}; known: {', '.join(MODES)}")
    if threshold <= 1.0:
        raise ValueError(f"rollout correction threshold must be > 1, got {threshold}")
    mask_BT = mask_BT.bool()
    old, rollout = (zero_padding(x.detach().float(), mask_BT) for x in (old_logp_BT, rollout_logp_BT))
    log_ratio_BT = (old - rollout).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio_BT = torch.exp(log_ratio_BT)
    keep_BT = mask_BT
    clipped_BT = torch.zeros_like(mask_BT)
    if mode == "none":
        weights_BT = torch.ones_like(ratio_BT)
    elif mode == "tis":
        clipped_BT = mask_BT & (ratio_BT > threshold)
        weights_BT = ratio_BT.clamp(max=threshold)
    elif mode == "mis":
        keep_BT = mask_BT & (ratio_BT >= 1.0 / threshold) & (ratio_BT <= threshold)
        weights_BT = torch.ones_like(ratio_BT)
    else:  # seq_tis
        seq_ratio_B = torch.exp((log_ratio_BT * mask_BT).sum(-1).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        clipped_BT = mask_BT & (seq_ratio_B > threshold)[:, None]
        weights_BT = seq_ratio_B.clamp(max=threshold)[:, None].expand_as(ratio_BT)
    weights_BT = torch.where(keep_BT, weights_BT, torch.zeros_like(weights_BT))
    valid = weights_BT[mask_BT]
    metrics = {
        "weight_mean": masked_mean(weights_BT, mask_BT),
        "weight_max": valid.max() if valid.numel() else torch.zeros(()),
        "clipped_frac": masked_mean(clipped_BT.float(), mask_BT),
        "masked_frac": masked_mean((mask_BT & ~keep_BT).float(), mask_BT),
        "kl_k3": masked_mean(kl_k3(rollout, old), mask_BT),
    }
    return weights_BT, keep_BT, metrics
