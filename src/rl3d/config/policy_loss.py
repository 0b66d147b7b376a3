"""`algorithm.loss_params`: the hyperparameters of the policy losses beyond the ratio clip.

Each is None by default: the chosen loss's preset (its paper's value, `rl3d.algos`) applies. A
key the chosen `algorithm.policy_loss` does not take is refused, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl3d.config.errors import FieldError


@dataclass(frozen=True, kw_only=True)
class PolicyLossParams:
    tau_pos: float | None = None  # sapo: gate temperature for A > 0 (paper: 1.0)
    tau_neg: float | None = None  # sapo: gate temperature for A < 0 (paper: 1.05)
    # clip_cov: share of tokens detached (2e-4); kl_cov: share penalised (2e-3)
    cov_ratio: float | None = None
    cov_lb: float | None = None  # clip_cov: covariance band's lower end (1.0)
    cov_ub: float | None = None  # clip_cov: covariance band's upper end (5.0)
    kl_cov_coef: float | None = None  # kl_cov: coefficient of |log r| on the selected tokens (1.0)
    gpg_rescale: bool | None = None  # gpg: advantages times B / (B - M) over the batch (on)
    # gpg: more rollout rounds until the share of samples in groups with a reward spread
    # reaches this (the paper's beta_th, 0.6 in its ablation); None = off
    gpg_threshold: float | None = None

    def __post_init__(self) -> None:
        for name in ("tau_pos", "tau_neg"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise FieldError(name, f"must be > 0, got {value}")
        if self.cov_ratio is not None and not 0 < self.cov_ratio <= 1:
            raise FieldError("cov_ratio", f"must be in (0, 1], got {self.cov_ratio}")
        if self.gpg_threshold is not None and not 0 < self.gpg_threshold <= 1:
            raise FieldError("gpg_threshold", f"must be in (0, 1], got {self.gpg_threshold}")
        if self.kl_cov_coef is not None and self.kl_cov_coef < 0:
            raise FieldError("kl_cov_coef", f"must be >= 0, got {self.kl_cov_coef}")
        if self.cov_lb is not None and self.cov_ub is not None and self.cov_lb >= self.cov_ub:
            raise FieldError("cov_ub", f"must be > cov_lb ({self.cov_lb}), got {self.cov_ub}")


def check_policy_loss(algorithm) -> None:
    """FieldError (relative to `algorithm`) when `algorithm.policy_loss` cannot take the recipe's
    hyperparameters or its `loss_agg_mode` (`rl3d.algos.loss_problem`)."""
    from rl3d.algos import loss_problem, loss_settings

    problem = loss_problem(algorithm.policy_loss, algorithm.loss_agg_mode, loss_settings(algorithm))
    if problem is not None:
        key, why = problem
        raise FieldError(f"loss_params.{key}" if key in PolicyLossParams.__dataclass_fields__ else key, why)
