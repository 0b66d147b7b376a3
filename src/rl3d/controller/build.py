"""Assemble a run from its resolved config: process groups, workers, data, logging, checkpoints.

Runs on every rank under torchrun (the spmd backend). The recipe was validated before any
process group existed; this module turns it into the objects `RLTrainer` drives.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl3d.config import LoadedConfig, RL3DConfig
from rl3d.controller.batch import DataBatch
from rl3d.controller.dispatch import SPMDWorkerGroup
from rl3d.controller.trainer import RLTrainer, Workers

logger = logging.getLogger(__name__)


class PromptBatches:
    """The sampler's prompts as DataBatches (identical on every rank: same seed)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def next_batch(self) -> DataBatch:
        items = self.sampler.next_batch()
        return DataBatch(
            meta={
                "prompt_ids": [list(i.prompt_ids) for i in items],
                "prompt_text": [i.prompt_text for i in items],
                "answer": [i.answer for i in items],
                "source": [i.source for i in items],
                "index": [i.index for i in items],
            }
        )


class TrainerCheckpoints:
    """Model + optimizer + scheduler (megatron dist checkpoints), data position, KL controller
    and every rank's RNG, written atomically by `CheckpointManager` (tmp dir, then rename)."""

    def __init__(self, cfg: RL3DConfig, run_dir: Path, roles: dict[str, Any], groups):
        from rl3d.checkpoint import CheckpointManager

        self.cfg, self.roles, self.groups = cfg, roles, groups
        self.manager = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last)

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_every
        return every > 0 and (step % every == 0 or step == self.cfg.trainer.total_steps)

    def save(self, step: int, trainer: RLTrainer) -> Path:
        from rl3d.checkpoint import capture_rng_state
        from rl3d.models.dist_checkpoint import save_checkpoint

        def write(tmp: Path) -> None:
            for name, role in self.roles.items():
                save_checkpoint(
                    tmp / name,
                    ddp=role.ddp,
                    optimizer=role.optimizer,
                    scheduler=role.scheduler,
                    groups=self.groups,
                    iteration=step,
                )
            torch.save(capture_rng_state(), tmp / f"rng_rank{self.groups.rank}.pt")
            if self.groups.rank == 0:
                state = {
                    "step": step,
                    "sampler": trainer.sampler.sampler.state_dict(),
                    "kl_ctl": trainer.kl_ctl.state_dict(),
                    "history": trainer.history,
                }
                (tmp / "trainer_state.json").write_text(json.dumps(state))

        return self.manager.save(
            step, write, rank=self.groups.rank, world_size=dist.get_world_size(), barrier=dist.barrier
        )

    def resume(self, sampler, kl_ctl) -> tuple[int, list]:
        """Restore the newest complete checkpoint; (step, metric history), or (0, []) if none."""
        from rl3d.checkpoint import restore_rng_state
        from rl3d.models.dist_checkpoint import load_checkpoint

        if self.cfg.checkpoint.resume == "never" or (latest := self.manager.latest()) is None:
            return 0, []
        step, path = latest
        for name, role in self.roles.items():
            load_checkpoint(
                path / name,
                ddp=role.ddp,
                optimizer=role.optimizer,
                scheduler=role.scheduler,
                groups=self.groups,
            )
        state = json.loads((path / "trainer_state.json").read_text())
        sampler.load_state_dict(state["sampler"])
        kl_ctl.load_state_dict(state["kl_ctl"])
        restore_rng_state(torch.load(path / f"rng_rank{self.groups.rank}.pt", weights_only=False))
        logger.info("resumed from %s (step %d)", path, step)
        return step, state["history"]


def build_trainer(loaded: LoadedConfig, run_dir: Path) -> RLTrainer:
    from rl3d import algos
    from rl3d.controller.hooks import load_hooks
    from rl3d.data import PromptSampler, load_prompt_dataset, load_tokenizer
    from rl3d.logging import JsonlMetricsWriter, Progress, TensorBoardWriter
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel import ParallelLayout
    from rl3d.rewards import answer_check_for
    from rl3d.workers.roles import ActorRolloutWorker, CriticWorker, ReferenceWorker, RewardWorker

    cfg = loaded.config
    spec = get_model_spec(cfg.model.name)
    par = cfg.actor.parallel
    groups = init_megatron(ParallelLayout(par.pp, par.tp, par.dp), seed=cfg.trainer.seed)
    # synthetic tasks speak token ids: they never need the model's text tokenizer
    text_data = bool(cfg.data.train_files)
    tokenizer = load_tokenizer(
        cfg.data.tokenizer or (cfg.model.hf_path if text_data else None), vocab_size=spec.vocab_size
    )
    dataset = load_prompt_dataset(cfg.data, tokenizer, answer_check=answer_check_for(cfg.reward, cfg.data))
    if dataset.num_bad_rows:
        logger.warning("data: skipped %d bad rows (see the log above for file and row)", dataset.num_bad_rows)
    sampler = PromptSampler(
        dataset, prompts_per_step=cfg.data.prompts_per_step, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle
    )
    pad = getattr(tokenizer, "pad_token_id", None)
    actor = ActorRolloutWorker(cfg, spec, groups, pad_token_id=0 if pad is None else pad)
    roles = {"actor": actor.role}
    critic = reference = None
    if cfg.reference_enabled:
        reference = ReferenceWorker(cfg, spec, groups, init_from=actor.role)
    if cfg.critic_enabled:
        critic = CriticWorker(cfg, spec, groups, init_from=actor.role)
        roles["critic"] = critic.role
    workers = Workers(
        actor=SPMDWorkerGroup(actor, role="actor"),
        reward=SPMDWorkerGroup(RewardWorker(cfg, tokenizer), role="reward"),
        critic=SPMDWorkerGroup(critic, role="critic") if critic else None,
        reference=SPMDWorkerGroup(reference, role="reference") if reference else None,
    )
    kl = cfg.algorithm.kl
    kl_args = {"kl_coef": kl.coef} | (
        {"target_kl": kl.target, "horizon": kl.horizon} if kl.controller == "adaptive" else {}
    )
    kl_ctl = algos.make_kl_controller(kl.controller, **kl_args)
    checkpoints = TrainerCheckpoints(cfg, run_dir, roles, groups)
    start_step, history = checkpoints.resume(sampler, kl_ctl)
    sinks: list[Any] = []
    if groups.rank == 0:
        if cfg.logging.jsonl:
            sinks.append(JsonlMetricsWriter(run_dir / "metrics.jsonl", rank=0))
        if cfg.logging.tensorboard:
            sinks.append(TensorBoardWriter(run_dir / "tensorboard"))
    progress = Progress(
        cfg.trainer.total_steps, start=start_step, emit=logger.info if groups.rank == 0 else (lambda _: None)
    )
    trainer = RLTrainer(
        cfg,
        workers,
        sampler=PromptBatches(sampler),
        kl_ctl=kl_ctl,
        sinks=sinks,
        hooks=load_hooks(cfg.trainer.hooks),
        progress=progress,
        checkpoints=checkpoints,
        start_step=start_step,
    )
    trainer.history = history
    return trainer
