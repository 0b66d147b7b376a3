"""Learned reward and cost models: their place in an RL recipe, and the job that trains them.

In an RL recipe (`reward.model`, `reward.cost_model`, fields of `RewardConfig`):

    reward:
      fn: parity_repeat            # the rule reward: logged as reward/rule_mean, weighted below
      model:
        path: runs/quickstart_cpu_rm     # an `rl3d train` reward-model run, a step, or its weights
        colocate: true                   # on the actor's ranks in its layout; false: own pool
        parallel: {tp: 1, pp: 1, dp: 2}  # the own pool's layout (colocated: the actor's, if set)
        micro_batch_size: 8
        weight: 1.0                      # score = rule_weight * rule + weight * model
        rule_weight: 0.0
        packing: false                   # true: packed without pads (max_tokens_per_micro_batch)

`reward.cost_model` takes the same keys: cost = rule_weight * reward.cost_fn's cost (0 without
one) + weight * the model's cost. Both are scored right after generation, before advantages and
before DAPO's filter (`rl3d.workers.reward_model.RewardModelWorker`).

A reward-model training recipe is a different job: a top-level `job: reward_model` makes
`rl3d train` / `rl3d validate` read it as an `rl3d.config.rm_job.RMJobConfig`
(`rl3d.controller.rm_train`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl3d.config.errors import FieldError

RM_WEIGHTS = "reward_model"  # a checkpoint step's subdirectory holding the model's weights


@dataclass(frozen=True, kw_only=True)
class RewardModelLayout:
    """A learned model's own pool layout (as `ParallelConfig`, which this module cannot import:
    the schema's `RewardConfig` imports this module)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallelism, as `<role>.parallel.cp`

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp"):
            if getattr(self, name) <= 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """A learned scalar model scoring whole responses in the RL loop (`reward.model`,
    `reward.cost_model`)."""

    path: str  # an RM run directory (newest step), a step_N directory, or its weight directory
    colocate: bool = True
    parallel: RewardModelLayout | None = None  # own pool: required; colocated: must be the actor's
    micro_batch_size: int = 8  # sequences per forward on one DP rank
    weight: float = 1.0  # of the model's output in the score (cost)
    rule_weight: float = 1.0  # of the rule reward.fn (cost_fn) in the score (cost)
    packing: bool = False  # sequences packed without pads, as `actor.packing`
    max_tokens_per_micro_batch: int | None = None  # token budget per packed micro-batch

    def __post_init__(self) -> None:
        if not self.path:
            raise FieldError("path", "must name a reward-model checkpoint")
        if self.micro_batch_size <= 0:
            raise FieldError("micro_batch_size", f"must be > 0, got {self.micro_batch_size}")
        if self.max_tokens_per_micro_batch is not None and not self.packing:
            raise FieldError("max_tokens_per_micro_batch", "needs packing: true")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch <= 0:
            raise FieldError(
                "max_tokens_per_micro_batch", f"must be > 0, got {self.max_tokens_per_micro_batch}"
            )
        if not self.colocate and self.parallel is None:
            raise FieldError("parallel", "a reward model in its own pool (colocate: false) needs a layout")


def reward_model_sections(reward_cfg: Any) -> list[tuple[str, RewardModelConfig]]:
    """(config key, section) of the learned models a recipe uses, reward first."""
    pairs = (("reward.model", reward_cfg.model), ("reward.cost_model", reward_cfg.cost_model))
    return [(key, section) for key, section in pairs if section is not None]


def check_reward_models(cfg: Any, fail) -> None:
    """A colocated model runs in the actor's layout: a different `parallel` is refused."""
    actor = cfg.actor.parallel
    for key, section in reward_model_sections(cfg.reward):
        par = section.parallel
        if (
            section.colocate
            and par is not None
            and (par.tp, par.pp, par.dp, par.cp) != (actor.tp, actor.pp, actor.dp, actor.cp)
        ):
            raise fail(
                f"{key}.parallel",
                f"a colocated model uses the actor's layout tp={actor.tp} pp={actor.pp} dp={actor.dp} "
                f"cp={actor.cp}, got tp={par.tp} pp={par.pp} dp={par.dp} cp={par.cp} "
                f"(or set {key}.colocate: false for its own pool)",
            )


def resolve_weights_dir(path: str | Path) -> Path:
    """The weight directory a `reward.model.path` names: a run directory (its newest complete
    checkpoint), a `step_N` directory, or the weight directory itself. FileNotFoundError says
    what is missing."""
    from rl3d.models.convert import META_NAME

    path = Path(path)
    if (path / META_NAME).is_file():
        return path
    if (path / RM_WEIGHTS / META_NAME).is_file():
        return path / RM_WEIGHTS
    # a run directory: its newest complete checkpoint (rl3d.checkpoint.CheckpointManager's names:
    # step_N, renamed into place only once whole)
    steps = [p for p in (path / "checkpoints").glob("step_*") if p.name[5:].isdigit()]
    if steps:
        newest = max(steps, key=lambda p: int(p.name[5:]))
        if (newest / RM_WEIGHTS / META_NAME).is_file():
            return newest / RM_WEIGHTS
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no such file or directory (train one with `rl3d train` on an RM recipe)"
        )
    raise FileNotFoundError(
        f"{path}: no reward-model weights ({RM_WEIGHTS}/{META_NAME}, or checkpoints/step_N/{RM_WEIGHTS})"
    )


def preflight_reward_models(cfg: Any, fail, *, absent_ok: bool = False) -> None:
    """At launch (`rl3d.launch.preflight`): each model's checkpoint is there, its vocabulary is
    the run's, and its layout fits the model it holds (tp | KV heads, pp | layers)."""
    from rl3d.models.convert import McoreMeta
    from rl3d.models.spec import spec_of

    run_spec = spec_of(cfg.model)
    for key, section in reward_model_sections(cfg.reward):
        if absent_ok and not Path(section.path).exists():
            continue
        try:
            spec = McoreMeta.read(resolve_weights_dir(section.path)).spec
        except (FileNotFoundError, ValueError) as err:
            raise fail(f"{key}.path", str(err)) from None
        if spec.vocab_size != run_spec.vocab_size:
            raise fail(
                f"{key}.path",
                f"the model's vocabulary ({spec.vocab_size} ids) is not the run's ({run_spec.vocab_size}): "
                "a reward model must read the policy's tokens",
            )
        par = cfg.actor.parallel if section.colocate else section.parallel
        where = "actor.parallel" if section.colocate else f"{key}.parallel"
        if spec.num_query_groups % par.tp:
            raise fail(
                f"{where}.tp", f"tp={par.tp} must divide the {key} model's {spec.num_query_groups} KV heads"
            )
        if spec.num_layers % par.pp:
            raise fail(f"{where}.pp", f"pp={par.pp} must divide the {key} model's {spec.num_layers} layers")
