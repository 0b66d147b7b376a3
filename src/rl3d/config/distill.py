"""`algorithm.distill`: the teachers of on-policy distillation
(`algorithm.adv_estimator: on_policy_distillation`, `rl3d.algos.distill`).

`teacher` is an HF directory (or a known model's name, `rl3d.models.hub`) sharing the student's
tokenizer and vocabulary; a run's checkpoint becomes one with `rl3d export`. `teachers_by_source`
picks a teacher per row by its `data_source` column; rows of other sources use `teacher`. The
teachers run colocated on the actor's ranks, forward only, in the actor's layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl3d.config.errors import FieldError


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    teacher: str | None = None
    teachers_by_source: dict[str, str] | None = None  # {data_source: teacher directory}
    coef: float = 0.0  # weight of the task reward's GRPO advantage added to the distillation's

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise FieldError("coef", f"must be >= 0, got {self.coef}")

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
