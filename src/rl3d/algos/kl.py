"""KL(pi || pi_ref) estimators on sampled tokens, the KL-in-reward penalty, KL controllers.

The estimators follow Schulman, "Approximating KL Divergence" (2020). With tokens sampled from
pi and `log_r = log pi_ref(y) - log pi(y)`:
    k1 = -log_r                  unbiased, high variance, can be negative
    k2 = log_r^2 / 2             biased, low variance, >= 0
    k3 = (exp(log_r) - 1) - log_r  unbiased, low variance, >= 0 ("low_var_kl")

Where the penalty goes is the recipe's choice: in the reward (PPO, REINFORCE++; use
`kl_penalty_rewards` before estimating advantages) or in the loss (GRPO; pass `ref_logp_BT` and
`kl_loss_coef` to the policy loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl3d.algos.core import check_same_shape, masked_mean
from rl3d.algos.registry import KL_CONTROLLERS, KL_ESTIMATORS

Tensor = torch.Tensor

# exp(20) ~ 5e8: far past any meaningful log-ratio, but keeps exp() finite in fp16/bf16/fp32.
_MAX_LOG_RATIO = 20.0


@KL_ESTIMATORS.register("k1")
def kl_k1(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    return logp_BT - ref_logp_BT


@KL_ESTIMATORS.register("k2")
def kl_k2(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    return 0.5 * (logp_BT - ref_logp_BT) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    log_r = (ref_logp_BT - logp_BT).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # expm1 keeps k3 >= 0 in floating point for tiny log_r, where exp(x) - 1 - x can round below 0.
    return torch.expm1(log_r) - log_r


def kl_penalty_rewards(
    *,
    rewards_BT: Tensor,
    logp_BT: Tensor,
    ref_logp_BT: Tensor,
    mask_BT: Tensor,
    kl_coef: float,
    estimator: str = "k1",
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL in the reward (Ziegler et al. 2019): `r_t <- r_t - kl_coef * kl_t` on every valid token.

    Returns the penalised rewards (zero at padding) and metrics `kl` (mean per-token KL, the
    quantity an adaptive controller tracks) and `kl_coef`.
    """
    check_same_shape(mask_BT, rewards_BT=rewards_BT, logp_BT=logp_BT, ref_logp_BT=ref_logp_BT)
    kl_BT = KL_ESTIMATORS.get(estimator)(logp_BT, ref_logp_BT)
    penalised_BT = rewards_BT - kl_coef * kl_BT
    penalised_BT = torch.where(mask_BT.bool(), penalised_BT, torch.zeros_like(penalised_BT))
    metrics = {
        "kl": masked_mean(kl_BT, mask_BT, group=group).detach(),
        "kl_coef": torch.tensor(float(kl_coef)),
    }
    return penalised_BT, metrics


@KL_CONTROLLERS.register("fixed")
class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, *, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, *, current_kl: float, num_steps: int) -> None:
        """No-op; present so both controllers share one interface."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@KL_CONTROLLERS.register("adaptive")
class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 ("Fine-Tuning LMs from Human Preferences").

    `e_t = clip(KL_t / KL_target - 1, -0.2, 0.2)`, `beta_{t+1} = beta_t * (1 + K_beta * e_t)` with
    `K_beta = num_steps / horizon`; `num_steps` is the number of samples in the batch that
    produced `KL_t`, so the coefficient's time constant is `horizon` samples.
    """

    def __init__(self, *, kl_coef: float, target_kl: float, horizon: int) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, *, current_kl: float, num_steps: int) -> None:
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def make_kl_controller(name: str, **kwargs: float) -> FixedKLController | AdaptiveKLController:
    """Build the named KL controller (`fixed`: kl_coef; `adaptive`: kl_coef, target_kl, horizon)."""
    return KL_CONTROLLERS.get(name)(**kwargs)
