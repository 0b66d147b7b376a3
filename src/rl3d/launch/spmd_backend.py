"""The spmd backend: torchrun starts every rank, and every controller rank runs the controller.

With own resource pools the torchrun world first splits into one world per pool
(`rl3d.single_controller.spmd_pools.split_world`); each rank builds its pool's role workers
(`rl3d.controller.rank`). With a separate rollout pool (the last pool) its ranks run the pool's
loop instead, and the actor's ranks join the weight bridge to them; the link between trainer
and pool goes through the world's TCPStore.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rl3d.config import RL3DConfig
from rl3d.config.async_rollout import ROLLOUT_POOL
from rl3d.config.pools import role_pools
from rl3d.config.roles import ACTOR
from rl3d.controller.assemble import RankFiles, RunData
from rl3d.controller.build import Started
from rl3d.controller.rank import RankWorkers, build_rank_workers, load_rank_files, save_rank_files
from rl3d.single_controller.async_link import AsyncLink
from rl3d.single_controller.spmd import SPMDWorkerGroup, agree
from rl3d.utils.device import resolve_device

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


class SPMDRun:
    """Starts this torchrun rank's part of a run (`rl3d.controller.build.RunBackend`)."""

    def start(self, cfg: RL3DConfig, run_dir: Path, data: RunData, plan: Any) -> Started:
        from rl3d.models.bootstrap import init_megatron
        from rl3d.single_controller.spmd_pools import split_world

        pools = role_pools(cfg)
        pool, channel = pools[0], None
        if len(pools) > 1:
            pool, channel = split_world(pools, backend=dist.get_backend(), timeout_s=cfg.launch.timeout_s)
        if plan is not None and pool.name == ROLLOUT_POOL:
            from rl3d.controller.rollout_pool import rollout_runner

            local, actor = channel.rank - pool.offset, pools[0]
            device = resolve_device(cfg.launch.device)
            runner = rollout_runner(
                cfg, data, plan, channel.store, pool=pool, local=local, num_train=actor.size, device=device
            )
            return Started(runner=runner)
        separate = _SeparateSide(cfg, pools, pool, channel, plan) if plan is not None else None
        if separate is not None:
            pools, channel = pools[:-1], separate.trainer_channel
        groups = init_megatron(pool.layout, seed=cfg.trainer.seed)
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
        roles = SPMDBackend(cfg, rank, data.tokenizer, channel)
        if separate is None:
            return Started(roles=roles)
        return separate.started(roles, rank.workers.get(ACTOR))


class _SeparateSide:
    """A controller rank's side of a separate rollout pool: the actor's ranks' end of the
    weight bridge (collective with the pool's ranks), the link, the controllers' own channel."""

    def __init__(self, cfg: RL3DConfig, pools: list, pool: Any, channel: Any, plan: Any):
        from rl3d.single_controller.spmd_pools import ControllerChannel
        from rl3d.weight_sync import WeightBridge

        actor, rollout = pools[0], pools[-1]
        assert rollout.name == ROLLOUT_POOL, pools
        ro = cfg.rollout.async_
        self.plan, self.world_rank, self.actor = plan, channel.rank, actor
        self.bridge = None
        if pool.name == ACTOR:
            self.bridge = WeightBridge(
                channel.store,
                rank=channel.rank - pool.offset,
                num_train=actor.size,
                num_rollout=rollout.size,
                device=resolve_device(cfg.launch.device),
                timeout_s=ro.timeout_s,
            )
        self.trainer_channel = None
        if len(pools) > 2:  # critic/reference pools too: the controllers' channel without the rollout pool
            self.trainer_channel = ControllerChannel(
                dist.PrefixStore("trainer/", channel.store), channel.rank, rollout.offset, channel.timeout_s
            )
        self.link = AsyncLink(channel.store, timeout_s=ro.timeout_s, who=f"training rank {channel.rank}")

    def started(self, roles: SPMDBackend, actor_worker: Any) -> Started:
        from rl3d.weight_sync import send_weights

        def send() -> float:
            if actor_worker is None:  # a critic/reference rank: not part of the transfer
                return 0.0
            shards = actor_worker.role.transition_shards()
            return send_weights(self.bridge, self.plan, shards, self.world_rank - self.actor.offset).seconds

        logger.info("%s", self.plan.describe())
        return Started(roles=roles, link=self.link, send=send, rank=self.world_rank)
