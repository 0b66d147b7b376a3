"""Advantage estimators: GAE, GRPO, RLOO, REINFORCE++, ReMax; DAPO's dynamic-sampling filter.

Every estimator takes token-level rewards `rewards_BT` (an outcome score sits on the last valid
token, see `scores_to_token_rewards`; a token-level KL penalty may already be folded in, see
`rl3d.algos.kl.kl_penalty_rewards`) and the response mask, plus what its `AlgorithmFamily`
says it needs. Results are zero at padding. Group-based estimators read a sequence's score as
the sum of its token rewards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl3d.algos.core import (
    check_same_shape,
    discounted_returns,
    masked_whiten,
    sequence_sums,
    zero_padding,
)
from rl3d.algos.registry import ADVANTAGE_ESTIMATORS, register_advantage_estimator

Tensor = torch.Tensor


@dataclass(frozen=True)
class Advantages:
    """What an estimator returns. `returns_BT` is the critic's target where there is a critic."""

    adv_BT: Tensor
    returns_BT: Tensor
    cost_returns_BT: Tensor | None = None


def _broadcast_scores(scores_B: Tensor, mask_BT: Tensor) -> Tensor:
    return zero_padding(scores_B[:, None].expand(mask_BT.shape), mask_BT)


def _group_index(group_ids_B: Tensor, *, min_size: int, who: str) -> tuple[Tensor, Tensor]:
    """Dense group index `[B]` in `0..G-1` and group sizes `[G]`, checking every size."""
    if group_ids_B.dim() != 1:
        raise ValueError(f"{who}: group_ids_B must be 1-D, got shape {tuple(group_ids_B.shape)}")
    _, index_B = torch.unique(group_ids_B, return_inverse=True)
    sizes_G = torch.bincount(index_B)
    if int(sizes_G.min()) < min_size:
        raise ValueError(
            f"{who} needs at least {min_size} samples per prompt, got a group of {int(sizes_G.min())}"
        )
    return index_B, sizes_G


def _group_sum(x_B: Tensor, index_B: Tensor, num_groups: int) -> Tensor:
    return torch.zeros(num_groups, dtype=x_B.dtype, device=x_B.device).index_add_(0, index_B, x_B)


@register_advantage_estimator("gae", needs_critic=True, supports_process_group=True)
def gae_advantages(
    *,
    rewards_BT: Tensor,
    values_BT: Tensor,
    mask_BT: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    group: dist.ProcessGroup | None = None,
) -> Advantages:
    """Generalised advantage estimation (Schulman et al. 2016).

    `delta_t = r_t + gamma * V_{t+1} - V_t`, `A_t = delta_t + gamma * lam * A_{t+1}`, with
    `V` and `A` past the last valid token taken as 0. Padding is stepped over: the recursion
    links consecutive *valid* tokens. Returns `R_t = A_t + V_t` (before whitening), the critic's
    target. With `whiten`, advantages are whitened over the batch (over `group` when given).
    """
    check_same_shape(mask_BT, rewards_BT=rewards_BT, values_BT=values_BT)
    mask = mask_BT.bool()
    adv_BT = torch.zeros_like(rewards_BT)
    next_value_B = torch.zeros_like(rewards_BT[:, 0])
    next_adv_B = torch.zeros_like(rewards_BT[:, 0])
    for t in reversed(range(rewards_BT.shape[-1])):
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_t_B = delta_B + gamma * lam * next_adv_B
        next_adv_B = torch.where(mask[:, t], adv_t_B, next_adv_B)
        next_value_B = torch.where(mask[:, t], values_BT[:, t], next_value_B)
        adv_BT[:, t] = torch.where(mask[:, t], adv_t_B, torch.zeros_like(adv_t_B))
    returns_BT = zero_padding(adv_BT + values_BT, mask_BT)
    if whiten:
        adv_BT = masked_whiten(adv_BT, mask_BT, group=group)
    return Advantages(adv_BT=adv_BT, returns_BT=returns_BT)


@register_advantage_estimator(
    "grpo", needs_critic=False, needs_group_samples=True, default_kl_apply_to="loss"
)
def grpo_advantages(
    *,
    rewards_BT: Tensor,
    mask_BT: Tensor,
    group_ids_B: Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Advantages:
    """GRPO group normalisation (Shao et al. 2024): `A_i = (s_i - mean_g) / (std_g + eps)`.

    `s_i` is sequence i's score, `mean_g`/`std_g` the mean and unbiased std of the scores of
    the `n` samples of its prompt (`group_ids_B` says which rows share a prompt). With
    `norm_by_std=False` (Dr. GRPO) the advantage is `s_i - mean_g`. Every token of a response
    gets its sequence's advantage.
    """
    check_same_shape(mask_BT, rewards_BT=rewards_BT)
    scores_B = sequence_sums(rewards_BT, mask_BT)
    index_B, sizes_G = _group_index(group_ids_B, min_size=2, who="grpo")
    mean_G = _group_sum(scores_B, index_B, len(sizes_G)) / sizes_G
    centred_B = scores_B - mean_G[index_B]
    if norm_by_std:
        var_G = _group_sum(centred_B**2, index_B, len(sizes_G)) / (sizes_G - 1)
        centred_B = centred_B / (var_G.sqrt()[index_B] + eps)
    adv_BT = _broadcast_scores(centred_B, mask_BT)
    return Advantages(adv_BT=adv_BT, returns_BT=adv_BT)


@register_advantage_estimator("rloo", needs_critic=False, needs_group_samples=True)
def rloo_advantages(*, rewards_BT: Tensor, mask_BT: Tensor, group_ids_B: Tensor) -> Advantages:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024).

    `A_i = s_i - (1 / (n - 1)) * sum_{j != i} s_j` over the `n` samples of i's prompt.
    """
    check_same_shape(mask_BT, rewards_BT=rewards_BT)
    scores_B = sequence_sums(rewards_BT, mask_BT)
    index_B, sizes_G = _group_index(group_ids_B, min_size=2, who="rloo")
    total_B = _group_sum(scores_B, index_B, len(sizes_G))[index_B]
    baseline_B = (total_B - scores_B) / (sizes_G[index_B] - 1)
    adv_BT = _broadcast_scores(scores_B - baseline_B, mask_BT)
    return Advantages(adv_BT=adv_BT, returns_BT=adv_BT)


@register_advantage_estimator("reinforce_plus_plus", needs_critic=False, supports_process_group=True)
def reinforce_plus_plus_advantages(
    *,
    rewards_BT: Tensor,
    mask_BT: Tensor,
    gamma: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> Advantages:
    """REINFORCE++ (Hu 2025): reward-to-go of token rewards, whitened over the global batch.

    The token-level KL penalty belongs in `rewards_BT` (`kl_penalty_rewards`). Whitening uses
    the statistics of the whole batch, across `group` when given.
    """
    check_same_shape(mask_BT, rewards_BT=rewards_BT)
    returns_BT = discounted_returns(rewards_BT, mask_BT, gamma=gamma)
    adv_BT = masked_whiten(returns_BT, mask_BT, group=group)
    return Advantages(adv_BT=adv_BT, returns_BT=returns_BT)


@register_advantage_estimator(
    "remax", needs_critic=False, needs_greedy_baseline=True, hooks=("greedy_baseline",)
)
def remax_advantages(*, rewards_BT: Tensor, mask_BT: Tensor, greedy_scores_B: Tensor) -> Advantages:
    """ReMax (Li et al. 2024): reward-to-go minus the score of the greedy response to the prompt.

    `greedy_scores_B[i]` is the score of the greedy (argmax) response to row i's prompt; the
    controller generates it (`AlgorithmFamily.needs_greedy_baseline`).
    """
    check_same_shape(mask_BT, rewards_BT=rewards_BT)
    if greedy_scores_B.shape != rewards_BT.shape[:1]:
        raise ValueError(
            f"greedy_scores_B has shape {tuple(greedy_scores_B.shape)}, expected ({len(rewards_BT)},)"
        )
    returns_BT = discounted_returns(rewards_BT, mask_BT, gamma=1.0)
    adv_BT = zero_padding(returns_BT - greedy_scores_B[:, None], mask_BT)
    return Advantages(adv_BT=adv_BT, returns_BT=returns_BT)


def dynamic_sampling_mask(scores_B: Tensor, group_ids_B: Tensor, *, atol: float = 0.0) -> Tensor:
    """DAPO dynamic sampling (Yu et al. 2025): keep only groups whose scores are not all equal.

    A group whose `n` scores all agree (all solved or all failed) has zero advantage under
    group normalisation and contributes no gradient. Returns a bool mask `[B]`; the kept rows
    are `keep_B.nonzero().squeeze(-1)`. Refilling the batch with new prompts is the controller's
    job. Scores within `atol` of each other count as equal.
    """
    index_B, sizes_G = _group_index(group_ids_B, min_size=1, who="dynamic sampling")
    num_groups = len(sizes_G)
    max_G = scores_B.new_zeros(num_groups).scatter_reduce(0, index_B, scores_B, "amax", include_self=False)
    min_G = scores_B.new_zeros(num_groups).scatter_reduce(0, index_B, scores_B, "amin", include_self=False)
    return (max_G - min_G > atol)[index_B]


def compute_advantages(
    name: str,
    *,
    rewards_BT: Tensor,
    mask_BT: Tensor,
    values_BT: Tensor | None = None,
    group_ids_B: Tensor | None = None,
    greedy_scores_B: Tensor | None = None,
    cost_rewards_BT: Tensor | None = None,
    cost_values_BT: Tensor | None = None,
    logp_BT: Tensor | None = None,
    teacher_logp_BT: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    **hparams: object,
) -> Advantages:
    """Run the named estimator, passing the inputs its `AlgorithmFamily` requires (`inputs`) and
    those it takes when they are given (`optional_inputs`).

    `hparams` are the estimator's keyword hyper-parameters (e.g. `gamma`, `lam`, `norm_by_std`).
    `group` reaches only estimators that whiten (`AlgorithmFamily.supports_process_group`); the
    others work per prompt group, which lives on one rank.
    """
    family = ADVANTAGE_ESTIMATORS.get(name)
    given = {
        "values_BT": values_BT,
        "group_ids_B": group_ids_B,
        "greedy_scores_B": greedy_scores_B,
        "cost_rewards_BT": cost_rewards_BT,
        "cost_values_BT": cost_values_BT,
        "logp_BT": logp_BT,
        "teacher_logp_BT": teacher_logp_BT,
    }
    inputs: dict[str, object] = {"rewards_BT": rewards_BT, "mask_BT": mask_BT}
    for key in family.inputs:
        if given[key] is None:
            raise ValueError(f"advantage estimator {name!r} needs {key}")
        inputs[key] = given[key]
    inputs |= {key: given[key] for key in family.optional_inputs if given[key] is not None}
    if family.supports_process_group:
        inputs["group"] = group
    return family.fn(**inputs, **hparams)
