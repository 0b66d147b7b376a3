"""Name -> object registries for the algorithm library.

A recipe's `algorithm:` block names its pieces (`adv_estimator: grpo`, `policy_loss: clip_higher`,
`kl_estimator: k3`, ...); the controller resolves each name here. Adding an algorithm is a
registry entry plus a recipe, never an `if name == ...` in the controller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from rl3d.utils.registry import Registry

T = TypeVar("T")

# The inputs an estimator may take beyond `rewards_BT` and `mask_BT`: keyword -> (the batch column
# the advantage stage makes it from, the `AlgorithmFamily` flag that requires it).
ESTIMATOR_INPUTS: dict[str, tuple[str, str]] = {
    "values_BT": ("values", "needs_critic"),
    "group_ids_B": ("uid", "needs_group_samples"),
    "greedy_scores_B": ("greedy_score", "needs_greedy_baseline"),
    "cost_rewards_BT": ("cost", "needs_cost_critic"),
    "cost_values_BT": ("cost_values", "needs_cost_critic"),
    "logp_BT": ("old_logp", "needs_teacher"),
    "teacher_logp_BT": ("teacher_logp", "needs_teacher"),
}


@dataclass(frozen=True)
class AlgorithmFamily:
    """What the controller must provide for an advantage estimator.

    The controller reads this to decide which workers to build and what to generate:
    `needs_critic` builds a value model; `needs_cost_critic` a second one for costs (Safe-RLHF);
    `needs_group_samples` requires `n > 1` responses per prompt and `group_ids_B`;
    `needs_greedy_baseline` asks the rollout for one extra greedy response per prompt (ReMax);
    `supports_process_group` means the estimator whitens and accepts a DP `group` for it;
    `needs_teacher` builds the `teacher` role and hands the estimator the policy's and the
    teacher's per-token log-probs (on-policy distillation);
    `optional_inputs` are inputs it takes when they are given (keywords of `ESTIMATOR_INPUTS`);
    `hooks` names the algorithm hooks the step needs for it (`rl3d.algos.algorithm`);
    `default_kl_apply_to` is where the reference-KL penalty usually goes for this family:
    `"reward"` (token-level penalty folded into rewards, PPO) or `"loss"` (GRPO).
    """

    name: str
    fn: Callable[..., object]
    needs_critic: bool
    needs_group_samples: bool = False
    needs_greedy_baseline: bool = False
    needs_cost_critic: bool = False
    supports_process_group: bool = False
    needs_teacher: bool = False
    default_kl_apply_to: str = "reward"
    optional_inputs: tuple[str, ...] = ()
    hooks: tuple[str, ...] = ()  # `rl3d.algos.algorithm.HOOKS` this estimator needs

    def __post_init__(self) -> None:
        assert self.default_kl_apply_to in ("reward", "loss"), self.default_kl_apply_to
        assert set(self.optional_inputs) <= set(ESTIMATOR_INPUTS), self.optional_inputs

    @property
    def inputs(self) -> tuple[str, ...]:
        """The inputs its flags require beyond `rewards_BT` and `mask_BT` (keywords of `ESTIMATOR_INPUTS`)."""
        return tuple(key for key, (_, flag) in ESTIMATOR_INPUTS.items() if getattr(self, flag))

    @property
    def columns(self) -> tuple[str, ...]:
        """The batch columns the advantage stage must find for it (`rl3d.algos.stage`, where the
        engine's `rollout_logp` stands in for an `old_logp` skipped on policy)."""
        return tuple(dict.fromkeys(ESTIMATOR_INPUTS[key][0] for key in self.inputs))


ADVANTAGE_ESTIMATORS: Registry[AlgorithmFamily] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Callable[..., object]] = Registry("policy loss")
LOSS_AGG_MODES: Registry[Callable[..., object]] = Registry("loss aggregation mode")
KL_ESTIMATORS: Registry[Callable[..., object]] = Registry("KL estimator")
KL_CONTROLLERS: Registry[Callable[..., object]] = Registry("KL controller")


def register_advantage_estimator(name: str, **family: object) -> Callable[[T], T]:
    """Decorator: register an estimator function together with its `AlgorithmFamily` flags."""

    def add(fn: T) -> T:
        ADVANTAGE_ESTIMATORS.register(name, AlgorithmFamily(name=name, fn=fn, **family))
        return fn

    return add


def get_advantage_estimator(name: str) -> AlgorithmFamily:
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Callable[..., object]:
    return POLICY_LOSSES.get(name)


def get_loss_agg_mode(name: str) -> Callable[..., object]:
    return LOSS_AGG_MODES.get(name)


def get_kl_estimator(name: str) -> Callable[..., object]:
    return KL_ESTIMATORS.get(name)


def get_kl_controller(name: str) -> Callable[..., object]:
    return KL_CONTROLLERS.get(name)
