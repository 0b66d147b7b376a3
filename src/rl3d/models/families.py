"""What each HF `model_type` rl3d reads adds to Llama's layout: the config.json fields of its
family (plain dicts in and out; `rl3d.models.spec.spec_from_hf_config` builds the `ModelSpec`),
and the model_type a spec's layout is (`hf_model_type`). A new family's config reading goes here."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

# Llama's tensor layout, plus q/k norm (qwen3, qwen3_moe) and mixture-of-experts MLPs (*_moe);
# DeepSeek-V3's multi-latent attention.
SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen2",
    "mistral",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "glm4_moe",
    "deepseek_v3",  # rl3d.models.deepseek
)
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")


def hf_model_type(spec: Any) -> str:
    """The HF model_type whose tensor layout and forward pass `spec` (a `ModelSpec`) is."""
    if spec.is_mla:
        return "deepseek_v3"
    if spec.moe_score_function == "sigmoid":
        return "glm4_moe"
    if spec.is_moe:
        return "qwen3_moe" if spec.qk_norm else "qwen2_moe"
    if spec.qk_norm:
        return "qwen3"
    return "qwen2" if spec.qkv_bias else "llama"


def rotary_fraction_of(cfg: dict[str, Any]) -> float:
    rope = cfg.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))


def rope_theta_of(cfg: dict[str, Any]) -> float:
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported (only 'default' RoPE)")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def moe_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a *_moe config: every layer sparse, a softmax top-k router."""
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"{model_type}: decoder_sparse_step {cfg['decoder_sparse_step']} is not supported "
            "(every layer must be a mixture of experts: 1)"
        )
    if cfg.get("mlp_only_layers"):
        raise ValueError(
            f"{model_type}: mlp_only_layers {cfg['mlp_only_layers']} is not supported "
            "(every layer must be a mixture of experts: [])"
        )
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not num_experts:
        raise ValueError(f"{model_type}: num_experts is missing")
    shared = cfg.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    return dict(
        num_experts=num_experts,
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        moe_top_k=cfg["num_experts_per_tok"],
        moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_ffn_hidden_size=shared or 0,
    )


def glm4_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's fields: sigmoid router with e_score_correction_bias, ungated shared experts,
    dense first layers, QKV bias, optional q/k norm, partial RoPE. Refused by key: grouped
    routing (n_group > 1) and sigmoid weights left unnormalised (norm_topk_prob false), which
    megatron-core 0.16.1's router does not compute as HF does.

    `num_nextn_predict_layers` (GLM's multi-token-prediction layer, `model.layers.{L}`) is read
    past, not refused: it serves speculative decoding only, HF's Glm4MoeForCausalLM does not
    build it either, and RL trains and samples the main model's next token. rl3d reads none of
    its tensors and writes none back (an export's config.json keeps the source's value)."""
    if cfg.get("n_group", 1) != 1 or cfg.get("topk_group", 1) != 1:
        raise ValueError(
            f"glm4_moe: n_group {cfg.get('n_group')} / topk_group {cfg.get('topk_group')} are not "
            "supported (grouped routing; GLM-4.5 and GLM-4.5-Air use 1 and 1)"
        )
    if not cfg.get("norm_topk_prob", True):
        raise ValueError(
            "glm4_moe: norm_topk_prob false is not supported (megatron-core renormalises a "
            "sigmoid router's top-k weights)"
        )
    return dict(
        num_experts=cfg.get("n_routed_experts") or cfg.get("num_local_experts"),
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        moe_top_k=cfg["num_experts_per_tok"],
        moe_norm_topk_prob=True,
        shared_expert_ffn_hidden_size=cfg["moe_intermediate_size"] * int(cfg.get("n_shared_experts", 1)),
        shared_expert_gate=False,
        moe_score_function="sigmoid",
        moe_expert_bias=True,
        moe_routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)),
        moe_first_dense_layers=int(cfg.get("first_k_dense_replace", 1)),
        rotary_fraction=rotary_fraction_of(cfg),
    )


def scaled_spec(base: Any, k: int, name: str) -> Any:
    """`base` (a ModelSpec) with hidden, ffn (the experts' too) and vocab divided by `k`, layers and the GQA
    ratio kept (heads dropped until they divide the hidden size)."""
    if k < 1 or base.hidden_size % k or base.ffn_hidden_size % k:
        raise ValueError(f"model {name!r}: 1/{k} does not divide hidden and ffn of {base.name}")
    hidden, heads = base.hidden_size // k, base.num_attention_heads
    while hidden % heads:
        heads //= 2
    widths = ("moe_ffn_hidden_size", "shared_expert_ffn_hidden_size")
    experts = {key: max(1, getattr(base, key) // k) for key in widths if getattr(base, key)}
    return replace(
        base,
        name=name,
        hidden_size=hidden,
        ffn_hidden_size=base.ffn_hidden_size // k,
        **experts,
        vocab_size=max(1, base.vocab_size // k),
        num_attention_heads=heads,
        num_query_groups=max(1, base.num_query_groups * heads // base.num_attention_heads),
    )
