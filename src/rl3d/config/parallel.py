"""`<role>.parallel`: a role's training layout (rl3d.parallel.ParallelLayout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rl3d.config.errors import FieldError
from rl3d.parallel.layout import EP1_DRIFT


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    # Expert parallelism (a mixture of experts): each layer's experts split over ep of the dp
    # ranks (rl3d.parallel.layout); must divide dp and the number of experts.
    ep: int = 1
    # Expert tensor parallelism: each expert's fc1/fc2 split over etp ranks (null: tp, megatron's
    # default); must divide tp, and ep x etp must divide tp x dp (rl3d.parallel.layout).
    etp: int | None = None
    # Megatron's sequence parallelism at tp > 1 (rl3d.models.sequence_parallel): auto = on for a
    # mixture of experts (megatron trains one at tp > 1 only so), off for a dense model.
    sequence_parallel: bool | Literal["auto"] = "auto"
    # Context parallelism: each sequence split over cp ranks (megatron's load-balanced 2*cp
    # chunks; attention by ring over them without Transformer Engine: rl3d.models.ring_attention).
    # The cp ranks get the same samples: tp * pp * cp * dp ranks in all (docs/long_context.md).
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "cp"):
            if getattr(self, name) <= 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")
        if self.cp > 1 and (self.ep > 1 or self.etp not in (None, self.tp)):
            raise FieldError(
                "cp", f"cp={self.cp} with experts split (ep={self.ep}, etp={self.etp}) is not built; use cp 1"
            )
        if self.etp is None or self.etp == self.tp:
            if self.dp % self.ep:
                raise FieldError(
                    "ep", f"ep={self.ep} must divide dp={self.dp} (experts split over data-parallel ranks)"
                )
            return
        if self.etp <= 0:
            raise FieldError("etp", f"must be > 0, got {self.etp}")
        if self.ep == 1:
            raise FieldError("etp", f"etp={self.etp} apart from tp={self.tp} needs ep > 1: {EP1_DRIFT}")
        if self.tp % self.etp:
            raise FieldError(
                "etp", f"etp={self.etp} must divide tp={self.tp} (an expert's shards stay in one TP group)"
            )
        if (self.tp * self.dp) % (self.ep * self.etp):
            raise FieldError(
                "etp",
                f"ep x etp = {self.ep} x {self.etp} must divide tp x dp = {self.tp} x {self.dp} "
                "(megatron splits each stage's ranks into etp x ep x expert-dp)",
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp
