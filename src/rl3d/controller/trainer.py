"""The single controller: one object owns the RL loop and calls worker groups.

A step reads like the algorithm (PPO family with a critic, GRPO family without):
generate -> score -> old/ref log-probs and values -> advantages -> update critic -> update
actor -> reshard. What differs between algorithms comes from the `rl3d.algos` registry.
"""

from __future__ import annotations

import logging
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rl3d import algos
from rl3d.config import RL3DConfig
from rl3d.controller.advantage import compute_advantage, response_stats
from rl3d.single_controller.batch import DataBatch

logger = logging.getLogger(__name__)


@dataclass
class StageTimer:
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


class RLTrainer:
    def __init__(
        self,
        cfg: RL3DConfig,
        roles,
        *,
        sampler,
        kl_ctl,
        sinks,
        hooks,
        progress,
        checkpoints,
        start_step: int = 0,
        agree,
        lagrange=None,
    ):
        self.cfg, self.roles = cfg, roles  # rl3d.controller.assemble.RoleGroups
        self.sampler, self.kl_ctl, self.sinks, self.hooks = sampler, kl_ctl, sinks, hooks
        self.progress, self.checkpoints, self.start_step = progress, checkpoints, start_step
        self.history: list[dict[str, float]] = []
        self.stop_requested = False
        self.agree = agree  # the backend's: True everywhere once any controller's flag is set
        self.lagrange = lagrange  # Safe-RLHF's multiplier (rl3d.algos.LagrangeMultiplier)

    def _on_signal(self, signum, _frame) -> None:
        logger.warning("signal %d: checkpointing after this step, then exiting", signum)
        self.stop_requested = True

    def fit(self) -> list[dict[str, float]]:
        previous = signal.signal(signal.SIGUSR1, self._on_signal)
        try:
            self.roles.actor.call("reshard")  # the first generation needs generation shards
            for step in range(self.start_step + 1, self.cfg.trainer.total_steps + 1):
                metrics = self.run_step(step)
                self.history.append(metrics)
                for sink in self.sinks:
                    sink.log(step, metrics)
                self.progress.update(1, {"reward": metrics["reward/score_mean"]})
                stop = self.agree(self.stop_requested)  # every controller checkpoints the same step
                if self.checkpoints.due(step) or stop:
                    path = self.checkpoints.save(step, self)
                    self.hooks.call("on_checkpoint", step=step, batch=None, metrics={"path": str(path)})
                if stop:
                    logger.warning("stopped at step %d on request (checkpoint saved)", step)
                    break
        finally:
            signal.signal(signal.SIGUSR1, previous)
        return self.history

    def run_step(self, step: int) -> dict[str, float]:
        cfg, t = self.cfg, StageTimer()
        metrics: dict[str, float] = {}
        with t("generate"):
            batch = self.generate(step, metrics)
        self.hooks.call("on_rollout_end", step=step, batch=batch, metrics=metrics)
        with t("old_logp"):
            batch = batch.union(self.roles.actor.call("compute_log_prob", batch))
        for stage, method, group in self.roles.stages("compute"):  # reference, critics, ...
            with t(stage):
                batch = batch.union(group.call(method, batch))
        with t("advantage"):
            batch, adv_metrics = compute_advantage(
                batch,
                cfg.algorithm,
                kl_coef=self.kl_ctl.value,
                max_response_length=cfg.rollout.max_new_tokens,
                lagrange_multiplier=self.lagrange.value if self.lagrange else None,
            )
        metrics |= adv_metrics | response_stats(batch)
        for stage, method, group in self.roles.stages("update"):
            with t(stage):
                metrics |= group.call(method, batch) or {}
        with t("update_actor"):
            metrics |= self.roles.actor.call("update_actor", batch) or {}
        with t("reshard"):
            metrics |= self.roles.actor.call("reshard")
        self.kl_ctl.update(current_kl=metrics.get("kl/actor_ref_k1", 0.0), num_steps=len(batch))
        metrics["kl/coef"] = float(self.kl_ctl.value)
        if self.lagrange is not None:  # lambda rises while the mean cost exceeds the threshold
            metrics["safe/lambda"] = self.lagrange.value  # the value this step's advantages used
            metrics["safe/lambda_next"] = self.lagrange.update(batch["cost"])
        tokens = float(batch["attention_mask"].sum())
        step_s = sum(t.seconds.values())
        metrics |= {f"time/{k}": v for k, v in t.seconds.items()} | {"time/step": step_s}
        metrics["perf/tokens_per_s"] = tokens / step_s if step_s else 0.0
        metrics["perf/gen_tokens_per_s"] = float(batch["response_mask"].sum()) / max(
            t.seconds["generate"], 1e-9
        )
        self.hooks.call("on_step_end", step=step, batch=batch, metrics=metrics)
        return metrics

    def generate(self, step: int, metrics: dict[str, float]) -> DataBatch:
        """Sample prompts, roll out, score. DAPO's dynamic sampling drops groups whose rewards are
        all equal and refills from new prompts (a bounded number of times); ReMax also scores one
        greedy response per prompt as its baseline. Then the generation weights are released."""
        wanted, family = self.cfg.data.prompts_per_step, self.cfg.algorithm.family
        kept: list[DataBatch] = []
        num_kept = tries = 0
        while num_kept < wanted:
            prompts = self.sampler.next_batch()
            # a unique id per prompt of this step: GRPO-style groups and DAPO's filter key on it
            prompts.set("uid", [step * 1_000_000 + tries * 10_000 + i for i in range(len(prompts))])
            batch = self.score(
                self.roles.actor.call("generate_sequences", prompts, step=step * 16 + tries), metrics
            )
            if family.needs_greedy_baseline:
                greedy = self.score(
                    self.roles.actor.call("generate_sequences", prompts, step=step, greedy=True), {}
                )
                by_uid = dict(zip(greedy["uid"].tolist(), greedy["score"].tolist()))
                batch.set("greedy_score", torch.tensor([by_uid[u] for u in batch["uid"].tolist()]))
            tries += 1
            if not self.cfg.algorithm.dynamic_sampling:
                kept, num_kept = [batch], wanted
                break
            keep = algos.dynamic_sampling_mask(batch["score"], batch["uid"])
            if keep.any():
                kept.append(batch.select(keep.nonzero().squeeze(-1)))
                num_kept += len(set(kept[-1]["uid"].tolist()))
            if tries >= 8 and num_kept < wanted:
                logger.warning(
                    "dynamic sampling: %d/%d groups informative after %d rounds; keeping all",
                    num_kept,
                    wanted,
                    tries,
                )
                kept, num_kept = [batch], wanted
        self.roles.actor.call("release_generation")
        metrics["generate/rounds"] = tries
        merged = DataBatch.concat(kept)
        uids = set(list(dict.fromkeys(merged["uid"].tolist()))[:wanted])
        return merged.select([i for i, u in enumerate(merged["uid"].tolist()) if u in uids])

    def score(self, batch: DataBatch, metrics: dict[str, float]) -> DataBatch:
        scores, reward_metrics = self.roles.reward.call("compute_reward", batch)
        metrics |= reward_metrics
        return batch.union(scores)
