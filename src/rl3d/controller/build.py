"""The spmd assembly: torchrun starts every rank, and every rank runs the controller.

Each rank builds its pool's role workers (`rl3d.controller.rank`); with own resource pools the
torchrun world first splits into one world per pool (`rl3d.single_controller.spmd_pools`).
The rest is `rl3d.controller.assemble`, shared with the Ray backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rl3d.config import LoadedConfig, RL3DConfig
from rl3d.config.async_rollout import is_separate
from rl3d.config.pools import role_pools
from rl3d.controller.assemble import RankFiles, assemble_trainer, build_data
from rl3d.controller.rank import RankWorkers, build_rank_workers, load_rank_files, save_rank_files
from rl3d.controller.trainer import RLTrainer
from rl3d.single_controller.spmd import SPMDWorkerGroup, agree

logger = logging.getLogger(__name__)


def spmd_rank_files(rank: RankWorkers, channel: Any = None) -> RankFiles:
    """This torchrun rank's files; with own pools the barrier spans them through `channel`."""
    return RankFiles(
        save=lambda tmp, step: save_rank_files(rank, tmp, step),
        load=lambda path: load_rank_files(rank, path),
        rank=channel.rank if channel else rank.groups.rank,
        world_size=channel.world_size if channel else dist.get_world_size(),
        barrier=channel.barrier if channel else dist.barrier,
    )


@dataclass
class SPMDBackend:
    """This rank's side of every role: its own worker where its pool hosts the role, else
    nothing (the `channel` brings the role's result from the other pool)."""

    cfg: RL3DConfig
    rank: RankWorkers
    tokenizer: Any
    channel: Any = None  # rl3d.single_controller.spmd_pools.ControllerChannel with own pools

    @property
    def writes(self) -> bool:
        return (self.channel.rank if self.channel else self.rank.groups.rank) == 0

    def group(self, role: str) -> SPMDWorkerGroup:
        return SPMDWorkerGroup(self.rank.workers.get(role), role=role, channel=self.channel)

    def reward_group(self) -> SPMDWorkerGroup:
        from rl3d.workers.roles import RewardWorker

        if self.cfg.reward.num_workers:
            logger.warning(
                "reward.num_workers = %d: fanning scoring out needs launch.backend: ray; scoring in process",
                self.cfg.reward.num_workers,
            )
        return SPMDWorkerGroup(RewardWorker(self.cfg, self.tokenizer), role="reward")

    def rank_files(self) -> RankFiles:
        return spmd_rank_files(self.rank, self.channel)

    def agree(self, flag: bool) -> bool:
        return agree(flag, self.channel)


def build_trainer(loaded: LoadedConfig, run_dir: Path) -> RLTrainer:
    from rl3d.models.bootstrap import init_megatron
    from rl3d.single_controller.spmd_pools import split_world

    cfg = loaded.config
    pools = role_pools(cfg)
    if is_separate(cfg):  # generation on its own pool (rl3d.controller.async_trainer)
        from rl3d.controller.async_trainer import build_async

        return build_async(loaded, run_dir, pools)
    pool, channel = pools[0], None
    if len(pools) > 1:
        pool, channel = split_world(pools, backend=dist.get_backend(), timeout_s=cfg.launch.timeout_s)
    groups = init_megatron(pool.layout, seed=cfg.trainer.seed)
    data = build_data(cfg)
    rank = build_rank_workers(
        cfg,
        data.spec,
        groups,
        data.tokenizer,
        pools=pools,
        pool=pool,
        run_dir=run_dir,
        sync=channel.barrier if channel else lambda: None,
    )
    return assemble_trainer(cfg, run_dir, SPMDBackend(cfg, rank, data.tokenizer, channel), data)
