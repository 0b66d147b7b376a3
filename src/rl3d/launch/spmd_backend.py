"""The spmd backend: torchrun starts every rank, and every controller rank runs the controller.

With own resource pools the torchrun world first splits into one world per pool
(`rl3d.single_controller.spmd_pools.split_world`); each rank builds its pool's role workers
(`rl3d.controller.rank`). With a separate rollout pool (the last pool) its ranks run the pool's
loop instead, and the actor's ranks join the weight bridge to them (`SPMDPoolHost`, what the
placement starts on this backend); the link between trainer and pool goes through the world's
TCPStore.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rl3d.config import RL3DConfig
from rl3d.config.pools import role_pools
from rl3d.config.roles import ACTOR
from rl3d.controller.assemble import RankFiles, RunData
from rl3d.controller.build import Started
from rl3d.controller.placement import PoolConnection
from rl3d.controller.rank import RankWorkers, build_rank_workers, load_rank_files, save_rank_files
from rl3d.hybrid_engine.pool import check_sent
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

    def start(self, cfg: RL3DConfig, run_dir: Path, data: RunData, placement: Any) -> Started:
        from rl3d.models.bootstrap import init_megatron
        from rl3d.single_controller.spmd_pools import split_world

        pools = role_pools(cfg)
        pool, channel = pools[0], None
        if len(pools) > 1:
            pool, channel = split_world(pools, backend=dist.get_backend(), timeout_s=cfg.launch.timeout_s)
        host = SPMDPoolHost(cfg, data, pools, pool, channel)
        placement.launch(host)
        if host.runner is not None:  # this rank became one of the rollout pool's
            return Started(runner=host.runner)
        pools = placement.trainer_pools(pools)
        groups = init_megatron(pool.layout, seed=cfg.trainer.seed)
        rank = build_rank_workers(
            cfg,
            data.spec,
            groups,
            data.tokenizer,
            pools=pools,
            pool=pool,
            run_dir=run_dir,
            sync=host.channel.barrier if host.channel else lambda: None,
        )
        host.actor_worker = rank.workers.get(ACTOR)
        return Started(roles=SPMDBackend(cfg, rank, data.tokenizer, host.channel))


class SPMDPoolHost:
    """This torchrun rank's side of a rollout pool a placement starts (`PoolHost`): on one of
    the pool's ranks, the pool's loop (`runner`); on a controller rank, the actor's end of the
    weight bridge (collective with the pool's ranks), the link, and the controllers' own
    channel without the pool's ranks."""

    def __init__(self, cfg: RL3DConfig, data: RunData, pools: list, pool: Any, channel: Any):
        self.cfg, self.data, self.pools, self.pool = cfg, data, pools, pool
        self.channel = channel  # the controllers' channel (`ControllerChannel`) with own pools
        self.runner: Any = None
        self.actor_worker: Any = None  # this rank's actor worker, once built (None off the actor's pool)

    def start_rollout_pool(self, rollout: Any, plan: Any) -> PoolConnection | None:
        from rl3d.controller.rollout_pool import rollout_runner
        from rl3d.single_controller.spmd_pools import ControllerChannel
        from rl3d.weight_sync import DeltaSender, WeightBridge, send_weights

        cfg, channel, actor = self.cfg, self.channel, self.pools[0]
        ro, device = cfg.rollout.async_, resolve_device(cfg.launch.device)
        if self.pool.name == rollout.name:
            local = channel.rank - rollout.offset
            self.runner = rollout_runner(
                cfg,
                self.data,
                plan,
                channel.store,
                pool=rollout,
                local=local,
                num_train=actor.size,
                device=device,
            )
            return None
        bridge = None
        if self.pool.name == ACTOR:
            bridge = WeightBridge(
                channel.store,
                rank=channel.rank - self.pool.offset,
                num_train=actor.size,
                num_rollout=rollout.size,
                device=device,
                timeout_s=ro.timeout_s,
            )
        delta = DeltaSender() if plan.delta and bridge is not None else None
        world_rank = channel.rank
        if len(self.pools) > 2:  # critic/reference pools too: the controllers' channel, the pool's out
            self.channel = ControllerChannel(
                dist.PrefixStore("trainer/", channel.store), channel.rank, rollout.offset, channel.timeout_s
            )
        else:
            self.channel = None  # the actor's pool alone trains: its own world is the controllers'

        def send() -> Any:
            if bridge is None:  # a critic/reference rank: not part of the transfer
                return None
            shards = self.actor_worker.role.transition_shards()
            train_rank = world_rank - actor.offset
            return check_sent(
                plan, [train_rank], [send_weights(bridge, plan, shards, train_rank, delta=delta)]
            )

        logger.info("%s", plan.describe())
        link = AsyncLink(channel.store, timeout_s=ro.timeout_s, who=f"training rank {world_rank}")
        return PoolConnection(link=link, send=send, rank=world_rank)
