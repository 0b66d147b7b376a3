"""HF <-> Megatron parameter mapping for Llama, Qwen2, Mistral, Qwen3, Qwen3-MoE, Qwen2-MoE,
GLM-4.5 and DeepSeek-V3 (plain torch, per tensor).

Each `TensorMap` ties one global Megatron parameter (t=1, p=1, vocab padded) to the HF tensors
it is made of, with the two conversions. Nothing here needs process groups or megatron-core;
the converter streams checkpoints through these maps one parameter at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rl3d.models.params import megatron_params
from rl3d.models.spec import (  # noqa: F401  (re-exported: the HF config side of the mapping)
    SUPPORTED_MODEL_TYPES,
    ModelSpec,
    hf_model_type,
    spec_from_hf_config,
)
from rl3d.ops.layouts import (
    ShardKind,
    fc1_hf_to_megatron,
    fc1_megatron_to_hf,
    qkv_hf_to_megatron,
    qkv_megatron_to_hf,
)


@dataclass(frozen=True)
class TensorMap:
    """One Megatron parameter and the HF tensors it is built from."""

    mcore: str
    hf: tuple[str, ...]
    kind: ShardKind
    shape: tuple[int, ...]  # the full (t=1) Megatron tensor's, vocab padded
    to_mcore: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]


def hf_config_from_spec(spec: ModelSpec, **extra: Any) -> Any:
    """A `transformers` config of `spec`'s family (`hf_model_type`): LlamaConfig, Qwen2Config,
    Qwen3Config, Qwen3MoeConfig, Qwen2MoeConfig, Glm4MoeConfig or DeepseekV3Config (without the
    MTP layer, which rl3d does not hold)."""
    from transformers import (
        DeepseekV3Config,
        Glm4MoeConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups,
        rms_norm_eps=spec.norm_eps,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tied_embeddings,
        rope_theta=spec.rope_theta,
    )
    model_type = hf_model_type(spec)
    if spec.qk_norm:
        common.update(head_dim=spec.head_dim, attention_bias=False)
    if spec.is_moe:
        common.update(
            num_experts=spec.num_experts,
            moe_intermediate_size=spec.moe_ffn_hidden_size,
            num_experts_per_tok=spec.moe_top_k,
            norm_topk_prob=spec.moe_norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if model_type == "qwen2_moe":
        common.update(shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size)
    if model_type == "glm4_moe":
        shared, rest = divmod(spec.shared_expert_ffn_hidden_size, spec.moe_ffn_hidden_size)
        assert not rest, "GLM's shared experts are whole multiples of a routed expert's width"
        for key in ("num_experts", "decoder_sparse_step", "mlp_only_layers"):
            common.pop(key)
        common.update(
            head_dim=spec.head_dim,
            attention_bias=spec.qkv_bias,
            use_qk_norm=spec.qk_norm,
            n_routed_experts=spec.num_experts,
            n_shared_experts=shared,
            routed_scaling_factor=spec.moe_routed_scaling,
            first_k_dense_replace=spec.moe_first_dense_layers,
            n_group=1,
            topk_group=1,
            partial_rotary_factor=spec.rotary_fraction,
            num_nextn_predict_layers=0,
        )
    if model_type == "deepseek_v3":
        for key in ("num_experts", "decoder_sparse_step", "mlp_only_layers"):
            common.pop(key)
        common.update(deepseek_v3_config(spec))
    common.update(extra)
    configs = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "qwen3_moe": Qwen3MoeConfig,
        "qwen2_moe": Qwen2MoeConfig,
        "glm4_moe": Glm4MoeConfig,
        "deepseek_v3": DeepseekV3Config,
    }
    return configs[model_type](**common)


def deepseek_v3_config(spec: ModelSpec) -> dict[str, Any]:
    """DeepseekV3Config's fields of an MLA spec (plain RoPE, interleaved rope channels)."""
    shared, rest = divmod(spec.shared_expert_ffn_hidden_size, spec.moe_ffn_hidden_size)
    assert not rest, "DeepSeek's shared experts are whole multiples of a routed expert's width"
    return dict(
        num_key_value_heads=spec.num_attention_heads,
        q_lora_rank=spec.q_lora_rank or None,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.head_dim - spec.qk_rope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        rope_interleave=True,
        attention_bias=False,
        n_routed_experts=spec.num_experts,
        moe_intermediate_size=spec.moe_ffn_hidden_size,
        num_experts_per_tok=spec.moe_top_k,
        norm_topk_prob=True,
        n_shared_experts=shared,
        routed_scaling_factor=spec.moe_routed_scaling,
        first_k_dense_replace=spec.moe_first_dense_layers,
        n_group=spec.moe_router_groups,
        topk_group=spec.moe_router_group_topk,
        num_nextn_predict_layers=0,
    )


def _pad_rows(padded: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def pad(tensors: list[torch.Tensor]) -> torch.Tensor:
        (t,) = tensors
        if t.shape[0] == padded:
            return t
        # Padded vocab rows are zero; log-probs mask them (see logprobs.py), so they never matter.
        out = t.new_zeros(padded, *t.shape[1:])
        out[: t.shape[0]] = t
        return out

    return pad


def _unpad_rows(vocab: int) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    return lambda t: [t[:vocab]]


def _one(tensors: list[torch.Tensor]) -> torch.Tensor:
    (t,) = tensors
    return t


def _same(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def tensor_maps(spec: ModelSpec, padded_vocab: int) -> list[TensorMap]:
    """The maps of every global Megatron parameter of `spec`, in Megatron's parameter order; the
    names, shapes and HF tensors are the parameter inventory's (`rl3d.models.params`)."""
    nh, ng = spec.num_attention_heads, spec.num_query_groups

    def qkv_to_mcore(tensors: list[torch.Tensor]) -> torch.Tensor:
        return qkv_hf_to_megatron(*tensors, num_heads=nh, num_query_groups=ng)

    def qkv_to_hf(t: torch.Tensor) -> list[torch.Tensor]:
        return list(qkv_megatron_to_hf(t, num_heads=nh, num_query_groups=ng))

    conversions = {  # by shard kind; the others are one HF tensor as it is
        ShardKind.QKV: (qkv_to_mcore, qkv_to_hf),
        ShardKind.SWIGLU_FC1: (lambda ts: fc1_hf_to_megatron(*ts), lambda t: list(fc1_megatron_to_hf(t))),
        ShardKind.VOCAB: (_pad_rows(padded_vocab), _unpad_rows(spec.vocab_size)),
    }
    maps = []
    for param in megatron_params(spec, padded_vocab=padded_vocab):
        to_mcore, to_hf = conversions.get(param.kind, (_one, _same))
        maps.append(TensorMap(param.name, param.hf, param.kind, param.shape, to_mcore, to_hf))
    return maps
