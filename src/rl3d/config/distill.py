"""`algorithm.distill`: the teachers of on-policy distillation
(`algorithm.adv_estimator: on_policy_distillation`, `rl3d.algos.distill`).

    algorithm:
      distill:
        teacher: runs/teacher                # an HF directory, a known model's name, an rl3d
                                             # run directory or one of its checkpoints/step_N
        teachers_by_source: {math: /path/b}  # a teacher per data_source; other rows: `teacher`
        coef: 0.0                            # weight of the task reward's GRPO advantage
        colocate: true                       # on the actor's ranks in its layout; false: own pool
        parallel: {tp: 2, pp: 1, dp: 1}      # the own pool's layout (colocated: the actor's)

A teacher shares the student's tokenizer and vocabulary. A run directory is read at its newest
complete checkpoint (the actor's weights, in whatever layout the run saved them), a `step_N`
directory at that step (`rl3d.config.run_dir`); no `rl3d export` is needed. Every teacher runs
forward only, in one layout: the actor's when colocated, `parallel` in its own pool
(`rl3d.config.pools`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl3d.config.errors import FieldError
from rl3d.config.reward_model import RewardModelLayout


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    teacher: str | None = None
    teachers_by_source: dict[str, str] | None = None  # {data_source: teacher directory}
    coef: float = 0.0  # weight of the task reward's GRPO advantage added to the distillation's
    colocate: bool = True  # False: the teachers get their own pool of ranks, in `parallel`
    parallel: RewardModelLayout | None = None  # own pool: required; colocated: must be the actor's

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise FieldError("coef", f"must be >= 0, got {self.coef}")
        if not self.colocate and self.parallel is None:
            raise FieldError("parallel", "teachers in their own pool (colocate: false) need a layout")

    def teacher_for(self, data_source: str | None) -> str | None:
        """The teacher of a row with this `data_source`."""
        return (self.teachers_by_source or {}).get(data_source, self.teacher) if data_source else self.teacher

    def paths(self) -> list[str]:
        """Every distinct teacher directory, `teacher` first."""
        named = [self.teacher, *(self.teachers_by_source or {}).values()]
        return list(dict.fromkeys(p for p in named if p))


def check_distill(algorithm) -> None:
    """A distillation estimator needs a teacher for every row; other estimators take none."""
    distill, needs = algorithm.distill, algorithm.family.needs_teacher
    if needs and distill.teacher is None:
        raise FieldError("distill.teacher", f"adv_estimator {algorithm.adv_estimator!r} needs a teacher")
    if not needs and distill.paths():
        raise FieldError("distill.teacher", f"adv_estimator {algorithm.adv_estimator!r} takes no teacher")


def check_teacher_layout(cfg: Any, fail) -> None:
    """Colocated teachers run in the actor's layout: a different `parallel` is refused."""
    distill, actor = cfg.algorithm.distill, cfg.actor.parallel
    par = distill.parallel
    if distill.colocate and par is not None and (par.tp, par.pp, par.dp) != (actor.tp, actor.pp, actor.dp):
        raise fail(
            "algorithm.distill.parallel",
            f"colocated teachers use the actor's layout tp={actor.tp} pp={actor.pp} dp={actor.dp}, "
            f"got tp={par.tp} pp={par.pp} dp={par.dp} "
            "(or set algorithm.distill.colocate: false for their own pool)",
        )
