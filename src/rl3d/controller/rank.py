"""One rank's part of a run: the role workers its pool hosts, and its checkpoint files.

Under torchrun (spmd) every rank runs this; under Ray every rank actor does. The roles come
from the role table (`rl3d.config.roles`): each is built as `Worker(RoleContext, **options)`,
so a new role needs no change here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rl3d.config import RL3DConfig
from rl3d.config.pools import Pool, hosting, role_pools
from rl3d.config.roles import ACTOR, RoleSpec, role_table
from rl3d.data.tokenizer import tokenizer_path

logger = logging.getLogger(__name__)

INIT_WEIGHTS = "init_weights"  # run_dir subfolder: the actor's initial weights, for other pools


def run_tokenizer(cfg: RL3DConfig, spec) -> Any:
    """The run's tokenizer (`tokenizer_path`), the same in every process that needs one."""
    from rl3d.data import load_tokenizer

    return load_tokenizer(tokenizer_path(cfg.data, cfg.model.hf_path), vocab_size=spec.vocab_size)


@dataclass
class RankWorkers:
    """What one rank hosts: its pool, megatron groups, role workers by role name, and the
    checkpointed megatron roles (the trained ones: a worker whose `.role` has an optimizer)."""

    groups: Any  # rl3d.models.bootstrap.MegatronGroups
    pool: Pool
    workers: dict[str, Any] = field(default_factory=dict)
    # an actor rank's end of the weight bridge to a separate rollout pool: (bridge, plan)
    weight_sync: tuple[Any, Any] | None = None

    @property
    def roles(self) -> dict[str, Any]:
        trained = {n: getattr(w, "role", None) for n, w in self.workers.items()}
        out: dict[str, Any] = {}
        for n, r in trained.items():  # a LoRA actor's reference is the actor's own model: once
            if getattr(r, "optimizer", None) is not None and all(r is not o for o in out.values()):
                out[n] = r
        return out


def build_worker(role: RoleSpec, ctx: Any) -> Any:
    """`role.worker(ctx, **role.options)`; a bad class path names the role's config key."""
    from rl3d.utils.imports import import_object

    return import_object(role.worker, what=f"{role.key}.worker")(ctx, **role.options)


def build_rank_workers(
    cfg: RL3DConfig,
    spec,
    groups,
    tokenizer,
    *,
    pools: list[Pool],
    pool: Pool,
    run_dir: Path,
    sync: Callable[[], Any] = lambda: None,
) -> RankWorkers:
    """The role workers of this rank's pool (actor+rollout and the colocated roles, or the
    roles of an own pool), in role-table order.

    Every role starts from the actor's initial network (after its SFT, `actor.warm_start`). A
    colocated one copies it in memory; one in its own pool (another world, maybe another layout)
    loads `model.hf_path` (not after a warm start), else the actor's initial weights, which the
    actor's pool writes to `run_dir/init_weights` before `sync()` (a barrier across pools under
    spmd; under Ray the driver sets the actor's pool up first)."""
    from rl3d.workers.context import RoleContext

    rank = RankWorkers(groups, pool)
    ctx = RoleContext(cfg, spec, groups, tokenizer)
    table = role_table(cfg)
    init_dir = run_dir / INIT_WEIGHTS
    warmed = cfg.actor.warm_start is not None  # the actor's initial weights are its SFT's
    if pool.name == ACTOR:
        actor = rank.workers[ACTOR] = build_worker(table[0], ctx)
        if warmed:
            from rl3d.controller.warm_start import warm_start

            warm_start(actor, cfg, tokenizer, run_dir)
        if len(pools) > 1 and (warmed or not cfg.model.hf_path):
            export_initial_weights(actor.role, init_dir)
        sync()
        ctx = replace(ctx, init_from=actor.role)
    else:
        sync()
        ctx = replace(ctx, init_path=str(init_dir) if warmed else cfg.model.hf_path or str(init_dir))
    for role in table[1:]:
        if role.name in pool.roles:
            rank.workers[role.name] = build_worker(role, ctx)
    if pool.name == ACTOR:  # the engine last: it sizes its memory against what training holds
        others = [
            w.role
            for n, w in rank.workers.items()
            if n != ACTOR and hasattr(getattr(w, "role", None), "to_host")
        ]
        rank.workers[ACTOR].start_engine(others)
    return rank


def export_initial_weights(role, dst: Path) -> None:
    """The actor's weights as a Megatron weight directory any layout loads (collective over the
    actor's world)."""
    from rl3d.models.hf_mapping import hf_config_from_spec
    from rl3d.models.weights import save_weights

    save_weights(role.model, role.spec, role.groups, dst, hf_config=hf_config_from_spec(role.spec).to_dict())
    logger.info("wrote the actor's initial weights to %s for the other pools", dst)


def build_rank(cfg: RL3DConfig, run_dir: str, pool_name: str = "actor") -> RankWorkers:
    """One rank of pool `pool_name` on its pool's initialised torch.distributed world (a Ray
    rank actor)."""
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.spec import spec_of

    spec = spec_of(cfg.model)
    pools = role_pools(cfg)
    pool = hosting(pools, pool_name)  # a pool hosts the role it is named after
    groups = init_megatron(pool.layout, seed=cfg.trainer.seed)
    tokenizer = run_tokenizer(cfg, spec)
    return build_rank_workers(cfg, spec, groups, tokenizer, pools=pools, pool=pool, run_dir=Path(run_dir))


def save_rank_files(rank: RankWorkers, tmp: Path, step: int) -> None:
    """This rank's part of a checkpoint: its trained engines' dist checkpoints (collective) and
    its RNG. The engine's KV cache is freed first (the next generation offloads again)."""
    from rl3d.checkpoint import save_rng_state

    _pause_generation(rank)
    for name, engine in rank.roles.items():
        engine.save(tmp / name, iteration=step)
    save_rng_state(tmp / _rng_file(rank))


def load_rank_files(rank: RankWorkers, path: Path) -> None:
    from rl3d.checkpoint import load_rng_state

    _pause_generation(rank)
    for name, engine in rank.roles.items():
        engine.load(path / name)
    rng = path / _rng_file(rank)
    if not rng.exists() and rank.pool.offset == 0:  # written before pools had names
        rng = path / f"rng_rank{rank.groups.rank}.pt"
    load_rng_state(rng)  # weights_only: tensors and plain values, a damaged file named


def _pause_generation(rank: RankWorkers) -> None:
    actor = rank.workers.get(ACTOR)
    if hasattr(actor, "pause_generation"):
        actor.pause_generation()


def _rng_file(rank: RankWorkers) -> str:
    return f"rng_{rank.pool.name}_rank{rank.groups.rank}.pt"
