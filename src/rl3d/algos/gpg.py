"""GPG's batch-level corrections (Chu et al. 2025, arXiv 2504.02546, "Accurate Gradient
Estimation"): the advantage rescaling by the share of valid groups, and the threshold on it.

A group whose responses all scored the same (all solved, all failed) has zero advantage under a
group baseline and adds nothing to the gradient, yet counts in the loss's mean: with `B` samples
of which `M` sit in such groups, the gradient is `(B - M) / B` of what the valid samples alone
give. GPG multiplies every advantage by

    alpha = B / (B - M)                        (1 when no sample is valid: nothing to scale)

and, with a threshold `beta_th`, rolls out further rounds of prompts until the valid share
`(B - M) / B` of the step's batch reaches `beta_th`: each round keeps its valid groups, and the
round that reaches the share fills the rest of the batch with its zero-advantage groups.

Both are hooks (`rl3d.algos.algorithm.HOOKS`) the `gpg` policy loss turns on: `gpg_rescale`
(preset on; `algorithm.loss_params.gpg_rescale: false` turns it off) and `gpg_threshold`
(`algorithm.loss_params.gpg_threshold`, off unless set).
"""

from __future__ import annotations

from typing import Any

import torch

from rl3d.algos.advantages import dynamic_sampling_mask
from rl3d.algos.algorithm import HOOKS, AlgorithmHook
from rl3d.single_controller.batch import DataBatch

Tensor = torch.Tensor


def valid_samples(scores_B: Tensor, group_ids_B: Tensor) -> tuple[int, int]:
    """`(B - M, B)`: samples in groups whose scores are not all equal, and all samples."""
    return int(dynamic_sampling_mask(scores_B, group_ids_B).sum()), len(scores_B)


def gpg_alpha(num_valid: int, num_samples: int) -> float:
    """GPG's `alpha = B / (B - M)`; 1 when no sample is valid (every advantage is 0 then)."""
    return num_samples / num_valid if num_valid else 1.0


@HOOKS.register("gpg_rescale")
class GPGRescale(AlgorithmHook):
    """Multiplies the step's advantages by `alpha = B / (B - M)` over the whole batch (GPG)."""

    def __init__(self, cfg: Any):
        pass

    def after_advantages(self, batch: DataBatch) -> dict[str, float]:
        num_valid, num_samples = valid_samples(batch["score"].float(), batch["uid"])
        alpha, share = gpg_alpha(num_valid, num_samples), num_valid / num_samples
        batch.set("advantages", batch["advantages"] * alpha)
        batch.set("returns", batch["returns"] * alpha)
        return {"adv/gpg_alpha": alpha, "adv/valid_share": share}


@HOOKS.register("gpg_threshold")
class GPGThreshold(AlgorithmHook):
    """Further rollout rounds until the valid share of the step's groups reaches `beta_th`."""

    max_rounds = 8

    def __init__(self, cfg: Any):
        self.beta = cfg.loss_params.gpg_threshold
        self.valid_groups = 0

    def begin_step(self) -> None:
        self.valid_groups = 0

    def keep(self, batch: DataBatch) -> DataBatch:
        uids = batch["uid"].tolist()
        valid_B = dynamic_sampling_mask(batch["score"].float(), batch["uid"]).tolist()
        valid = list(dict.fromkeys(u for u, v in zip(uids, valid_B) if v))
        self.valid_groups += len(valid)
        wanted = len(set(uids))  # every round samples the step's number of prompts
        if self.valid_groups < self.beta * wanted:
            order = valid
        else:  # enough: this round's zero-advantage groups fill the batch after the valid ones
            order = valid + [u for u in dict.fromkeys(uids) if u not in set(valid)]
        rank = {u: i for i, u in enumerate(order)}
        rows = sorted((i for i, u in enumerate(uids) if u in rank), key=lambda i: (rank[uids[i]], i))
        return batch.select(rows)
