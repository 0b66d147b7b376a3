"""The spmd build of a run with a separate rollout pool: the torchrun world splits into one world
per pool (`split_world`), the rollout pool last; its ranks run `RolloutPoolRunner`
(`rl3d.controller.rollout_pool`), the others the one `RLTrainer` with a `SeparatePool` placement
(`rl3d.controller.placement`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rl3d.config import LoadedConfig
from rl3d.config.async_rollout import ROLLOUT_POOL
from rl3d.config.roles import ACTOR
from rl3d.single_controller.async_link import AsyncLink

logger = logging.getLogger(__name__)


def build_async(loaded: LoadedConfig, run_dir: Path, pools: list) -> Any:
    """This rank's side of a run with a separate rollout pool: `RLTrainer` with a `SeparatePool`
    placement on the training ranks, `RolloutPoolRunner` on the rollout pool's."""
    from rl3d.controller.assemble import assemble_trainer, build_data
    from rl3d.controller.build import SPMDBackend
    from rl3d.controller.placement import SeparatePool
    from rl3d.controller.rank import build_rank_workers
    from rl3d.controller.rollout_pool import rollout_runner, sync_plan
    from rl3d.models.bootstrap import init_megatron
    from rl3d.single_controller.spmd_pools import ControllerChannel, split_world
    from rl3d.weight_sync import WeightBridge, send_weights

    cfg = loaded.config
    pool, channel = split_world(pools, backend=dist.get_backend(), timeout_s=cfg.launch.timeout_s)
    store, world_rank = channel.store, channel.rank
    actor, rollout = pools[0], pools[-1]
    assert rollout.name == ROLLOUT_POOL, pools
    ro = cfg.rollout.async_
    data = build_data(cfg)
    plan = sync_plan(cfg, data.spec, actor)
    device = _device(cfg)
    if pool.name == ROLLOUT_POOL:
        local = world_rank - pool.offset
        return rollout_runner(
            cfg, data, plan, store, pool=pool, local=local, num_train=actor.size, device=device
        )
    bridge = None
    if pool.name == ACTOR:
        bridge = WeightBridge(
            store,
            rank=world_rank - pool.offset,
            num_train=actor.size,
            num_rollout=rollout.size,
            device=device,
            timeout_s=ro.timeout_s,
        )

    train_pools = pools[:-1]
    trainer_channel = None
    if len(train_pools) > 1:  # critic/reference pools too: the controller's channel without the rollout pool
        trainer_channel = ControllerChannel(
            dist.PrefixStore("trainer/", store), world_rank, rollout.offset, channel.timeout_s
        )
    groups = init_megatron(pool.layout, seed=cfg.trainer.seed)
    rank = build_rank_workers(
        cfg,
        data.spec,
        groups,
        data.tokenizer,
        pools=train_pools,
        pool=pool,
        run_dir=run_dir,
        sync=trainer_channel.barrier if trainer_channel else lambda: None,
    )
    actor_worker = rank.workers.get(ACTOR)

    def send() -> float:
        if actor_worker is None:  # a critic/reference rank: not part of the transfer
            return 0.0
        shards = actor_worker.role.global_shards()
        return send_weights(bridge, plan, shards, world_rank - actor.offset).seconds

    link = AsyncLink(store, timeout_s=ro.timeout_s, who=f"training rank {world_rank}")
    backend = SPMDBackend(cfg, rank, data.tokenizer, trainer_channel)

    placement = SeparatePool(cfg, link=link, send=send, sync_bytes=plan.total_bytes, rank=world_rank)
    logger.info("%s", plan.describe())
    return assemble_trainer(cfg, run_dir, backend, data, placement=placement)


def _device(cfg) -> str:
    from rl3d.utils.device import resolve_device

    return resolve_device(cfg.launch.device)
