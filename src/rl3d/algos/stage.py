"""The step's pure stage between scoring and updates, over a whole batch: rewards -> advantages.

Scores land on each response's last token; DAPO's overlong penalty and the reference KL
(PPO: in the reward) shape them; the registered estimator turns them into advantages, given the
batch columns its `AlgorithmFamily` names (`columns`; an error names a missing one).
`cfg` is the recipe's `rl3d.config.AlgorithmConfig` (not imported: config validates names
against these registries, so it imports algos and never the reverse).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from rl3d.algos.advantages import compute_advantages
from rl3d.algos.core import scores_to_token_rewards
from rl3d.algos.distill import reverse_kl_by_token
from rl3d.algos.kl import kl_k1, kl_penalty_rewards
from rl3d.algos.registry import ESTIMATOR_INPUTS, AlgorithmFamily
from rl3d.algos.reward_shaping import overlong_penalty
from rl3d.single_controller.batch import ROUTING_DECISIONS, ROUTING_DIFFER, DataBatch
from rl3d.tools.trajectory import trajectory_metrics

if TYPE_CHECKING:
    import torch

_HPARAMS = ("gamma", "lam", "whiten", "norm_by_std", "task_coef")
# A column the trainer may leave out, and the one that stands in for it then: `old_logp` is
# skipped on policy (actor.recompute_old_logp), where the engine's log-probs are the same policy's.
_STAND_INS = {"old_logp": "rollout_logp"}


def estimator_hparams(cfg: Any) -> dict:
    """The configured hyper-parameters the estimator's function actually takes."""
    candidates = {
        "gamma": cfg.gamma,
        "lam": cfg.lam,
        "whiten": cfg.whiten_advantages,
        "norm_by_std": cfg.norm_adv_by_std,
        "task_coef": cfg.distill.coef,
    }
    accepted = inspect.signature(cfg.family.fn).parameters
    return {k: v for k, v in candidates.items() if k in accepted and v is not None}


def estimator_inputs(batch: DataBatch, family: AlgorithmFamily, mask_BT: torch.Tensor) -> dict[str, Any]:
    """The batch columns `family`'s estimator takes, as its keyword inputs: every one it requires
    (a ValueError naming the column and the estimator where the batch lacks it), and each
    optional one the batch has."""
    inputs = {}
    for key in (*family.inputs, *family.optional_inputs):
        wanted = ESTIMATOR_INPUTS[key][0]
        column = wanted if wanted in batch else _STAND_INS.get(wanted, wanted)
        if column not in batch:
            if key in family.optional_inputs:
                continue
            either = f" (or {_STAND_INS[wanted]!r})" if wanted in _STAND_INS else ""
            raise ValueError(
                f"advantage estimator {family.name!r} needs the batch column {wanted!r}{either} for "
                f"its {key}; the batch has {', '.join(sorted([*batch.tensors, *batch.meta]))}"
            )
        value = batch[column]
        # a response's cost lands on its last token, as its score does
        inputs[key] = scores_to_token_rewards(value.float(), mask_BT) if key == "cost_rewards_BT" else value
    return inputs


def compute_advantage(
    batch: DataBatch,
    cfg: Any,
    *,
    kl_coef: float,
    max_response_length: int,
    lagrange_multiplier: float | None = None,
) -> tuple[DataBatch, dict[str, float]]:
    """Advantages and returns into `batch`. Safe-RLHF also reads the per-response `cost`, the
    cost critic's `cost_values` and the current Lagrange multiplier, and sets `cost_returns`."""
    mask = batch["response_mask"].bool()
    scores = batch["score"].float()
    metrics: dict[str, float] = {
        "reward/score_mean": scores.mean().item(),
        "reward/score_std": scores.std().item(),
    }
    if cfg.overlong_buffer_length > 0:
        penalty = overlong_penalty(
            mask.sum(-1),
            max_response_length=max_response_length,
            overlong_buffer_length=cfg.overlong_buffer_length,
            penalty_factor=cfg.overlong_penalty_factor,
        )
        scores = scores + penalty
        metrics["reward/overlong_penalty"] = penalty.mean().item()
    rewards = scores_to_token_rewards(scores, mask)
    if kl_coef > 0 and cfg.kl_apply_to == "reward":
        rewards, kl_metrics = kl_penalty_rewards(
            rewards_BT=rewards,
            logp_BT=batch["old_logp"],
            ref_logp_BT=batch["ref_logp"],
            mask_BT=mask,
            kl_coef=kl_coef,
            estimator=cfg.kl_estimator,
        )
        metrics |= {f"kl/{k}": float(v) for k, v in kl_metrics.items()}
    if "cost" in batch:  # a recipe may score a cost under any estimator: logged, used where needed
        costs = batch["cost"].float()
        metrics |= {"cost/mean": costs.mean().item(), "cost/std": costs.std().item()}
    hparams = estimator_hparams(cfg)
    if lagrange_multiplier is not None:
        hparams["lagrange_multiplier"] = lagrange_multiplier
    inputs = estimator_inputs(batch, cfg.family, mask)
    adv = compute_advantages(cfg.adv_estimator, rewards_BT=rewards, mask_BT=mask, **inputs, **hparams)
    batch.set("advantages", adv.adv_BT.float()).set("returns", adv.returns_BT.float())
    if adv.cost_returns_BT is not None:
        batch.set("cost_returns", adv.cost_returns_BT.float())
    valid = adv.adv_BT[mask]
    metrics["adv/mean"] = valid.mean().item() if valid.numel() else 0.0
    metrics["adv/std"] = valid.std().item() if valid.numel() > 1 else 0.0
    if "teacher_logp_BT" in inputs:
        metrics["distill/reverse_kl"] = reverse_kl_by_token(
            inputs["logp_BT"], inputs["teacher_logp_BT"], mask
        ).item()
    # optional by recipe: ref_logp comes with a reference model, old_logp not on policy (_STAND_INS)
    if "ref_logp" in batch and "old_logp" in batch:
        kl = kl_k1(batch["old_logp"], batch["ref_logp"])[mask]
        metrics["kl/actor_ref_k1"] = kl.mean().item() if kl.numel() else 0.0
    return batch, metrics


def response_stats(batch: DataBatch) -> dict[str, float]:
    lengths = batch["response_mask"].sum(-1).float()
    stats = {
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/stop_fraction": sum(f == "stop" for f in batch["finish_reason"]) / len(batch),
    }
    if "trajectory" in batch:  # multi-turn rollouts: tool calls, errors, turns, observation share
        stats |= trajectory_metrics(batch["trajectory"])
    if ROUTING_DIFFER in batch:  # routing replay: the trainer's own router against the record
        decisions = batch[ROUTING_DECISIONS].sum().item()
        stats["moe/routing_mismatch"] = batch[ROUTING_DIFFER].sum().item() / decisions if decisions else 0.0
    if "old_logp" not in batch:  # skipped on policy (actor.recompute_old_logp): the loss reports
        return stats
    rollout = batch["rollout_logp"][batch["response_mask"].bool()]
    trainer = batch["old_logp"][batch["response_mask"].bool()]
    # the rollout engine's log-probs against the trainer's, same tokens: a numerics check
    stats["rollout/logp_diff_max"] = (rollout - trainer).abs().max().item() if rollout.numel() else 0.0
    stats["rollout/logp_diff_mean"] = (rollout - trainer).abs().mean().item() if rollout.numel() else 0.0
    return stats
