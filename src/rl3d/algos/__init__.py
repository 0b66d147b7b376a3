"""rl3d.algos: RL algorithms as pure tensor functions, registered by name.

Inputs are `[B, T]` token tensors with a response mask `mask_BT` (true on response tokens);
padding never changes a result. A cross-rank reduction takes its process group as `group`
(`None`: this rank only). Losses return `(loss, metrics)`, metrics being a dict of detached
0-dim tensors.

Names a recipe's `algorithm:` block can use (see `rl3d.algos.registry`):
    adv_estimator:  gae, grpo, rloo, reinforce_plus_plus, remax, safe_rlhf,
                    on_policy_distillation (`rl3d.algos.distill`)
    policy_loss:    ppo, dual_clip, clip_higher       (presets of `ppo_policy_loss`)
                    gspo, gmpo, sapo, cispo, gpg      (`rl3d.algos.ratio_losses`)
                    clip_cov, kl_cov                  (`rl3d.algos.cov_losses`)
    loss_agg_mode:  token-mean, seq-mean-token-sum, seq-mean-token-mean
    kl_estimator:   k1, k2, k3
    kl_controller:  fixed, adaptive
    hooks:          greedy_baseline (ReMax), dynamic_sampling (DAPO), lagrangian (Safe-RLHF),
                    gpg_rescale, gpg_threshold (GPG, `rl3d.algos.gpg`)

`Algorithm(cfg)` puts one recipe's pieces together: the object the controller drives
(`rl3d.algos.algorithm`).
"""

from rl3d.algos import distill, gpg
from rl3d.algos.advantages import (
    Advantages,
    compute_advantages,
    dynamic_sampling_mask,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    remax_advantages,
    rloo_advantages,
)
from rl3d.algos.algorithm import HOOKS, Algorithm, AlgorithmHook, loss_problem, loss_settings, policy_loss_of
from rl3d.algos.core import (
    aggregate_loss,
    discounted_returns,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    scores_to_token_rewards,
    sequence_sums,
    zero_padding,
)
from rl3d.algos.cov_losses import clip_cov_policy_loss, kl_cov_policy_loss
from rl3d.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty_rewards,
    make_kl_controller,
)
from rl3d.algos.policy_loss import ppo_policy_loss
from rl3d.algos.ratio_losses import (
    cispo_policy_loss,
    gmpo_policy_loss,
    gpg_policy_loss,
    gspo_policy_loss,
    sapo_policy_loss,
)
from rl3d.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AlgorithmFamily,
    Registry,
    get_advantage_estimator,
    get_kl_controller,
    get_kl_estimator,
    get_loss_agg_mode,
    get_policy_loss,
)
from rl3d.algos.reward_shaping import overlong_penalty
from rl3d.algos.safe_rlhf import (
    LagrangeMultiplier,
    combine_advantages,
    episode_cost,
    lagrange_step,
    safe_rlhf_advantages,
)
from rl3d.algos.stage import compute_advantage, response_stats
from rl3d.algos.value_loss import clipped_value_loss, explained_variance

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "distill",
    "gpg",
    "HOOKS",
    "Algorithm",
    "AlgorithmHook",
    "compute_advantage",
    "policy_loss_of",
    "loss_problem",
    "loss_settings",
    "clip_cov_policy_loss",
    "kl_cov_policy_loss",
    "cispo_policy_loss",
    "gmpo_policy_loss",
    "gpg_policy_loss",
    "gspo_policy_loss",
    "sapo_policy_loss",
    "response_stats",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "Advantages",
    "AlgorithmFamily",
    "FixedKLController",
    "LagrangeMultiplier",
    "Registry",
    "aggregate_loss",
    "clipped_value_loss",
    "combine_advantages",
    "compute_advantages",
    "discounted_returns",
    "dynamic_sampling_mask",
    "episode_cost",
    "explained_variance",
    "gae_advantages",
    "get_advantage_estimator",
    "get_kl_controller",
    "get_kl_estimator",
    "get_loss_agg_mode",
    "get_policy_loss",
    "grpo_advantages",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty_rewards",
    "lagrange_step",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "ppo_policy_loss",
    "reinforce_plus_plus_advantages",
    "remax_advantages",
    "rloo_advantages",
    "safe_rlhf_advantages",
    "scores_to_token_rewards",
    "sequence_sums",
    "zero_padding",
]
