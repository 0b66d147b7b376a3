"""A recipe as the step simulator's workload and run layout (`RunLayout`), and as `rl3d plan`'s shapes.

The critic, the reference and learned reward or cost models take the actor's shape (rl3d's
critic is built from `model`; a learned scorer's own shape is read from its run only when it
loads). A recipe's own roles (`roles:`) are not simulated.
"""

from __future__ import annotations

from rl3d.config import RL3DConfig
from rl3d.config.pools import layout_of, role_pools
from rl3d.config.roles import old_logp_source, role_table
from rl3d.hybrid_engine.report import RecipeShapes
from rl3d.models.spec import spec_of
from rl3d.planning.workload import ROLE_MODEL, ROLLOUT, TRAINED, PoolLayout, RunLayout, Workload
from rl3d.rollout.factory import push_bucket_mb
from rl3d.utils.dtypes import DTYPE_BYTES


def workload_of(cfg: RL3DConfig) -> Workload:
    from rl3d.planning.memory_roles import role_footprint, role_model

    n = cfg.rollout.n
    greedy = cfg.algorithm.family.needs_greedy_baseline  # one greedy response per prompt too
    spec = spec_of(cfg.model)
    actor = role_footprint(cfg, spec, role_model(cfg, "actor"), layout_of(cfg.actor.parallel), 0)
    flash = actor.batch.flash  # the actor's features': a packed row in fused attention
    return Workload(
        actor=spec,
        roles=tuple(r.name for r in role_table(cfg) if r.name in ROLE_MODEL),
        prompts=cfg.data.prompts_per_step,
        samples_per_prompt=n,
        prompt_len=cfg.data.max_prompt_length,
        response_len=cfg.rollout.max_new_tokens,
        generations=(n + 1) / n if greedy else 1.0,
        recompute_old_logp=old_logp_source(cfg) == "recompute",
        ppo_epochs=cfg.actor.ppo_epochs,
        mini_batch_size=cfg.actor.mini_batch_size,
        micro_batch_size=cfg.actor.micro_batch_size,
        dtype_bytes=DTYPE_BYTES[cfg.model.dtype],
        distributed_optimizer=cfg.actor.optim.distributed_optimizer,
        flash_attention=flash,  # as the memory plan has it
    )


def _pool(cfg: RL3DConfig, pool) -> PoolLayout:
    """The pool, and which of its trained roles run sequence parallelism and full recompute: as
    the features their engines build have it (`rl3d.planning.memory_roles.RoleModel.features`)."""
    from rl3d.engine.techniques import Recompute, SequenceParallel
    from rl3d.planning.memory_roles import role_model

    spec = spec_of(cfg.model)
    trained = {r: role_model(cfg, r).features(spec, pool.layout.t) for r in pool.roles if r in TRAINED}
    split = tuple(r for r, features in trained.items() if features.get(SequenceParallel) is not None)
    recompute = tuple(r for r, features in trained.items() if features.get(Recompute) is not None)
    name = pool.name if pool.name == ROLLOUT else pool.roles[0]
    return PoolLayout(name, pool.layout, pool.roles, split, recompute)


def run_layout_of(cfg: RL3DConfig) -> RunLayout:
    pools = tuple(_pool(cfg, p) for p in role_pools(cfg))
    return RunLayout(
        pools=pools,
        t_g=cfg.rollout.t_g,
        p_g=cfg.rollout.p_g,
        max_staleness=cfg.rollout.async_.max_staleness,
    )


def recipe_shapes(cfg: RL3DConfig) -> RecipeShapes:
    """The model, the actor's layout, the generation layout, the dtypes, the actor's LoRA and the
    push to the engine that `rl3d plan RECIPE` plans."""
    return RecipeShapes(
        spec=spec_of(cfg.model),
        train=layout_of(cfg.actor.parallel),
        t_g=cfg.rollout.t_g,
        p_g=cfg.rollout.p_g,
        dtype=cfg.model.dtype,
        engine=(cfg.rollout.engine, cfg.rollout.dtype, cfg.model.dtype),
        lora=getattr(cfg.actor, "lora", None),
        push_bucket_mb=push_bucket_mb(cfg.rollout),
    )
