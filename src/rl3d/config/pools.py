"""The resource pools a recipe asks for: which ranks host which roles, in which layout.

The actor's pool comes first (world ranks 0 .. p*t*d - 1) and hosts the actor, its rollout
engine and every colocated role, in the actor's layout. A critic or reference with
`colocate: false` (or a recipe's own role, `roles.<name>.colocate: false`) gets its own pool,
in its own `parallel` layout, on the ranks after it, in role-table order (critic, reference,
then the recipe's roles; `rl3d.config.roles`); with `rollout.placement: separate` the
generation pool comes last (`rl3d.config.async_rollout`). Both backends build from this one
list: under torchrun each pool becomes its own torch.distributed world
(`rl3d.single_controller.spmd_pools`), under Ray its own placement group and world.

    actor tp=2 dp=1, critic own pool tp=1 dp=2  ->  actor: ranks 0-1, critic: ranks 2-3
"""

from __future__ import annotations

from dataclasses import replace

from rl3d.config.async_rollout import ROLLOUT_POOL, is_separate
from rl3d.config.roles import ACTOR, role_table
from rl3d.config.schema import ParallelConfig, RL3DConfig
from rl3d.parallel.layout import ParallelLayout
from rl3d.single_controller.pools import Pool, hosting, pool_of

__all__ = ["Pool", "hosting", "layout_of", "pool_of", "role_pools", "weight_sync_plan"]


def layout_of(par: ParallelConfig) -> ParallelLayout:
    """The layout a `parallel` section asks for."""
    return ParallelLayout(
        par.pp, par.tp, par.dp, ep=getattr(par, "ep", 1), etp=getattr(par, "etp", None), cp=par.cp
    )


def role_pools(cfg: RL3DConfig) -> list[Pool]:
    """The pools in world-rank order; the first is the actor's. Built from the role table:
    a role with its own layout gets its own pool, in table order; `pool_with` roles join the
    pool of the role they name."""
    table = role_table(cfg)
    colocated = [r.name for r in table if r.pool_with is None and r.own_layout(cfg) is None]
    pools = [Pool(ACTOR, layout_of(cfg.actor.parallel), 0, tuple(colocated))]
    for role in table:
        if role.pool_with is None and (par := role.own_layout(cfg)) is not None:
            pools.append(Pool(role.name, layout_of(par), pools[-1].offset + pools[-1].size, (role.name,)))
    for role in table:
        if role.pool_with is not None:
            pools = [
                replace(p, roles=(*p.roles, role.name)) if role.pool_with in p.roles else p for p in pools
            ]
    if is_separate(cfg):  # generation on its own pool, last: every trainer-side rank comes first
        gen = cfg.rollout.pool
        end = pools[-1].offset + pools[-1].size
        pools.append(Pool(ROLLOUT_POOL, ParallelLayout(1, gen.tp, gen.dp), end, (ROLLOUT_POOL,)))
    return pools


def weight_sync_plan(cfg: RL3DConfig, spec):
    """A separate rollout pool's weight-sync plan (`rl3d.hybrid_engine.pool.PoolTransition`):
    from the actor's pool (the first) to the rollout pool. `spec`: the model's `ModelSpec`."""
    from rl3d.hybrid_engine.pool import plan_pool_transition

    return plan_pool_transition(
        spec,
        role_pools(cfg)[0].layout.as_data_replicas(),  # CP ranks hold the same weights as DP ranks
        gen_tp=cfg.rollout.pool.tp,
        gen_dp=cfg.rollout.pool.dp,
        dtype=cfg.model.dtype,
        bucket_bytes=int(cfg.rollout.async_.bucket_mb * 2**20),
        delta=cfg.rollout.weight_update == "delta",
    )
