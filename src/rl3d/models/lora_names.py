"""The names LoRA adapters go by (pure Python): the HF projections users target, the megatron
linear each lives in, and the keys and config of a PEFT adapter directory.

A megatron decoder layer fuses q/k/v into `linear_qkv` (interleaved per query group) and
gate/up into `linear_fc1`; each HF projection keeps its own pair of factors, so an adapter on
`q_proj` alone changes only q's rows. Across every boundary (export, import, the transition to
a rollout engine) adapters are full (t=1) tensors under PEFT's saved keys for the HF model:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

The output layer can be adapted too (`lm_head`, as PEFT names it; not part of `all-linear`, as
in PEFT): `base_model.model.lm_head.lora_A.weight` [r, h] and `...lora_B.weight` [vocab, r].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALL_LINEAR = "all-linear"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraTarget:
    name: str  # the HF projection: q_proj, ...
    hf_module: str  # after "model.layers.{i}."
    linear: str  # the megatron linear it lives in, after "decoder.layers.{i}."
    row_parallel: bool  # input split over TP (o_proj, down_proj); else output split


_ATTN, _MLP = "self_attention.", "mlp."
TARGETS = {
    t.name: t
    for t in (
        LoraTarget("q_proj", "self_attn.q_proj", _ATTN + "linear_qkv", False),
        LoraTarget("k_proj", "self_attn.k_proj", _ATTN + "linear_qkv", False),
        LoraTarget("v_proj", "self_attn.v_proj", _ATTN + "linear_qkv", False),
        LoraTarget("o_proj", "self_attn.o_proj", _ATTN + "linear_proj", True),
        LoraTarget("gate_proj", "mlp.gate_proj", _MLP + "linear_fc1", False),
        LoraTarget("up_proj", "mlp.up_proj", _MLP + "linear_fc1", False),
        LoraTarget("down_proj", "mlp.down_proj", _MLP + "linear_fc2", True),
    )
}
LORA_TARGETS = tuple(TARGETS)  # a decoder layer's forward order
LM_HEAD = "lm_head"  # the output layer (megatron's vocab-parallel output_layer), untied only
# The HF projections fused in each megatron linear, in the fused tensor's order.
FUSED = {
    _ATTN + "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    _ATTN + "linear_proj": ("o_proj",),
    _MLP + "linear_fc1": ("gate_proj", "up_proj"),
    _MLP + "linear_fc2": ("down_proj",),
}


def resolve_targets(target_modules: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`all-linear` or a list of HF projection names -> the adapted names in forward order."""
    if ALL_LINEAR in target_modules:
        return LORA_TARGETS
    return tuple(t for t in LORA_TARGETS if t in target_modules)


def peft_key(layer: int | None, target: str, factor: str) -> str:
    """PEFT's saved key of one factor ("A" or "B") of `target` in HF decoder layer `layer`
    (of the output layer for `target` lm_head, whatever `layer`)."""
    if target == LM_HEAD:
        return f"{PEFT_PREFIX}{LM_HEAD}.lora_{factor}.weight"
    return f"{PEFT_PREFIX}model.layers.{layer}.{TARGETS[target].hf_module}.lora_{factor}.weight"


def adapter_config(
    *, rank: int, alpha: float, targets: tuple[str, ...], dropout: float, use_rslora: bool, base: str | None
) -> dict[str, Any]:
    """The adapter_config.json PEFT writes for a LoRA adapter on a causal LM (`targets` may
    end with lm_head)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": list(targets),
        "use_rslora": use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def scaling_of(rank: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's scale of B @ A: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / (rank**0.5 if use_rslora else rank)
