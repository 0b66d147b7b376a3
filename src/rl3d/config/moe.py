"""`<role>.moe`: how a mixture-of-experts model's routers train (no effect on a dense one).

The losses default to 0: the router is trained by the policy loss alone. megatron-core adds them
inside each MoE layer's backward (`moe_aux_loss_coeff`, `moe_z_loss_coeff`):

- `aux_loss_coef`: the Switch-Transformer load-balancing loss, coef * E * sum_e f_e p_e over a
  micro-batch's tokens (f_e: the share routed to expert e, p_e: its mean router probability).
- `z_loss_coef`: coef * mean(logsumexp(router logits)^2), which keeps the logits small.
- `expert_bias_update_rate`: auxiliary-loss-free balancing of a sigmoid router with an expert
  bias (GLM-4.5): after each optimizer step megatron moves every expert's bias by
  +rate where it got fewer than the mean tokens of the step, -rate where more
  (`moe_router_bias_update_rate`, token counts summed over the data-parallel and TP ranks).
  0 (the default, as slime's GLM-4.5 recipes) keeps the published bias: the routing the rollout
  engine and the trainer compute stays the one the weights were post-trained with.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl3d.config.errors import FieldError


@dataclass(frozen=True, kw_only=True)
class MoeConfig:
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    expert_bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("aux_loss_coef", "z_loss_coef", "expert_bias_update_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise FieldError(name, f"must be a number >= 0, got {value!r}")

    def transformer_overrides(self) -> dict[str, float]:
        """megatron TransformerConfig fields (none when both are 0: today's router)."""
        out = {}
        if self.aux_loss_coef:
            out["moe_aux_loss_coeff"] = float(self.aux_loss_coef)
        if self.z_loss_coef:
            out["moe_z_loss_coeff"] = float(self.z_loss_coef)
        if self.expert_bias_update_rate:
            out["moe_router_bias_update_rate"] = float(self.expert_bias_update_rate)
        return out
