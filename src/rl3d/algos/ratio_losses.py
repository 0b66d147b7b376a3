"""Policy losses that change what is clipped or how the ratio enters: GSPO, GMPO, SAPO, CISPO, GPG.

Each builds a per-token surrogate and hands it to `rl3d.algos.policy_loss.finish`, so rollout
correction, the loss aggregations, the entropy bonus and the KL-in-loss term compose with it as
with PPO's. The registered names carry each paper's default hyperparameters as presets; a
recipe's own value wins (`rl3d.algos.algorithm.policy_loss_of`).

GSPO and GMPO are sequence-level objectives (a mean over sequences of a sequence's ratio): they
need `loss_agg_mode: seq-mean-token-mean` and refuse any other (`needs_agg_mode`).
"""

from __future__ import annotations

import torch

from rl3d.algos.core import masked_mean, seq_mean_token_mean, sequence_sums
from rl3d.algos.policy_loss import MAX_LOG_RATIO, clip_active, finish, prepare, ratio_stats
from rl3d.algos.registry import POLICY_LOSSES

Tensor = torch.Tensor
SEQ_MEAN = "seq-mean-token-mean"


def needs_agg_mode(mode: str):
    """Marks a loss whose objective holds only under one aggregation (read by `loss_problem`)."""

    def mark(fn):
        fn.needs_agg_mode = mode
        return fn

    return mark


def _check_agg(name: str, loss_agg_mode: str) -> None:
    if loss_agg_mode != SEQ_MEAN:
        raise ValueError(f"{name} is a sequence-level objective: loss_agg_mode must be {SEQ_MEAN!r}")


def _positive(**values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise ValueError(f"{key} must be > 0, got {value}")


def _sequence_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Each row's mean over its valid tokens, `[B, T] -> [B]` (0 for a row without any)."""
    return sequence_sums(x_BT, mask_BT) / mask_BT.bool().sum(-1).clamp(min=1).to(x_BT.dtype)


@needs_agg_mode(SEQ_MEAN)
def gspo_policy_loss(
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    loss_agg_mode: str = SEQ_MEAN,
    **shared: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071), its token form GSPO-token:

        s_i     = exp(mean_t log(pi(y_t) / pi_old(y_t)))          the length-normalised sequence ratio
        s_i,t   = sg[s_i] * pi(y_t) / sg[pi(y_t)]                 value s_i, gradient s_i * grad log pi
        L_i,t   = max(-A_i,t * s_i,t, -A_i,t * clip(s_i,t, 1 - clip_low, 1 + clip_high))

    aggregated as the mean over sequences of each sequence's token mean. With one advantage per
    sequence (GRPO) this is GSPO's sequence objective exactly, value and gradient. Defaults are
    the paper's clip range (3e-4, 4e-4). Metrics: `seq_clipfrac` (sequences whose clip binds),
    `seq_ratio_mean`/`_min`/`_max`.
    """
    _positive(clip_low=clip_low, clip_high=clip_high)
    _check_agg("gspo", loss_agg_mode)
    logp_BT, old_logp_BT, adv_BT, log_ratio_BT = prepare(logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)
    seq_log_ratio_B = _sequence_mean(log_ratio_BT, mask_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    # (logp - sg[logp]) is exactly 0: the value is s_i, the gradient flows through logp alone.
    ratio_BT = torch.exp((logp_BT - logp_BT.detach()) + seq_log_ratio_B.detach()[:, None])
    low, high = 1.0 - clip_low, 1.0 + clip_high
    pg_losses_BT = torch.maximum(-adv_BT * ratio_BT, -adv_BT * ratio_BT.clamp(low, high))
    active_BT = clip_active(ratio_BT, adv_BT, low, high)
    rows_B = mask_BT.bool().any(-1)
    metrics = {
        "seq_clipfrac": seq_mean_token_mean(active_BT.float(), mask_BT).detach(),
        **ratio_stats(torch.exp(seq_log_ratio_B)[:, None], rows_B[:, None], "seq_ratio"),
    }
    return finish(
        pg_losses_BT, metrics, logp_BT, old_logp_BT, adv_BT, mask_BT, loss_agg_mode=loss_agg_mode, **shared
    )


@needs_agg_mode(SEQ_MEAN)
def gmpo_policy_loss(
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    loss_agg_mode: str = SEQ_MEAN,
    **shared: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): the geometric mean of token ratios, each
    clipped in log space to (-clip_low, clip_high) in the direction of the advantage:

        l_t  = sgn(A_i) * min(sgn(A_i) * log r_t, sgn(A_i) * clip(log r_t, -clip_low, clip_high))
        L_i  = -A_i * exp(mean_t l_t)

    `A_i` is the sequence's mean advantage (GMPO is defined for sequence-level advantages); the
    sequence loss is placed on each of its tokens, so `seq-mean-token-mean` averages it over
    sequences, and a rollout-correction weight applies as its tokens' mean. Defaults are the
    paper's range (e^-0.4, e^0.4). Metrics: `pg_clipfrac` (tokens whose log-ratio clip binds),
    `seq_ratio_mean`/`_min`/`_max` (the clipped geometric-mean ratios).
    """
    _positive(clip_low=clip_low, clip_high=clip_high)
    _check_agg("gmpo", loss_agg_mode)
    logp_BT, old_logp_BT, adv_BT, log_ratio_BT = prepare(logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)
    seq_adv_B = _sequence_mean(adv_BT, mask_BT)
    sign_BT = torch.sign(seq_adv_B)[:, None].expand_as(log_ratio_BT)
    clipped_BT = log_ratio_BT.clamp(-clip_low, clip_high)
    log_ratio_min_BT = sign_BT * torch.minimum(sign_BT * log_ratio_BT, sign_BT * clipped_BT)
    seq_ratio_B = torch.exp(_sequence_mean(log_ratio_min_BT, mask_BT))
    pg_losses_BT = (-seq_adv_B * seq_ratio_B)[:, None].expand_as(log_ratio_BT)
    active_BT = clip_active(log_ratio_BT, sign_BT, -clip_low, clip_high)
    rows_B = mask_BT.bool().any(-1)
    metrics = {
        "pg_clipfrac": masked_mean(active_BT.float(), mask_BT).detach(),
        **ratio_stats(seq_ratio_B[:, None], rows_B[:, None], "seq_ratio"),
    }
    return finish(
        pg_losses_BT, metrics, logp_BT, old_logp_BT, adv_BT, mask_BT, loss_agg_mode=loss_agg_mode, **shared
    )


def sapo_policy_loss(
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **shared: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): a soft, temperature-controlled gate on the
    token ratio in place of a hard clip,

        f(r) = 4 / tau * sigmoid(tau * (r - 1)),   tau = tau_pos if A > 0 else tau_neg
        L_t  = -f(r_t) * A_t

    whose gradient is the policy gradient scaled by `w = 4 p (1 - p)`, `p = sigmoid(tau (r-1))`:
    1 on policy, decaying smoothly as r leaves 1. Defaults are the paper's (tau_pos 1.0,
    tau_neg 1.05); the paper aggregates `seq-mean-token-mean`. Metrics: `gate_weight_mean`
    (mean `w`), `ratio_mean`/`_min`/`_max`.
    """
    _positive(tau_pos=tau_pos, tau_neg=tau_neg)
    logp_BT, old_logp_BT, adv_BT, log_ratio_BT = prepare(logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)
    ratio_BT = torch.exp(log_ratio_BT)
    tau_BT = torch.where(adv_BT > 0, torch.full_like(ratio_BT, tau_pos), torch.full_like(ratio_BT, tau_neg))
    gate_prob_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0))
    pg_losses_BT = -(4.0 / tau_BT) * gate_prob_BT * adv_BT
    weight_BT = 4.0 * gate_prob_BT * (1.0 - gate_prob_BT)
    metrics = {"gate_weight_mean": masked_mean(weight_BT, mask_BT).detach(), **ratio_stats(ratio_BT, mask_BT)}
    return finish(pg_losses_BT, metrics, logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)


def cispo_policy_loss(
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
    **shared: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by the clipped, stop-gradient
    importance weight, so a clipped token still contributes its gradient:

        L_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A_t * log pi(y_t)

    MiniMax-M1 sets no lower bound (`clip_low = 1`: the weight's floor is 0) and tunes only the
    upper one, whose value it does not publish; the preset's 0.28 is DAPO's clip-higher bound.
    Metrics: `pg_clipfrac` (tokens whose weight was truncated), `is_weight_mean`,
    `ratio_mean`/`_min`/`_max`.
    """
    if not 0.0 < clip_low <= 1.0:
        raise ValueError(f"clip_low must be in (0, 1], got {clip_low}")
    _positive(clip_high=clip_high)
    logp_BT, old_logp_BT, adv_BT, log_ratio_BT = prepare(logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)
    ratio_BT = torch.exp(log_ratio_BT).detach()
    low, high = 1.0 - clip_low, 1.0 + clip_high
    weight_BT = ratio_BT.clamp(low, high)
    pg_losses_BT = -weight_BT * adv_BT * logp_BT
    metrics = {
        "pg_clipfrac": masked_mean(((ratio_BT < low) | (ratio_BT > high)).float(), mask_BT).detach(),
        "is_weight_mean": masked_mean(weight_BT, mask_BT).detach(),
        **ratio_stats(ratio_BT, mask_BT),
    }
    return finish(pg_losses_BT, metrics, logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)


def _gpg_step_hooks(settings: dict) -> list[str]:
    """The step hooks (`rl3d.algos.gpg`) a recipe's GPG settings turn on."""
    rescale = settings.get("gpg_rescale")
    names = [] if rescale is False else ["gpg_rescale"]
    return names + (["gpg_threshold"] if settings.get("gpg_threshold") is not None else [])


def gpg_policy_loss(
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    gpg_rescale: bool = True,
    gpg_threshold: float | None = None,
    **shared: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025, arXiv 2504.02546): the plain policy gradient, no ratio and no clip,

        L_t = -A_t * log pi(y_t)

    (exact on policy; with several updates per batch nothing corrects for staleness). GPG's
    other changes are to the advantage, over the whole step's batch, so they run as step hooks
    (`rl3d.algos.gpg`), not here: `gpg_rescale` (preset on) multiplies the advantages by
    `B / (B - M)`, `gpg_threshold` rolls out more rounds until the valid share reaches it. Its
    group baseline without the std is `norm_adv_by_std: false`. Metrics: `finish`'s.
    """
    logp_BT, old_logp_BT, adv_BT, _ = prepare(logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)
    return finish(-adv_BT * logp_BT, {}, logp_BT, old_logp_BT, adv_BT, mask_BT, **shared)


gpg_policy_loss.step_hooks = _gpg_step_hooks


POLICY_LOSSES.register("gspo", gspo_policy_loss)
POLICY_LOSSES.register("gmpo", gmpo_policy_loss)
POLICY_LOSSES.register("sapo", sapo_policy_loss)
POLICY_LOSSES.register("cispo", cispo_policy_loss)
POLICY_LOSSES.register("gpg", gpg_policy_loss)
