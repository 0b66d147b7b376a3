"""The role table: which roles a recipe runs, which worker class each is, where it lives and
where it plugs into the RL step.

Both worker-group backends build a run from this one table (`rl3d.controller.assemble`), and
the controller's step walks it, so adding a role is a worker class plus one entry: in
`BUILT_IN_ROLES` for rl3d's own, or under a recipe's `roles:` key for a user's
(`rl3d.config.schema.ExtraRoleConfig`).

A role's stages in a step (`RLTrainer.run_step`):
- `compute`: called on the batch after the actor's old log-probs (reference log-probs, values);
  its output joins the batch;
- `update`: called with the batch once advantages are in (critic updates); its metrics are
  logged;
- `score`: called on every rollout right after the rule reward, before advantages and before
  an algorithm keeps part of a round (learned reward and cost models); returns (batch, metrics).
The actor (generate, old log-probs, update, reshard) and the reward are the loop itself.

Worker classes are named by import path and resolved where a rank builds them, so the config
layer never imports a worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from rl3d.config.schema import ParallelConfig, RL3DConfig

ACTOR = "actor"


@dataclass(frozen=True)
class RoleSpec:
    name: str
    worker: str  # "package.module:Class"; built with (RoleContext, **options)
    key: str  # the config section that places it ("critic", "roles.toy"): errors name it
    enabled: Callable[[RL3DConfig], bool] = lambda cfg: True
    # None: on the actor's ranks, in its layout; else its own pool in this layout
    own_layout: Callable[[RL3DConfig], ParallelConfig | None] = lambda cfg: None
    pool_with: str | None = None  # lives wherever this other role lives
    compute: str | None = None  # method called on the step's batch; output joins it
    compute_stage: str = ""  # timer name (metrics `time/<stage>`)
    update: str | None = None  # method called after the advantages; its metrics are logged
    update_stage: str = ""
    score: str | None = None  # method called on each rollout after the rule reward
    score_stage: str = ""
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


def _own(section: str) -> Callable[[RL3DConfig], ParallelConfig | None]:
    def layout(cfg: RL3DConfig) -> ParallelConfig | None:
        part = getattr(cfg, section)
        return None if part.colocate else part.parallel

    return layout


def _critic(name: str, kind: str, **spec: Any) -> RoleSpec:
    """A value model (`kind`: of the reward or of the cost), computed and updated every step."""
    return RoleSpec(
        name,
        "rl3d.workers.roles:CriticWorker",
        "critic",
        compute="compute_values",
        compute_stage="values",
        update="update_critic",
        update_stage="update_critic",
        options=MappingProxyType({"kind": kind}),
        **spec,
    )


def _learned_model(key: str, kind: str) -> RoleSpec:
    """A learned reward or cost model (`reward.<key>`, rl3d.config.reward_model): scores every
    rollout; colocated on the actor's ranks or in its own pool."""

    def section(cfg: RL3DConfig):
        return getattr(cfg.reward, key)

    return RoleSpec(
        f"{kind}_model",
        "rl3d.workers.reward_model:RewardModelWorker",
        f"reward.{key}",
        enabled=lambda cfg: section(cfg) is not None,
        own_layout=lambda cfg: None if section(cfg).colocate else section(cfg).parallel,
        score="compute_score",
        score_stage=f"{kind}_model",
        options=MappingProxyType({"kind": kind}),
    )


# Table order is pool order (own pools take ranks after the actor's in this order) and the
# order of the compute and update stages.
BUILT_IN_ROLES: tuple[RoleSpec, ...] = (
    RoleSpec(ACTOR, "rl3d.workers.roles:ActorRolloutWorker", ACTOR),
    _critic("critic", "reward", enabled=lambda cfg: cfg.critic_enabled, own_layout=_own("critic")),
    # Safe-RLHF: a second value model, for the cost; it lives with the critic
    _critic(
        "cost_critic", "cost", enabled=lambda cfg: cfg.algorithm.family.needs_cost_critic, pool_with="critic"
    ),
    RoleSpec(
        "reference",
        "rl3d.workers.roles:ReferenceWorker",
        "reference",
        enabled=lambda cfg: cfg.reference_enabled,
        own_layout=_own("reference"),
        compute="compute_ref_log_prob",
        compute_stage="ref_logp",
    ),
    _learned_model("model", "reward"),
    _learned_model("cost_model", "cost"),
    # on-policy distillation's teachers (algorithm.distill): forward only, colocated or own pool
    RoleSpec(
        "teacher",
        "rl3d.workers.teacher:TeacherWorker",
        "algorithm.distill",
        enabled=lambda cfg: cfg.algorithm.family.needs_teacher,
        own_layout=lambda cfg: None if cfg.algorithm.distill.colocate else cfg.algorithm.distill.parallel,
        compute="compute_teacher_log_prob",
        compute_stage="teacher_logp",
    ),
)
BUILT_IN_NAMES = frozenset(r.name for r in BUILT_IN_ROLES) | {"reward"}


def _extra(name: str, cfg: RL3DConfig) -> RoleSpec:
    extra = cfg.roles[name]
    return RoleSpec(
        name,
        extra.worker,
        f"roles.{name}",
        own_layout=lambda c: None if c.roles[name].colocate else c.roles[name].parallel,
        compute=extra.compute,
        compute_stage=name,
        update=extra.update,
        update_stage=f"update_{name}",
        options=MappingProxyType(dict(extra.options)),
    )


def role_table(cfg: RL3DConfig) -> list[RoleSpec]:
    """The roles this recipe runs, in table order: the built-in ones it enables, then its own."""
    table = [r for r in BUILT_IN_ROLES if r.enabled(cfg)]
    return table + [_extra(name, cfg) for name in cfg.roles]


def role_spec(cfg: RL3DConfig, name: str) -> RoleSpec:
    return next(r for r in role_table(cfg) if r.name == name)


def old_logp_source(cfg: RL3DConfig) -> str:
    """Where this step's pi_old log-probs come from (`actor.recompute_old_logp`): "recompute"
    (a forward of the actor before the update), "rollout" (the engine's), or "current": a step
    that makes exactly one optimizer update over its samples updates pi_old itself, so the loss
    uses its own detached log-probs, unless something reads pi_old before the update (KL in the
    reward, or an adaptive KL controller measuring it)."""
    actor, al = cfg.actor, cfg.algorithm
    if actor.recompute_old_logp == "never":
        return "rollout"
    samples = cfg.data.prompts_per_step * cfg.rollout.n
    on_policy = actor.ppo_epochs == 1 and actor.mini_batch_size == samples
    reads_old = (al.kl.coef > 0 and al.kl_apply_to == "reward") or al.kl.controller == "adaptive"
    if actor.recompute_old_logp == "auto" and on_policy and not reads_old:
        return "current"
    return "recompute"
