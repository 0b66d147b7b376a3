"""`<role>.parallel.cp`: what context parallelism runs with, refused by key where it does not.

Each sequence of a role at cp > 1 is split over its cp ranks (`rl3d.engine.micro_batches`); the
settings below would read or cut the sequence another way and are not built under it: packed
sequences, and a mixture of experts (its routing record and load counts are per whole sequence).
"""

from __future__ import annotations

from typing import Any

from rl3d.config.schema import RL3DConfig


def _cp_sections(cfg: RL3DConfig) -> list[tuple[str, Any, Any]]:
    """(key, section, parallel) of each role that runs a model, with the layout it runs in (a
    colocated role: the actor's)."""
    from rl3d.config.reward_model import reward_model_sections

    actor = cfg.actor.parallel
    out = [("actor", cfg.actor, actor)]
    if cfg.critic_enabled:
        out.append(("critic", cfg.critic, actor if cfg.critic.colocate else cfg.critic.parallel))
    if cfg.reference_enabled:
        ref = cfg.reference.batching_of(cfg.actor)
        out.append(("reference", ref, actor if cfg.reference.colocate else cfg.reference.parallel))
    for key, section in reward_model_sections(cfg.reward):
        out.append((key, section, actor if section.colocate else section.parallel))
    return out


def check_context_parallel(cfg: RL3DConfig, fail) -> None:
    from rl3d.models.spec import spec_of

    for key, section, par in _cp_sections(cfg):
        if par is None or par.cp == 1:
            continue
        where = f"{key}'s layout has cp={par.cp}"
        colocated = par is cfg.actor.parallel and key != "actor"
        if spec_of(cfg.model).is_moe:
            raise fail(
                "actor.parallel.cp" if colocated else f"{key}.parallel.cp",
                f"cp={par.cp}: a mixture of experts under context parallelism is not built; use cp 1",
            )
        if getattr(section, "packing", False):
            raise fail(
                f"{key}.packing",
                f"true: {where}, and packed sequences under context parallelism are not built "
                "(megatron's THD split per sequence); set packing: false or cp 1",
            )
