"""Resource pools: which world ranks host which roles, in which megatron layout.

A pool is what both worker-group backends build one torch.distributed world from (spmd: a
split of the torchrun world, `rl3d.single_controller.spmd_pools`; Ray: a placement group).
Which pools a recipe asks for is the config's business (`rl3d.config.pools.role_pools`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rl3d.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class Pool:
    name: str  # "actor", "critic" or "reference"
    layout: ParallelLayout
    offset: int  # world rank of the pool's rank 0
    roles: tuple[str, ...]  # the worker groups it hosts ("cost_critic": Safe-RLHF, with the critic)

    @property
    def size(self) -> int:
        return self.layout.world_size

    @property
    def ranks(self) -> range:
        return range(self.offset, self.offset + self.size)


def pool_of(pools: list[Pool], rank: int) -> Pool:
    for pool in pools:
        if rank in pool.ranks:
            return pool
    raise ValueError(f"rank {rank} is in none of the pools {[(p.name, p.ranks) for p in pools]}")


def hosting(pools: list[Pool], role: str) -> Pool:
    return next(p for p in pools if role in p.roles)
