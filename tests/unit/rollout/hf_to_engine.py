"""Tiny random HF Qwen3 / Qwen3-MoE / Qwen2-MoE / GLM-4.5 models and their tensors under
megatron's names.

`tiny_hf_model(name)` builds a `transformers` model (fp32, eager attention) with a moderate
random init (weights ~0.15, norms ~1: decisive next-token and router distributions), and
returns it with rl3d's `ModelSpec` of its config and `engine_tensors(spec, model)`: its state dict
mapped to the megatron-core names the torch engine reads (`rl3d.models.params`). `tp_shard` cuts
those into one generation-TP rank's shard. The mapping is a test helper: HF's experts are held
fused in memory (`experts.gate_up_proj` [E, 2 fe, h], `experts.down_proj` [E, h, fe]) or, in a
per-expert checkpoint, as `experts.{e}.{gate,up,down}_proj.weight`; both are read.
"""

from __future__ import annotations

import torch

from rl3d.models import params as P
from rl3d.models.spec import ModelSpec, spec_from_hf_config
from rl3d.ops.layouts import ShardKind, qkv_hf_to_megatron, shard_for_tp

TINY = {  # HF config kwargs; each its own shape quirk
    # head width 32 != hidden / heads = 16; q/k norm; tied embeddings
    "tiny-qwen3": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
    ),
    # 8 experts, top-2 renormalised, no shared expert, q/k norm
    "tiny-qwen3-moe": dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False,
    ),
    # 8 experts, top-2 not renormalised, a gated shared expert, qkv bias
    "tiny-qwen2-moe": dict(
        model_type="qwen2_moe", hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, norm_topk_prob=False, qkv_bias=True,
        tie_word_embeddings=False,
    ),
    # layer 0 dense; a sigmoid router with a correction bias, scaled 2.5; an ungated shared
    # expert; qkv bias, q/k norm; RoPE over 16 of 32 channels (4 layers: a dense one, 3 MoE)
    "tiny-glm4-moe": dict(
        model_type="glm4_moe", hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5,
        first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        partial_rotary_factor=0.5, num_hidden_layers=4, num_nextn_predict_layers=0,
        tie_word_embeddings=False,
    ),
}  # fmt: skip
COMMON = dict(
    num_hidden_layers=2, vocab_size=256, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=512
)


def tiny_hf_model(name: str, seed: int = 0):
    """(spec, HF model, engine tensors) of the tiny model `name` (a key of `TINY`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**COMMON, **TINY[name]}
    config = AutoConfig.for_model(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in pname else 0.15 * noise)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # GLM's router bias: part of the weights
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    spec = spec_from_hf_config(config.to_dict(), name=name)  # rl3d's own reading of the config
    return spec, model, engine_tensors(spec, model)


def engine_tensors(spec: ModelSpec, model) -> dict[str, torch.Tensor]:
    """The HF model's tensors under megatron-core's names (t = 1)."""
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    heads = dict(num_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups)
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(spec.num_layers):
        a, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        att = a + "self_attn."
        out[m + "input_layernorm.weight"] = hf[a + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = qkv_hf_to_megatron(
            *(hf[f"{att}{x}_proj.weight"] for x in "qkv"), **heads
        )
        if spec.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = qkv_hf_to_megatron(
                *(hf[f"{att}{x}_proj.bias"] for x in "qkv"), **heads
            )
        out[m + "self_attention.linear_proj.weight"] = hf[att + "o_proj.weight"]
        if spec.qk_norm:
            out[m + P.Q_NORM] = hf[att + "q_norm.weight"]
            out[m + P.K_NORM] = hf[att + "k_norm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[a + "post_attention_layernorm.weight"]
        mlp = a + "mlp."
        if not spec.is_moe_layer(i):
            out[m + "mlp.linear_fc1.weight"] = _fc1(hf, mlp)
            out[m + "mlp.linear_fc2.weight"] = hf[mlp + "down_proj.weight"]
            continue
        out[m + P.ROUTER] = hf[mlp + "gate.weight"]
        if spec.moe_expert_bias:
            out[m + P.EXPERT_BIAS] = hf[mlp + "gate.e_score_correction_bias"]
        for e in range(spec.num_experts):
            if mlp + "experts.gate_up_proj" in hf:  # fused in memory
                fc1, fc2 = hf[mlp + "experts.gate_up_proj"][e], hf[mlp + "experts.down_proj"][e]
            else:
                fc1, fc2 = _fc1(hf, f"{mlp}experts.{e}."), hf[f"{mlp}experts.{e}.down_proj.weight"]
            out[m + P.EXPERT_FC1.format(e=e)], out[m + P.EXPERT_FC2.format(e=e)] = fc1, fc2
        if spec.shared_expert_ffn_hidden_size and not spec.shared_expert_gate:  # GLM's naming
            out[m + P.SHARED_FC1] = _fc1(hf, mlp + "shared_experts.")
            out[m + P.SHARED_FC2] = hf[mlp + "shared_experts.down_proj.weight"]
        elif spec.shared_expert_ffn_hidden_size:
            out[m + P.SHARED_FC1] = _fc1(hf, mlp + "shared_expert.")
            out[m + P.SHARED_FC2] = hf[mlp + "shared_expert.down_proj.weight"]
            out[m + P.SHARED_GATE] = hf[mlp + "shared_expert_gate.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not spec.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def _fc1(hf: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return torch.cat([hf[prefix + "gate_proj.weight"], hf[prefix + "up_proj.weight"]])


def shard_kind(spec: ModelSpec, name: str) -> ShardKind:
    """How generation TP splits the megatron tensor `name` (the model inventory's kind)."""
    return P.megatron_param_kinds(spec)[name]


def tp_shard(
    spec: ModelSpec, tensors: dict[str, torch.Tensor], tp: int, rank: int
) -> dict[str, torch.Tensor]:
    return {n: shard_for_tp(t, shard_kind(spec, n), tp, rank).clone() for n, t in tensors.items()}
