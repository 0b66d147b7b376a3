"""The `rollout.sglang` section: the SGLang engine's memory, weight push and inference options
(rl3d.rollout.sglang_engine reads them; docs/gpu.md#the-sglang-path)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rl3d.config.errors import FieldError


@dataclass(frozen=True, kw_only=True)
class SGLangConfig:
    mem_fraction_static: float = 0.6
    enable_memory_saver: bool = True
    weight_update: Literal["tensor", "distributed"] = "tensor"  # CUDA IPC; "distributed": refused
    bucket_mb: float = 512.0  # the push's buckets, planned with the transition (engine_push)
    deterministic: bool = False  # SGLang's deterministic inference: honours seeds, decodes slower
    base_gpu_id: int | None = None  # None: the rank's own GPU
    # The KV pool in tokens per rank (SGLang's max_total_tokens, a cap under mem_fraction_static's
    # sizing). "plan": what the memory plan leaves on the device in the generate phase, resolved
    # by `rl3d train` on a CUDA host into an integer in resolved_config.yaml; None: SGLang's own.
    max_total_tokens: int | Literal["plan"] | None = "plan"

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise FieldError("bucket_mb", f"must be > 0, got {self.bucket_mb}")
        if self.weight_update == "distributed":
            raise FieldError(
                "weight_update",
                "'distributed' is not supported yet (nothing connects SGLang's weight-update group); "
                "use 'tensor' (CUDA IPC, the colocated engine)",
            )
        if isinstance(self.max_total_tokens, int) and self.max_total_tokens <= 0:
            raise FieldError("max_total_tokens", f"must be > 0, 'plan' or null, got {self.max_total_tokens}")
        if not 0 < self.mem_fraction_static < 1:
            raise FieldError("mem_fraction_static", f"must be in (0, 1), got {self.mem_fraction_static}")
