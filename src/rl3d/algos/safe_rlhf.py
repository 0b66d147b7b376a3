"""Safe-RLHF, PPO-Lagrangian (Dai et al., "Safe RLHF: Safe Reinforcement Learning from Human
Feedback", ICLR 2024, Sec. 3.3 and the PPO-Lagrangian details of its appendix).

The paper maximises helpfulness under a harmlessness constraint:
    max_theta J_R(theta)   s.t.   J_C(theta) - d <= 0,
    J_R(theta) = E_{x~D, y~pi_theta}[R(y, x)],   J_C(theta) = E_{x~D, y~pi_theta}[C(y, x)]
(the paper folds the threshold into J_C as `+ d`; here `d` is `cost_threshold`), solved as
    min_theta max_{lambda >= 0}  -J_R(theta) + lambda * (J_C(theta) - d).
The pieces, in the order a step uses them:
 1. a cost critic V_C trained like the reward critic (`rl3d.algos.value_loss.clipped_value_loss`
    on the cost returns) and GAE on the cost rewards give the cost advantage A_C;
 2. the actor maximises the combined surrogate whose advantage is
        A = (A_R - lambda * A_C) / (1 + lambda),
    the 1/(1 + lambda) keeping the step size bounded as lambda grows (pass A to the PPO loss);
 3. lambda takes a gradient-ascent step on the Lagrangian, parametrised as lambda = exp(log_lambda)
    so it stays >= 0:  d/d(log_lambda) [lambda * (J_C - d)] = lambda * (J_C - d), so
        log_lambda <- log_lambda + lr * lambda * (J_C - d),
    J_C being estimated by the mean episode cost of the batch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rl3d.algos.advantages import Advantages, gae_advantages
from rl3d.algos.core import masked_mean, masked_whiten
from rl3d.algos.registry import register_advantage_estimator

Tensor = torch.Tensor


def combine_advantages(reward_adv_BT: Tensor, cost_adv_BT: Tensor, *, lagrange_multiplier: float) -> Tensor:
    """`(A_R - lambda * A_C) / (1 + lambda)`: the advantage of the Lagrangian objective."""
    if lagrange_multiplier < 0:
        raise ValueError(f"lagrange_multiplier must be >= 0, got {lagrange_multiplier}")
    return (reward_adv_BT - lagrange_multiplier * cost_adv_BT) / (1.0 + lagrange_multiplier)


@register_advantage_estimator(
    "safe_rlhf", needs_critic=True, needs_cost_critic=True, supports_process_group=True, hooks=("lagrangian",)
)
def safe_rlhf_advantages(
    *,
    rewards_BT: Tensor,
    values_BT: Tensor,
    cost_rewards_BT: Tensor,
    cost_values_BT: Tensor,
    mask_BT: Tensor,
    lagrange_multiplier: float,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = False,
    group: dist.ProcessGroup | None = None,
) -> Advantages:
    """GAE for reward and cost, combined with the current Lagrange multiplier.

    `returns_BT` trains the reward critic and `cost_returns_BT` the cost critic. Whitening is off
    by default: whitening A_C separately would erase the cost scale that lambda trades against.
    """
    gae = dict(mask_BT=mask_BT, gamma=gamma, lam=lam, whiten=False)
    reward = gae_advantages(rewards_BT=rewards_BT, values_BT=values_BT, **gae)
    cost = gae_advantages(rewards_BT=cost_rewards_BT, values_BT=cost_values_BT, **gae)
    adv_BT = combine_advantages(reward.adv_BT, cost.adv_BT, lagrange_multiplier=lagrange_multiplier)
    if whiten:
        adv_BT = masked_whiten(adv_BT, mask_BT, group=group)
    return Advantages(adv_BT=adv_BT, returns_BT=reward.returns_BT, cost_returns_BT=cost.returns_BT)


def lagrange_step(
    log_lambda: float,
    *,
    episode_cost: float,
    cost_threshold: float,
    lr: float,
    max_lambda: float | None = None,
) -> float:
    """One gradient-ascent step on the Lagrangian in log space: returns the new `log_lambda`.

    `log_lambda + lr * lambda * (J_C - d)`: lambda grows while the mean episode cost exceeds the
    threshold and decays towards 0 (never below) once the constraint holds.
    """
    if lr <= 0:
        raise ValueError(f"lagrange lr must be > 0, got {lr}")
    new_log_lambda = log_lambda + lr * math.exp(log_lambda) * (episode_cost - cost_threshold)
    if max_lambda is not None:
        new_log_lambda = min(new_log_lambda, math.log(max_lambda))
    return new_log_lambda


def episode_cost(costs_B: Tensor, *, group: dist.ProcessGroup | None = None) -> float:
    """Mean episode cost of the batch (over `group` when given): the estimate of J_C."""
    all_valid_1B = torch.ones_like(costs_B, dtype=torch.bool)[None]
    return float(masked_mean(costs_B[None], all_valid_1B, group=group))


class LagrangeMultiplier:
    """The state of lambda across steps (checkpointed with `state_dict`)."""

    def __init__(
        self, *, init_value: float, cost_threshold: float, lr: float, max_value: float | None = None
    ) -> None:
        if init_value <= 0:
            raise ValueError(f"lagrange init_value must be > 0 (lambda = exp(log_lambda)), got {init_value}")
        if max_value is not None and max_value < init_value:
            raise ValueError(f"lagrange max_value {max_value} is below init_value {init_value}")
        self.log_lambda = math.log(init_value)
        self.cost_threshold = float(cost_threshold)
        self.lr = float(lr)
        self.max_value = max_value

    @property
    def value(self) -> float:
        return math.exp(self.log_lambda)

    def update(self, costs_B: Tensor, *, group: dist.ProcessGroup | None = None) -> float:
        """Step lambda from this batch's episode costs; returns the new lambda."""
        self.log_lambda = lagrange_step(
            self.log_lambda,
            episode_cost=episode_cost(costs_B, group=group),
            cost_threshold=self.cost_threshold,
            lr=self.lr,
            max_lambda=self.max_value,
        )
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"log_lambda": self.log_lambda}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.log_lambda = float(state["log_lambda"])
