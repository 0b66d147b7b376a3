"""An RL algorithm as one object the controller drives: its estimator, its policy loss and hooks.

The controller's step calls the same points for every algorithm; what differs between them is
here, selected by name from the recipe's `algorithm:` block:
- the advantage estimator (`adv_estimator`, `rl3d.algos.registry.ADVANTAGE_ESTIMATORS`);
- the policy loss (`policy_loss`, `POLICY_LOSSES`): a registered preset's settings, with the
  recipe's own `clip_low` / `clip_high` / `dual_clip_c` / `loss_params.*` winning where it sets
  them;
- hooks (`HOOKS`) at fixed points of the step: at its start, after each rollout round, which
  samples of a round to keep (and how many rounds to try), what the estimator needs from the
  algorithm's state, after the advantages, and after the update. An estimator names the hooks
  it needs (`AlgorithmFamily.hooks`), a policy loss those its settings ask for (its
  `step_hooks`); `dynamic_sampling: true` adds DAPO's.

    ReMax       greedy_baseline    one greedy response per prompt, scored, as the baseline
    DAPO        dynamic_sampling   drop groups whose rewards are all equal, refill from new prompts
    Safe-RLHF   lagrangian         the cost multiplier: used by the advantages, stepped after
    GPG         gpg_rescale        advantages times B / (B - M), M: samples of zero-spread groups
                gpg_threshold      more rounds until (B - M) / B reaches a threshold

`cfg` is the recipe's `rl3d.config.AlgorithmConfig` (not imported here: config checks names
against these registries, so it imports algos and never the reverse).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from rl3d.algos.advantages import dynamic_sampling_mask
from rl3d.algos.registry import POLICY_LOSSES, Registry
from rl3d.algos.rollout_correction import rollout_weights
from rl3d.algos.safe_rlhf import LagrangeMultiplier
from rl3d.algos.stage import compute_advantage
from rl3d.single_controller.batch import DataBatch

logger = logging.getLogger(__name__)

# rollout(prompts, **sampling overrides) -> the scored batch of one more generation
Rollout = Callable[..., DataBatch]


class AlgorithmHook:
    """One algorithm-specific behaviour; every point defaults to doing nothing."""

    max_rounds = 1  # rollout rounds a step may take to fill its prompts

    def on_rollout(self, batch: DataBatch, prompts: DataBatch, rollout: Rollout) -> DataBatch:
        return batch

    def keep(self, batch: DataBatch) -> DataBatch:
        """The samples of one rollout round this step trains on."""
        return batch

    def begin_step(self) -> None:
        """A training step's first rollout round is next."""

    def advantage_args(self) -> dict[str, Any]:
        return {}

    def after_advantages(self, batch: DataBatch) -> dict[str, float]:
        """May change the step's advantages in `batch` (set in place); returns metrics."""
        return {}

    def after_update(self, batch: DataBatch) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


HOOKS: Registry[Callable[[Any], AlgorithmHook]] = Registry("algorithm hook")


@HOOKS.register("greedy_baseline")
class GreedyBaseline(AlgorithmHook):
    """ReMax (Li et al. 2024): the score of one greedy response per prompt is the baseline."""

    def __init__(self, cfg: Any):
        pass

    def on_rollout(self, batch: DataBatch, prompts: DataBatch, rollout: Rollout) -> DataBatch:
        greedy = rollout(prompts, greedy=True)
        by_uid = dict(zip(greedy["uid"].tolist(), greedy["score"].tolist()))
        return batch.set("greedy_score", torch.tensor([by_uid[u] for u in batch["uid"].tolist()]))


@HOOKS.register("dynamic_sampling")
class DynamicSampling(AlgorithmHook):
    """DAPO (Yu et al. 2025): a group whose rewards are all equal has no gradient; drop it and
    refill from new prompts, for at most `max_rounds` rounds."""

    max_rounds = 8

    def __init__(self, cfg: Any):
        pass

    def keep(self, batch: DataBatch) -> DataBatch:
        informative = dynamic_sampling_mask(batch["score"], batch["uid"])
        return batch.select(informative.nonzero().squeeze(-1))


@HOOKS.register("lagrangian")
class Lagrangian(AlgorithmHook):
    """Safe-RLHF's multiplier: this step's advantages use its value, then it rises while the
    mean cost exceeds the threshold (`rl3d.algos.safe_rlhf`)."""

    def __init__(self, cfg: Any):
        safe = cfg.safe_rlhf
        self.multiplier = LagrangeMultiplier(
            init_value=safe.lagrange_init,
            cost_threshold=safe.cost_threshold,
            lr=safe.lagrange_lr,
            max_value=safe.lagrange_max,
        )

    def advantage_args(self) -> dict[str, Any]:
        return {"lagrange_multiplier": self.multiplier.value}

    def after_update(self, batch: DataBatch) -> dict[str, float]:
        used = self.multiplier.value
        return {"safe/lambda": used, "safe/lambda_next": self.multiplier.update(batch["cost"])}

    def state_dict(self) -> dict[str, Any]:
        return {"lagrange": self.multiplier.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.multiplier.load_state_dict(state["lagrange"])


def _base(loss: Callable[..., Any]) -> Callable[..., Any]:
    """A registered loss's function (a preset is a partial of one)."""
    return loss.func if isinstance(loss, functools.partial) else loss


def loss_settings(cfg: Any) -> dict[str, Any]:
    """The recipe's policy-loss hyperparameters by keyword: `clip_low`, `clip_high`,
    `dual_clip_c` and the `loss_params` block's; None where the recipe leaves one unset."""
    return {
        "clip_low": cfg.clip_low,
        "clip_high": cfg.clip_high,
        "dual_clip_c": cfg.dual_clip_c,
        **dataclasses.asdict(cfg.loss_params),
    }


def loss_problem(name: str, loss_agg_mode: str, settings: dict[str, Any]) -> tuple[str, str] | None:
    """`(keyword, why)` when the loss `name` cannot take the recipe's settings: a hyperparameter
    it does not have (set, not None), or an aggregation its objective does not allow."""
    fn = _base(POLICY_LOSSES.get(name))
    params = inspect.signature(fn).parameters
    takes = sorted(k for k in settings if k in params)
    for key, value in settings.items():
        if value is not None and key not in params:
            return key, f"policy_loss {name!r} has no {key} (it takes: {', '.join(takes) or 'none of them'})"
    needed = getattr(fn, "needs_agg_mode", None)
    if needed is not None and loss_agg_mode != needed:
        return "loss_agg_mode", f"policy_loss {name!r} is a sequence-level objective: needs {needed!r}"
    return None


def policy_loss_of(cfg: Any) -> Callable[..., Any]:
    """The registered policy loss `cfg.policy_loss` with the recipe's hyperparameters bound
    (`loss_settings`). A preset (`dual_clip`, `clip_higher`, or a loss's own defaults, the
    paper's) supplies the values the recipe leaves unset.

    Called with `rollout_logp_BT` (the engine's log-probs of the sampled tokens), it also applies
    the recipe's rollout correction (`cfg.rollout_correction`) and reports `rollout/kl_k3`, plus
    `rollout_corr/*` when a correction is on."""
    loss = POLICY_LOSSES.get(cfg.policy_loss)
    settings = loss_settings(cfg)
    problem = loss_problem(cfg.policy_loss, cfg.loss_agg_mode, settings)
    if problem is not None:
        raise ValueError(f"{problem[0]}: {problem[1]}")
    chosen = {k: v for k, v in settings.items() if v is not None}
    bound = functools.partial(loss, loss_agg_mode=cfg.loss_agg_mode, entropy_coef=cfg.entropy_coef, **chosen)
    correction = cfg.rollout_correction

    def policy_loss(*, rollout_logp_BT=None, **inputs):
        if rollout_logp_BT is None:
            return bound(**inputs)
        weights_BT, _, stats = rollout_weights(
            inputs["old_logp_BT"],
            rollout_logp_BT,
            inputs["mask_BT"],
            mode=correction.mode,
            threshold=correction.threshold,
        )
        if correction.mode != "none":
            inputs["weights_BT"] = weights_BT
        loss_value, metrics = bound(**inputs)
        metrics["rollout/kl_k3"] = stats.pop("kl_k3")
        if correction.mode != "none":
            metrics |= {f"rollout_corr/{k}": v for k, v in stats.items()}
        return loss_value, metrics

    return policy_loss


class Algorithm:
    """The estimator, the policy loss and the hooks of `cfg` (an AlgorithmConfig)."""

    def __init__(self, cfg: Any):
        self.cfg, self.family = cfg, cfg.family
        names = [*self.family.hooks, *(["dynamic_sampling"] if cfg.dynamic_sampling else [])]
        loss_hooks = getattr(_base(POLICY_LOSSES.get(cfg.policy_loss)), "step_hooks", None)
        names += loss_hooks(loss_settings(cfg)) if loss_hooks else []
        self.hooks = [HOOKS.get(name)(cfg) for name in names]
        self.policy_loss = policy_loss_of(cfg)

    @property
    def max_rounds(self) -> int:
        return max([h.max_rounds for h in self.hooks], default=1)

    def on_rollout(self, batch: DataBatch, prompts: DataBatch, rollout: Rollout) -> DataBatch:
        for hook in self.hooks:
            batch = hook.on_rollout(batch, prompts, rollout)
        return batch

    def begin_step(self) -> None:
        for hook in self.hooks:
            hook.begin_step()

    def keep(self, batch: DataBatch) -> DataBatch:
        for hook in self.hooks:
            batch = hook.keep(batch)
        return batch

    def advantages(
        self, batch: DataBatch, *, kl_coef: float, max_response_length: int
    ) -> tuple[DataBatch, dict[str, float]]:
        extra = {k: v for h in self.hooks for k, v in h.advantage_args().items()}
        batch, metrics = compute_advantage(
            batch, self.cfg, kl_coef=kl_coef, max_response_length=max_response_length, **extra
        )
        for hook in self.hooks:
            metrics |= hook.after_advantages(batch)
        return batch, metrics

    def after_update(self, batch: DataBatch) -> dict[str, float]:
        return {k: v for h in self.hooks for k, v in h.after_update(batch).items()}

    def state_dict(self) -> dict[str, Any]:
        return {k: v for h in self.hooks for k, v in h.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for hook in self.hooks:
            hook.load_state_dict(state)
