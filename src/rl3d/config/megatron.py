"""`<role>.megatron`: megatron-core's fused paths for a trained role (the actor, the critic).

    actor:
      megatron:
        apply_rope_fusion: null             # the rotary embedding in one kernel (Transformer Engine)
        gradient_accumulation_fusion: null  # weight gradients accumulate into DDP's fp32 buffer (apex)
        overlap_grad_reduce: null           # DDP reduces gradient buckets during the backward

`null` (the default) turns each on where the run can take it on CUDA (with the package it needs:
`rl3d.models.fusions`) and off elsewhere, so CPU runs stay as they were; `true` asks for it and
is refused at validation where it cannot run (the two kernel fusions on CPU or without their
package, gradient_accumulation_fusion with `actor.lora`'s frozen base), naming the key;
`overlap_grad_reduce: true` runs on CPU too (gloo). `false` turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class MegatronConfig:
    apply_rope_fusion: bool | None = None
    gradient_accumulation_fusion: bool | None = None
    overlap_grad_reduce: bool | None = None


def check_megatron(cfg, fail) -> None:
    """Refuse a fusion asked for (`true`) where the run cannot take it, naming the key."""
    from rl3d.models.fusions import FUSIONS, missing

    roles = [("actor", cfg.actor, cfg.actor.lora is not None)]
    if cfg.critic_enabled:
        roles.append(("critic", cfg.critic, False))
    for key, section, frozen in roles:
        for name in FUSIONS:
            if getattr(section.megatron, name) is not True:
                continue
            why = missing(name, device_type=cfg.launch.device, frozen_weights=frozen)
            if why:
                raise fail(f"{key}.megatron.{name}", f"true {why}; set it to false or leave it unset (null)")
