"""`<role>.parallel`: a role's training layout (rl3d.parallel.ParallelLayout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rl3d.config.errors import FieldError


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    # Expert parallelism (a mixture of experts): each layer's experts split over ep of the dp
    # ranks (rl3d.parallel.layout); must divide dp and the number of experts.
    ep: int = 1
    # Megatron's sequence parallelism at tp > 1 (rl3d.models.sequence_parallel): auto = on for a
    # mixture of experts (megatron trains one at tp > 1 only so), off for a dense model.
    sequence_parallel: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            if getattr(self, name) <= 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")
        if self.dp % self.ep:
            raise FieldError(
                "ep", f"ep={self.ep} must divide dp={self.dp} (experts split over data-parallel ranks)"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp
