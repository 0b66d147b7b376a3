"""The resource pools a recipe asks for: which ranks host which roles, in which layout.

The actor's pool comes first (world ranks 0 .. p*t*d - 1) and hosts the actor, its rollout
engine and every colocated role, in the actor's layout. A critic or reference with
`colocate: false` gets its own pool, in its own `parallel` layout, on the ranks after it
(critic first, then reference). Both backends build from this one list: under torchrun each
pool becomes its own torch.distributed world (`rl3d.single_controller.spmd_pools`), under Ray its
own placement group and world.

    actor tp=2 dp=1, critic own pool tp=1 dp=2  ->  actor: ranks 0-1, critic: ranks 2-3
"""

from __future__ import annotations

from dataclasses import replace

from rl3d.config.schema import ParallelConfig, RL3DConfig
from rl3d.parallel.layout import ParallelLayout
from rl3d.single_controller.pools import Pool, hosting, pool_of

__all__ = ["Pool", "hosting", "pool_of", "role_pools"]


def _layout(par: ParallelConfig) -> ParallelLayout:
    return ParallelLayout(par.pp, par.tp, par.dp)


def role_pools(cfg: RL3DConfig) -> list[Pool]:
    """The pools in world-rank order; the first is the actor's."""
    colocated = ["actor"]
    own: list[tuple[str, ParallelConfig]] = []
    if cfg.critic_enabled:
        if cfg.critic.colocate:
            colocated.append("critic")
        else:
            own.append(("critic", cfg.critic.parallel))
    if cfg.reference_enabled:
        if cfg.reference.colocate:
            colocated.append("reference")
        else:
            own.append(("reference", cfg.reference.parallel))
    pools = [Pool("actor", _layout(cfg.actor.parallel), 0, tuple(colocated))]
    for name, par in own:
        pools.append(Pool(name, _layout(par), pools[-1].offset + pools[-1].size, (name,)))
    if cfg.algorithm.family.needs_cost_critic:  # Safe-RLHF's cost critic lives with the critic
        pools = [replace(p, roles=(*p.roles, "cost_critic")) if "critic" in p.roles else p for p in pools]
    return pools
