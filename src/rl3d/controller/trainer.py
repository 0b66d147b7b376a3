"""The single controller: one object owns the RL loop and calls worker groups.

A step reads like the algorithm (PPO family with a critic, GRPO family without):
generate -> score -> old/ref log-probs and values -> advantages -> update critic -> update
actor -> reshard. The roles come from the role table (`rl3d.config.roles`) and what differs
between algorithms from the algorithm object (`rl3d.algos.Algorithm`): the loop names neither.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rl3d.algos import response_stats
from rl3d.config import RL3DConfig
from rl3d.config.pools import role_pools
from rl3d.config.roles import old_logp_source
from rl3d.controller.placement import round_seed, round_uids
from rl3d.controller.rows import fit_rows
from rl3d.single_controller.batch import DataBatch

logger = logging.getLogger(__name__)


# Where every controller process appends its stage times, one JSON line per step, to
# `<dir>/rank<R>.jsonl`: wall and process CPU seconds per stage. The CPU seconds are this rank's
# work, which other processes on a busy machine barely change (what the step simulator's check,
# `benchmarks/simulator_validation.py`, compares against); unset, nothing is written.
STAGE_TIMES_DIR = "RL3D_STAGE_TIMES_DIR"


@dataclass
class StageTimer:
    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # this process's, all its threads

    @contextmanager
    def __call__(self, stage: str):
        start, cpu_start = time.perf_counter(), time.process_time()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start
        self.cpu_seconds[stage] = self.cpu_seconds.get(stage, 0.0) + time.process_time() - cpu_start

    def append_to(self, directory: str, step: int) -> None:
        """One line of this step's wall and CPU seconds in `directory`/rank<R>.jsonl."""
        rank = int(os.environ.get("RANK", "0"))
        row = {"step": step, "rank": rank, "pid": os.getpid(), "wall": self.seconds, "cpu": self.cpu_seconds}
        with open(Path(directory) / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def throughput(tokens: float, wall_s: float, num_devices: int) -> dict[str, float]:
    """HybridFlow's throughput (EuroSys'25, section 8.1): the prompt and response tokens of a
    step's batch over the step's wall time, generation to resharding, for the whole job; and
    per device, over the ranks of every pool (a separate rollout pool's included)."""
    per_s = tokens / wall_s if wall_s > 0 else 0.0
    return {
        "perf/throughput_tokens_per_s": per_s,
        "perf/throughput_tokens_per_s_per_device": per_s / num_devices,
    }


class NoValidation:
    def start(self, start_step: int) -> None:
        pass

    def after(self, step: int) -> dict[str, float]:
        return {}

    def due(self, step: int) -> bool:
        return False


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
        algorithm,
        placement,
    ):
        self.cfg, self.roles = cfg, roles  # rl3d.controller.assemble.RoleGroups
        self.sampler, self.kl_ctl, self.sinks, self.hooks = sampler, kl_ctl, sinks, hooks
        self.progress, self.checkpoints, self.start_step = progress, checkpoints, start_step
        self.history: list[dict[str, float]] = []
        self.stop_requested = False
        self.agree = agree  # the backend's: True everywhere once any controller's flag is set
        self.algorithm = algorithm  # rl3d.algos.Algorithm: estimator, policy loss, hooks
        self.placement = placement  # rl3d.controller.placement: Colocated or SeparatePool
        self.validation = NoValidation()  # or rl3d.controller.validation.Validator (trainer.val_every)
        self.samples = None  # rl3d.logging.samples.SamplesLog on the writing process (logging.samples)
        self.num_devices = sum(pool.size for pool in role_pools(cfg))  # every pool's ranks: the job's

    def _on_signal(self, signum, _frame) -> None:
        logger.warning("signal %d: checkpointing after this step, then exiting", signum)
        self.stop_requested = True

    def fit(self) -> list[dict[str, float]]:
        previous = signal.signal(signal.SIGUSR1, self._on_signal)
        self.placement.start(self.start_step, self.sampler.sampler.state_dict)
        error: BaseException | None = None
        try:
            self.publish_weights(self.start_step)  # the first generation needs generation shards
            self.validation.start(self.start_step)  # trainer.val_before_train: logged as step 0
            for step in range(self.start_step + 1, self.cfg.trainer.total_steps + 1):
                metrics = self.run_step(step) | self.validation.after(step)  # val/* when due
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
        except BaseException as err:
            error = err
            raise
        finally:
            signal.signal(signal.SIGUSR1, previous)
            self.placement.stop(error)
        return self.history

    def run_step(self, step: int) -> dict[str, float]:
        cfg, t, started = self.cfg, StageTimer(), time.perf_counter()
        metrics: dict[str, float] = {}
        with t("generate"):
            batch = self.generate(step, metrics)
        self.hooks.call("on_rollout_end", step=step, batch=batch, metrics=metrics)
        batch, num_rows = fit_rows(batch, cfg)  # more rows than prompts x n: padded to deal evenly
        if len(batch) != num_rows:
            metrics["generate/padding_rows"] = float(len(batch) - num_rows)
        source = old_logp_source(cfg)
        if source == "recompute":
            with t("old_logp"):
                batch = batch.union(self.roles.actor.call("compute_log_prob", batch))
        elif source == "rollout":  # the engine's own: PPO's ratio is then against the behaviour policy
            batch.set("old_logp", batch["rollout_logp"])
        for stage, method, group in self.roles.stages("compute"):  # critics, reference, own roles
            with t(stage):
                batch = batch.union(group.call(method, batch))
        with t("advantage"):
            batch, adv_metrics = self.algorithm.advantages(
                batch, kl_coef=self.kl_ctl.value, max_response_length=cfg.rollout.max_new_tokens
            )
        rows = batch.slice(0, num_rows)
        metrics |= adv_metrics | response_stats(rows)
        if self.samples is not None:
            self.samples.log(step, rows)
        for stage, method, group in self.roles.stages("update"):
            with t(stage):
                metrics |= group.call(method, batch) or {}
        with t("update_actor"):
            metrics |= self.roles.actor.call("update_actor", batch) or {}
        with t("reshard"):
            metrics |= self.publish_weights(step)
        self.kl_ctl.update(current_kl=metrics.get("kl/actor_ref_k1", 0.0), num_steps=num_rows)
        metrics["kl/coef"] = float(self.kl_ctl.value)
        metrics |= self.algorithm.after_update(batch.slice(0, num_rows))  # e.g. Safe-RLHF's multiplier
        tokens = float(rows["attention_mask"].sum())
        step_s = sum(t.seconds.values())
        metrics |= {f"time/{k}": v for k, v in t.seconds.items()} | {"time/step": step_s}
        metrics["perf/tokens_per_s"] = tokens / step_s if step_s else 0.0
        metrics["perf/gen_tokens_per_s"] = float(batch["response_mask"].sum()) / max(
            t.seconds["generate"], 1e-9
        )
        metrics |= throughput(tokens, time.perf_counter() - started, self.num_devices)
        if os.environ.get(STAGE_TIMES_DIR):
            t.append_to(os.environ[STAGE_TIMES_DIR], step)
        self.hooks.call("on_step_end", step=step, batch=batch, metrics=metrics)
        return metrics

    def publish_weights(self, version: int) -> dict[str, float]:
        """Make policy `version` (after `version` updates) the one that generates; a placement
        may skip it when no step or validation is left to use it."""
        needed = version < self.cfg.trainer.total_steps or self.validation.due(version)
        return self.placement.publish(version, needed=needed)

    def generate(self, step: int, metrics: dict[str, float]) -> DataBatch:
        """Sample prompts, roll out, score, in rounds until the step has its prompts: the
        algorithm's hooks may add to a round (ReMax's greedy baseline) and keep only part of it
        (DAPO's dynamic sampling). Then the placement ends the step's rollout."""
        wanted, algo = self.cfg.data.prompts_per_step, self.algorithm
        kept: list[DataBatch] = []
        num_kept = rounds = 0
        self.placement.begin_step(step)
        algo.begin_step()

        def rollout(prompts: DataBatch, *, greedy: bool = False) -> DataBatch:  # a hook's extra generation
            return self.score(self.rollout(prompts, step=step, greedy=greedy), {})

        while num_kept < wanted:
            prompts = self.sampler.next_batch()
            prompts.set("uid", round_uids(step, rounds, len(prompts)))
            batch = self.score(self.rollout_round(prompts, step, rounds), metrics)
            batch = algo.on_rollout(batch, prompts, rollout)
            rounds += 1
            part = algo.keep(batch)
            if len(part):
                kept.append(part)
                num_kept += len(set(part["uid"].tolist()))
            if num_kept < wanted and rounds >= algo.max_rounds:
                logger.warning(
                    "%d/%d prompt groups kept after %d rollout rounds; training on the last round whole",
                    num_kept,
                    wanted,
                    rounds,
                )
                kept, num_kept = [batch], wanted
        metrics["generate/rounds"] = rounds
        merged = DataBatch.concat(kept)
        uids = set(list(dict.fromkeys(merged["uid"].tolist()))[:wanted])
        batch = merged.select([i for i, u in enumerate(merged["uid"].tolist()) if u in uids])
        metrics |= self.placement.end_step(step, batch, self.sampler.sampler.state_dict)
        return batch

    def rollout_round(self, prompts: DataBatch, step: int, round_index: int) -> DataBatch:
        """Round `round_index` of step `step`'s rollout (seeded `round_seed(step, round_index)`);
        the first is the placement's (a separate pool made it ahead)."""
        if round_index == 0:
            return self.placement.first_round(prompts, step)
        return self.rollout(prompts, step=round_seed(step, round_index))

    def rollout(self, prompts: DataBatch, *, step: int, greedy: bool = False) -> DataBatch:
        """One generation call, seeded by `step` (`greedy=True`: one greedy response per prompt).
        An algorithm's extra rounds and validation generate through it."""
        return self.placement.generate(prompts, step=step, greedy=greedy)

    def score(self, batch: DataBatch, metrics: dict[str, float]) -> DataBatch:
        scores, reward_metrics = self.roles.reward.call("compute_reward", batch)
        metrics |= reward_metrics
        batch = batch.union(scores)
        for _stage, method, group in self.roles.stages("score"):  # learned reward / cost models
            scores, model_metrics = group.call(method, batch)
            metrics |= model_metrics
            batch = batch.union(scores)
        return batch
