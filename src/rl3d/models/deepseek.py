"""DeepSeek-V3's family (`model_type: deepseek_v3`): multi-latent attention (MLA), the
sigmoid router with its correction bias and group-limited routing, shared experts, dense first
layers. Plain dicts and numbers: its config.json fields, its registry shapes, MLA's parameter
count; `rl3d.models.spec` builds the `ModelSpec`s.

MLA (per layer, `n` heads): q = q_b(norm(q_a(x))) ([n, nope + rope] per token; without
`q_lora_rank`, q = q_proj(x)); kv_a(x) = [c, k_rope] with c the `kv_lora_rank` latent and one
`qk_rope_head_dim` rope key shared by every head; kv_b(norm(c)) = per head [k_nope, v]. RoPE
turns q's and the key's rope channels, taken in interleaved pairs (HF's `rope_interleave`, which
megatron's MLA does too). A ModelSpec holds it as `kv_channels` = nope + rope (the q/k width),
`qk_rope_head_dim`, `v_head_dim`, `q_lora_rank` and `kv_lora_rank` (> 0: MLA).
"""

from __future__ import annotations

from typing import Any

from rl3d.models.families import rope_theta_of

# DeepSeek-V3 (published config.json, the main model without its MTP layer): 61 layers, the first
# 3 dense; 256 routed experts in 8 groups (4 chosen per token, 8 experts), one shared expert.
DEEPSEEK_V3 = dict(
    name="deepseek-v3",
    num_layers=61,
    hidden_size=7168,
    ffn_hidden_size=18432,
    num_attention_heads=128,
    num_query_groups=128,
    vocab_size=129280,
    rope_theta=10000.0,
    norm_eps=1e-6,
    max_position_embeddings=4096,  # YaRN's original context; YaRN itself is not built
    kv_channels=192,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_experts=256,
    moe_ffn_hidden_size=2048,
    moe_top_k=8,
    shared_expert_ffn_hidden_size=2048,
    shared_expert_gate=False,
    moe_score_function="sigmoid",
    moe_expert_bias=True,
    moe_routed_scaling=2.5,
    moe_first_dense_layers=3,
    moe_router_groups=8,
    moe_router_group_topk=4,
)

# The same layout at test size: layer 0 dense, 3 MoE layers of 16 experts in 4 groups (2 chosen,
# 4 experts per token), q and kv latents of 32, heads of 16 + 8 rope channels, values of 16.
TINY_DEEPSEEK_V3 = dict(
    DEEPSEEK_V3,
    name="tiny-deepseek-v3",
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=4,
    vocab_size=256,
    max_position_embeddings=512,
    kv_channels=24,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_experts=16,
    moe_ffn_hidden_size=32,
    moe_top_k=4,
    shared_expert_ffn_hidden_size=32,
    moe_first_dense_layers=1,
    moe_router_groups=4,
    moe_router_group_topk=2,
)

REGISTRY_SHAPES = (DEEPSEEK_V3, TINY_DEEPSEEK_V3)


def deepseek_v3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """All ModelSpec fields but the name of a DeepSeek-V3 config.json. Refused by key: FP8
    weights (`quantization_config`), `moe_layer_freq` other than 1, YaRN or any RoPE
    scaling (`rope_scaling`; the published checkpoint uses YaRN, factor 40), q/k/o biases
    (`attention_bias`), `rope_interleave` false, `norm_topk_prob` false, `topk_method` other than
    `noaux_tc`, `scoring_func` other than sigmoid, and a group choice megatron-core 0.16.1 ranks
    differently from HF (HF sums each group's 2 best scores, megatron its top_k / topk_group).

    `num_nextn_predict_layers` (the multi-token-prediction module, `model.layers.{L}`) is read
    past, as GLM-4.5's: HF's DeepseekV3ForCausalLM does not build it, RL samples and trains the
    main model's next token, and rl3d reads none of its tensors."""
    if cfg.get("quantization_config"):
        raise ValueError(
            "deepseek_v3: quantization_config is not supported (the hub's FP8 block-quantized weights "
            "carry *_scale_inv tensors: dequantize to bf16 first)"
        )
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"deepseek_v3: moe_layer_freq {cfg['moe_layer_freq']} is not supported (1 only)")
    rope_theta = rope_theta_of(cfg)  # refuses rope_scaling / rope_parameters other than default
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"deepseek_v3: {key} true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"deepseek_v3: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    if not cfg.get("rope_interleave", True):
        raise ValueError("deepseek_v3: rope_interleave false is not supported (megatron's MLA interleaves)")
    if not cfg.get("norm_topk_prob", True):
        raise ValueError("deepseek_v3: norm_topk_prob false is not supported (megatron renormalises)")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(
            f"deepseek_v3: topk_method {cfg.get('topk_method')!r} / scoring_func {cfg.get('scoring_func')!r}"
            " are not supported (noaux_tc with sigmoid only)"
        )
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    top_k = cfg["num_experts_per_tok"]
    if groups > 1 and top_k != 2 * group_topk:
        raise ValueError(
            f"deepseek_v3: num_experts_per_tok {top_k} with topk_group {group_topk} is not supported "
            "(HF ranks a group by its 2 best experts, megatron by num_experts_per_tok / topk_group)"
        )
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    experts = cfg["n_routed_experts"]
    heads = cfg["num_attention_heads"]
    if (cfg.get("num_key_value_heads") or heads) != heads:
        raise ValueError(f"deepseek_v3: num_key_value_heads {cfg['num_key_value_heads']} != {heads} heads")
    return dict(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=heads,
        vocab_size=cfg["vocab_size"],
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rope_theta=rope_theta,
        kv_channels=nope + rope,
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_rope_head_dim=rope,
        v_head_dim=cfg["v_head_dim"],
        num_experts=experts,
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        moe_top_k=top_k,
        moe_norm_topk_prob=True,
        shared_expert_ffn_hidden_size=cfg["moe_intermediate_size"] * int(cfg.get("n_shared_experts") or 0),
        shared_expert_gate=False,
        moe_score_function="sigmoid",
        moe_expert_bias=True,
        moe_routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)),
        moe_first_dense_layers=int(cfg.get("first_k_dense_replace", 0)),
        moe_router_groups=groups,
        moe_router_group_topk=group_topk if groups > 1 else 1,
    )


def mla_attention_params(spec: Any) -> int:
    """One MLA layer's attention weights: q (low-rank with its norm, or one projection), the kv
    down projection (latent + rope key), its norm, the kv up projection, the output projection,
    and the layer's two norms."""
    h, n, qk = spec.hidden_size, spec.num_attention_heads, spec.head_dim
    r, c, v = spec.q_lora_rank, spec.kv_lora_rank, spec.v_head_dim
    q = (h * r + r + r * n * qk) if r else h * n * qk
    kv = h * (c + spec.qk_rope_head_dim) + c + c * n * (qk - spec.qk_rope_head_dim + v)
    return q + kv + n * v * h + 2 * h


def check_mla(spec: Any) -> None:
    """A ModelSpec's MLA fields agree (`kv_lora_rank` > 0), else a ValueError naming the model."""
    if not spec.kv_lora_rank:
        if spec.q_lora_rank or spec.qk_rope_head_dim or spec.v_head_dim:
            raise ValueError(
                f"model {spec.name}: q_lora_rank / qk_rope_head_dim / v_head_dim need kv_lora_rank"
            )
        return
    if not (
        0 < spec.qk_rope_head_dim < spec.head_dim and spec.qk_rope_head_dim % 2 == 0 and spec.v_head_dim > 0
    ):
        raise ValueError(
            f"model {spec.name}: MLA needs an even qk_rope_head_dim below the q/k head width "
            f"{spec.head_dim} (got {spec.qk_rope_head_dim}) and v_head_dim > 0 (got {spec.v_head_dim})"
        )
    if spec.num_query_groups != spec.num_attention_heads or spec.qkv_bias or spec.qk_norm:
        raise ValueError(f"model {spec.name}: MLA has one key per head, no QKV bias, no q/k norm")
