"""On-policy distillation: the student samples its own responses and a teacher scores every
sampled token; the per-token reverse KL is the (negative) advantage.

With the student's log-prob `log pi(y_t)` and the teacher's `log pi_T(y_t)` of the sampled token,
`log pi(y_t) - log pi_T(y_t)` is the one-sample estimate of KL(pi || pi_T) at step t (reverse KL:
mode-seeking, as in Agarwal et al. 2024, "On-Policy Distillation of Language Models", and
Thinking Machines' on-policy distillation, 2025). The advantage is its negation, per token, so a
policy-gradient step lowers the reverse KL where the student sampled; `task_coef` adds the task
reward's GRPO advantage (`algorithm.distill.coef`).
"""

from __future__ import annotations

import torch

from rl3d.algos.advantages import Advantages, grpo_advantages
from rl3d.algos.core import check_same_shape, zero_padding
from rl3d.algos.registry import register_advantage_estimator

Tensor = torch.Tensor


@register_advantage_estimator(
    "on_policy_distillation",
    needs_critic=False,
    needs_teacher=True,
    default_kl_apply_to="loss",
    optional_inputs=("group_ids_B",),  # the task reward's group baseline (distill.coef > 0)
)
def on_policy_distillation_advantages(
    *,
    rewards_BT: Tensor,
    mask_BT: Tensor,
    logp_BT: Tensor,
    teacher_logp_BT: Tensor,
    group_ids_B: Tensor | None = None,
    task_coef: float = 0.0,
    norm_by_std: bool = True,
) -> Advantages:
    """`A_t = -(log pi(y_t) - log pi_T(y_t)) + task_coef * A^GRPO_t`; returns = advantages.

    The log-probs are constants here (the policy before the update); the task term needs
    `group_ids_B` (n > 1 samples per prompt) and is skipped when `task_coef` is 0."""
    check_same_shape(mask_BT, rewards_BT=rewards_BT, logp_BT=logp_BT, teacher_logp_BT=teacher_logp_BT)
    adv_BT = zero_padding(teacher_logp_BT.detach() - logp_BT.detach(), mask_BT).to(rewards_BT.dtype)
    if task_coef != 0.0:
        if group_ids_B is None:
            raise ValueError("on_policy_distillation with a task reward (distill.coef) needs group_ids_B")
        task = grpo_advantages(
            rewards_BT=rewards_BT, mask_BT=mask_BT, group_ids_B=group_ids_B, norm_by_std=norm_by_std
        )
        adv_BT = adv_BT + task_coef * task.adv_BT
    return Advantages(adv_BT=adv_BT, returns_BT=adv_BT)


def reverse_kl_by_token(logp_BT: Tensor, teacher_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """The mean over valid tokens of `log pi - log pi_T` (the estimate of KL(pi || pi_T))."""
    diff = (logp_BT - teacher_logp_BT)[mask_BT.bool()]
    return diff.mean() if diff.numel() else torch.zeros(())
