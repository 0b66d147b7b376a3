"""megatron-core's fused paths a trained role can take (`<role>.megatron`), what each needs, and
whether this host has it (megatron-core 0.16.1):

- `apply_rope_fusion`: the rotary embedding in one kernel; megatron's `rope_utils` takes it from
  Transformer Engine (>= 1.4), for the local and the TE layer spec alike. Needs CUDA and TE.
- `gradient_accumulation_fusion`: the weight-gradient GEMM accumulates straight into DDP's fp32
  `main_grad`. megatron's own linears (the output layer always, every linear of the local spec)
  call apex's `fused_weight_gradient_mlp_cuda`; TE's linears do it themselves. Needs CUDA and
  apex's extension, and every linear's weight trained: a frozen weight (LoRA's base) has no
  `main_grad` and megatron's backward would fail on it.
- `overlap_grad_reduce`: megatron's DDP reduces each bucket of gradients while the backward is
  still running (asynchronous collectives). Needs nothing more: it runs on gloo too, and gives
  the unoverlapped losses bit for bit there (tests/distributed/models/test_models_training_dist.py).

`None` (a recipe's default) turns a fusion on where the run can take it on CUDA and off
elsewhere (a CPU run stays as it was); `true` where it cannot run is refused (`missing`),
naming the setting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FUSIONS = ("apply_rope_fusion", "gradient_accumulation_fusion", "overlap_grad_reduce")
DDP_FUSIONS = ("overlap_grad_reduce",)  # megatron's DistributedDataParallelConfig, not TransformerConfig


def apex_grad_accum_importable() -> bool:
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except Exception:  # a broken extension raises more than ImportError
        return False
    return True


def _te_importable() -> bool:
    from rl3d.models.builder import transformer_engine_importable

    return transformer_engine_importable()


NEEDS: dict[str, tuple[str, Callable[[], bool]] | None] = {
    "apply_rope_fusion": ("Transformer Engine (its fused rotary embedding)", _te_importable),
    "gradient_accumulation_fusion": (
        "apex's fused_weight_gradient_mlp_cuda extension",
        apex_grad_accum_importable,
    ),
    "overlap_grad_reduce": None,  # any device
}


def missing(name: str, *, device_type: str, frozen_weights: bool = False) -> str | None:
    """Why a run on `device_type` cannot take fusion `name` (None: it can). `frozen_weights`:
    the role trains adapters over a frozen base (LoRA)."""
    assert name in FUSIONS, name
    if name == "overlap_grad_reduce":
        return None
    if device_type != "cuda":
        return f"needs CUDA (launch.device is {device_type!r})"
    if name == "gradient_accumulation_fusion" and frozen_weights:
        return "needs every linear's weight trained: LoRA's frozen base has no main_grad to accumulate into"
    need = NEEDS[name]
    if need is not None and not need[1]():
        return f"needs {need[0]}, which does not import here"
    return None


def resolve_fusions(settings: Any, *, device_type: str, frozen_weights: bool = False) -> dict[str, bool]:
    """Each fusion on or off for a role whose `<role>.megatron` section is `settings` (None: all
    defaults): a setting of None is on on CUDA where `missing` finds nothing, off elsewhere;
    `true` where something is missing raises ValueError naming the setting (the recipe check
    refuses it before a run)."""
    out = {}
    for name in FUSIONS:
        asked = getattr(settings, name, None)
        why = (
            missing(name, device_type=device_type, frozen_weights=frozen_weights)
            if asked is not False
            else None
        )
        if asked and why:
            raise ValueError(f"megatron.{name}: true {why}; set it to false or leave it unset")
        out[name] = bool(asked) if asked is not None else (device_type == "cuda" and why is None)
    return out
