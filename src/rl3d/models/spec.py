"""Model shape specs (pure Python): the numbers every other part of rl3d plans from.

Published shapes come from shared/MODELS.md. `get_model_spec` also accepts
scaled-down shapes such as `llama2-70b-shape-1/64`, which keep a model's layer proportions
(hidden, ffn and vocab divided by 64; layers and head counts kept) for measured benchmarks.

A run's spec is `spec_of(cfg.model)`: the registry's for `model.name`, or the shapes in
`model.hf_path`'s config.json when the name is unset (a user's own Llama, Qwen2, Mistral, Qwen3,
Qwen3-MoE, Qwen2-MoE, GLM-4.5 or DeepSeek-V3); with both, they must agree.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from rl3d.models.deepseek import REGISTRY_SHAPES, check_mla, deepseek_v3_fields, mla_attention_params
from rl3d.models.families import (  # noqa: F401  (SUPPORTED_MODEL_TYPES, hf_model_type: re-exported)
    QK_NORM_TYPES,
    QKV_BIAS_TYPES,
    SUPPORTED_MODEL_TYPES,
    glm4_moe_fields,
    hf_model_type,
    moe_fields,
    rope_theta_of,
    scaled_spec,
)
from rl3d.utils.imports import suggest


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama/Qwen-family decoder (RMSNorm, SwiGLU, RoPE, GQA), dense or a mixture of
    experts.

    A mixture of experts (`num_experts > 0`) replaces every layer's MLP with `num_experts` SwiGLU
    experts of width `moe_ffn_hidden_size`, a softmax router choosing `moe_top_k` per token
    (renormalised to sum 1 when `moe_norm_topk_prob`), and, when
    `shared_expert_ffn_hidden_size > 0`, one always-on expert scaled by a sigmoid gate
    (Qwen2-MoE) or, without `shared_expert_gate`, added as it is (GLM-4.5).
    `ffn_hidden_size` is the width of the dense MLP of the first `moe_first_dense_layers`
    layers (GLM-4.5's `first_k_dense_replace`), else unused.

    GLM-4.5's router (`moe_score_function="sigmoid"`): per expert sigmoid(logit); the top k by
    sigmoid + `e_score_correction_bias` (`moe_expert_bias`: a per-layer [E] vector balanced
    without an auxiliary loss, not trained by gradients); their sigmoids renormalised to sum 1,
    times `moe_routed_scaling`. RoPE turns the first `rotary_fraction` of each head's width.
    DeepSeek-V3's adds group-limited routing: experts in `moe_router_groups` groups, the top k
    taken from the `moe_router_group_topk` groups with the best scores; its attention is MLA
    (`kv_lora_rank` > 0, `rl3d.models.deepseek`).
    """

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # KV heads
    vocab_size: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    kv_channels: int = 0  # each head's width when not hidden / heads (Qwen3); 0: hidden / heads
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k before RoPE
    num_experts: int = 0  # 0: a dense MLP
    moe_ffn_hidden_size: int = 0
    moe_top_k: int = 0
    moe_norm_topk_prob: bool = True
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert (GLM: none)
    moe_score_function: str = "softmax"  # or "sigmoid" (GLM-4.5)
    moe_expert_bias: bool = False  # the sigmoid router's e_score_correction_bias
    moe_routed_scaling: float = 1.0  # the routed experts' weights times this (GLM's routed_scaling_factor)
    moe_first_dense_layers: int = 0  # the first layers keep a dense MLP of ffn_hidden_size
    rotary_fraction: float = 1.0  # the share of a head's width RoPE turns (GLM: 0.5)
    moe_router_groups: int = 1  # DeepSeek-V3's n_group: experts in groups, ...
    moe_router_group_topk: int = 1  # ... the top k taken from this many groups (topk_group)
    q_lora_rank: int = 0  # MLA (DeepSeek-V3): q's latent width (0: one q projection)
    kv_lora_rank: int = 0  # > 0: multi-latent attention, the kv latent's width
    qk_rope_head_dim: int = 0  # MLA: the rope channels at the end of each q/k head (kv_channels wide)
    v_head_dim: int = 0  # MLA: each head's value width

    def __post_init__(self) -> None:
        if self.num_experts and not (0 < self.moe_top_k <= self.num_experts and self.moe_ffn_hidden_size > 0):
            raise ValueError(
                f"model {self.name}: {self.num_experts} experts need 0 < moe_top_k <= num_experts "
                f"(got {self.moe_top_k}) and moe_ffn_hidden_size > 0 (got {self.moe_ffn_hidden_size})"
            )
        if self.moe_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"model {self.name}: moe_score_function {self.moe_score_function!r}")
        if self.moe_expert_bias and self.moe_score_function != "sigmoid":
            raise ValueError(f"model {self.name}: moe_expert_bias needs the sigmoid router")
        if self.moe_first_dense_layers and not 0 < self.moe_first_dense_layers < self.num_layers:
            raise ValueError(
                f"model {self.name}: moe_first_dense_layers {self.moe_first_dense_layers} must leave "
                f"a mixture-of-experts layer of the {self.num_layers}"
            )
        if not self.kv_channels and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model {self.name}: hidden_size {self.hidden_size} not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model {self.name}: num_attention_heads {self.num_attention_heads} not divisible "
                f"by num_query_groups {self.num_query_groups}"
            )
        check_mla(self)
        if self.num_experts % self.moe_router_groups or self.moe_router_group_topk > self.moe_router_groups:
            raise ValueError(
                f"model {self.name}: {self.num_experts} experts in {self.moe_router_groups} groups, "
                f"{self.moe_router_group_topk} chosen"
            )
        rotary = self.head_dim * self.rotary_fraction
        if not 0 < self.rotary_fraction <= 1 or rotary != int(rotary) or rotary % 2:
            raise ValueError(
                f"model {self.name}: rotary_fraction {self.rotary_fraction} of head width {self.head_dim} "
                "must be an even number of channels"
            )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The leading channels of each head that RoPE turns (the rest pass through); MLA's
        trailing `qk_rope_head_dim`."""
        return self.qk_rope_head_dim or int(self.head_dim * self.rotary_fraction)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (global index) is a mixture of experts."""
        return self.is_moe and layer >= self.moe_first_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.moe_first_dense_layers if self.is_moe else 0

    def mlp_params(self, layer: int | None = None) -> int:
        """One layer's MLP weights: the dense MLP, or all experts, the router (and its bias) and
        the shared expert. `layer` None: a mixture-of-experts layer of a MoE model."""
        h = self.hidden_size
        if not self.is_moe or (layer is not None and not self.is_moe_layer(layer)):
            return 3 * h * self.ffn_hidden_size
        shared = 3 * h * self.shared_expert_ffn_hidden_size
        if self.shared_expert_ffn_hidden_size and self.shared_expert_gate:
            shared += h  # the shared expert's sigmoid gate
        router = self.num_experts * (h + int(self.moe_expert_bias))
        return self.num_experts * 3 * h * self.moe_ffn_hidden_size + router + shared

    def active_mlp_params(self, layer: int | None = None) -> int:
        """One layer's MLP weights a token uses: top-k experts, the router and the shared expert."""
        if not self.is_moe or (layer is not None and not self.is_moe_layer(layer)):
            return self.mlp_params(layer)
        unused = (self.num_experts - self.moe_top_k) * 3 * self.hidden_size * self.moe_ffn_hidden_size
        return self.mlp_params(layer) - unused

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def num_params(self) -> int:
        """Unpadded parameter count (the HF checkpoint's)."""
        h, hd = self.hidden_size, self.head_dim
        qkv = (self.num_attention_heads + 2 * self.num_query_groups) * hd * h
        if self.qkv_bias:
            qkv += (self.num_attention_heads + 2 * self.num_query_groups) * hd
        norms = 2 * h + (2 * hd if self.qk_norm else 0)
        attention = qkv + self.num_attention_heads * hd * h + norms
        if self.is_mla:
            attention = mla_attention_params(self)
        mlps = sum(self.mlp_params(i) for i in range(self.num_layers))
        emb = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * attention + mlps + emb + h

    def active_params(self) -> int:
        """The parameters one token uses, embeddings and output layer left out (how published
        "A32B"-style counts are stated): attention, norms and each layer's active MLP."""
        mlps = sum(self.active_mlp_params(i) - self.mlp_params(i) for i in range(self.num_layers))
        emb = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.num_params() + mlps - emb


_LLAMA2 = dict(rope_theta=10000.0, norm_eps=1e-5, max_position_embeddings=4096)
_LLAMA3 = dict(rope_theta=500000.0, norm_eps=1e-5, max_position_embeddings=8192)
_QWEN25 = dict(rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, max_position_embeddings=32768)
# Qwen3-MoE (published config.json): 128 experts, 8 per token, head width 128, q/k norm.
_QWEN3_MOE = dict(
    rope_theta=1000000.0,
    norm_eps=1e-6,
    max_position_embeddings=40960,
    kv_channels=128,
    qk_norm=True,
    num_experts=128,
    moe_top_k=8,
)

# GLM-4.5 (published config.json): sigmoid router with a correction bias, one ungated shared
# expert as wide as a routed one, QKV bias, RoPE over half of each 128-wide head.
_GLM45 = dict(
    rope_theta=1000000.0,
    norm_eps=1e-5,
    max_position_embeddings=131072,
    kv_channels=128,
    qkv_bias=True,
    moe_top_k=8,
    shared_expert_gate=False,
    moe_score_function="sigmoid",
    moe_expert_bias=True,
    rotary_fraction=0.5,
)

MODEL_SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("llama2-7b", 32, 4096, 11008, 32, 32, 32000, **_LLAMA2),
        ModelSpec("llama2-13b", 40, 5120, 13824, 40, 40, 32000, **_LLAMA2),
        ModelSpec("llama2-34b", 48, 8192, 22016, 64, 8, 32000, **{**_LLAMA2, "rope_theta": 1e6}),
        ModelSpec("llama2-70b", 80, 8192, 28672, 64, 8, 32000, **_LLAMA2),
        ModelSpec("llama3-8b", 32, 4096, 14336, 32, 8, 128256, **_LLAMA3),
        ModelSpec("llama3-70b", 80, 8192, 28672, 64, 8, 128256, **_LLAMA3),
        ModelSpec("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, **_QWEN25),
        ModelSpec("qwen2.5-72b", 80, 8192, 29568, 64, 8, 152064, **_QWEN25),
        ModelSpec("qwen3-30b-a3b", 48, 2048, 6144, 32, 4, 151936, moe_ffn_hidden_size=768, **_QWEN3_MOE),
        ModelSpec("qwen3-235b-a22b", 94, 4096, 12288, 64, 4, 151936, moe_ffn_hidden_size=1536, **_QWEN3_MOE),
        ModelSpec(
            "glm-4.5",
            92,
            5120,
            12288,
            96,
            8,
            151552,
            qk_norm=True,
            num_experts=160,
            moe_ffn_hidden_size=1536,
            shared_expert_ffn_hidden_size=1536,
            moe_routed_scaling=2.5,
            moe_first_dense_layers=3,
            **_GLM45,
        ),
        ModelSpec(
            "glm-4.5-air",
            46,
            4096,
            10944,
            96,
            8,
            151552,
            num_experts=128,
            moe_ffn_hidden_size=1408,
            shared_expert_ffn_hidden_size=1408,
            moe_first_dense_layers=1,
            **_GLM45,
        ),
        # Tiny models for tests and the CPU demo (random weights, built from these shapes).
        ModelSpec("tiny-llama", 2, 64, 176, 8, 4, 256, max_position_embeddings=512),
        ModelSpec("tiny-llama-mha", 2, 64, 128, 4, 4, 256, max_position_embeddings=512),
        ModelSpec("tiny-llama-odd-vocab", 2, 64, 128, 8, 2, 250, max_position_embeddings=512),
        ModelSpec("tiny-llama-v32", 2, 64, 176, 8, 4, 32, max_position_embeddings=512),  # tool task
        ModelSpec(
            "tiny-qwen2",
            2,
            64,
            160,
            8,
            2,
            256,
            qkv_bias=True,
            tied_embeddings=True,
            rope_theta=1e6,
            norm_eps=1e-6,
            max_position_embeddings=512,
        ),
        # q/k norm and a head width (32) that is not hidden / heads (16), tied like Qwen3's small models
        ModelSpec(
            "tiny-qwen3",
            2,
            64,
            160,
            4,
            2,
            256,
            tied_embeddings=True,
            kv_channels=32,
            qk_norm=True,
            rope_theta=1e6,
            norm_eps=1e-6,
            max_position_embeddings=512,
        ),
        ModelSpec(
            "tiny-qwen3-moe",
            2,
            64,
            128,
            4,
            2,
            256,
            kv_channels=32,
            qk_norm=True,
            num_experts=8,
            moe_ffn_hidden_size=32,
            moe_top_k=2,
            rope_theta=1e6,
            norm_eps=1e-6,
            max_position_embeddings=512,
        ),
        ModelSpec(
            "tiny-qwen2-moe",
            2,
            64,
            128,
            8,
            2,
            256,
            qkv_bias=True,
            num_experts=8,
            moe_ffn_hidden_size=32,
            moe_top_k=2,
            moe_norm_topk_prob=False,
            shared_expert_ffn_hidden_size=48,
            rope_theta=1e6,
            norm_eps=1e-6,
            max_position_embeddings=512,
        ),
        # GLM-4.5's layout: layer 0 dense, 3 MoE layers (sigmoid router with its bias, scaled by
        # 2.5, an ungated shared expert), QKV bias, q/k norm, RoPE over 16 of each head's 32 channels
        ModelSpec(
            "tiny-glm4-moe",
            4,
            64,
            96,
            4,
            2,
            256,
            qk_norm=True,
            num_experts=8,
            moe_ffn_hidden_size=32,
            shared_expert_ffn_hidden_size=32,
            moe_routed_scaling=2.5,
            moe_first_dense_layers=1,
            **{**_GLM45, "kv_channels": 32, "moe_top_k": 2, "max_position_embeddings": 512},
        ),
        *(ModelSpec(**shape) for shape in REGISTRY_SHAPES),  # DeepSeek-V3's (rl3d.models.deepseek)
    ]
}

_SCALED = re.compile(r"^(?P<base>.+)-shape-1/(?P<k>\d+)$")


def get_model_spec(name: str) -> ModelSpec:
    """Look up a spec by name; `BASE-shape-1/K` divides hidden, ffn (the experts' too) and vocab by K."""
    m = _SCALED.match(name)
    if m:
        return scaled_spec(get_model_spec(m["base"]), int(m["k"]), name)
    if name not in MODEL_SPECS:
        raise ValueError(
            f"unknown model {name!r}{suggest(name, MODEL_SPECS)}; known: {', '.join(MODEL_SPECS)}"
        )
    return MODEL_SPECS[name]


def spec_from_hf_config(cfg: dict[str, Any], name: str | None = None) -> ModelSpec:
    """ModelSpec of an HF config dict; unsupported model types and features are a clear error."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported HF model_type {model_type!r}; rl3d converts {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "deepseek_v3":
        return ModelSpec(name=name or f"hf-{model_type}", **deepseek_v3_fields(cfg))
    glm = model_type == "glm4_moe"  # its attention_bias is q, k and v's only
    if cfg.get("mlp_bias") or (cfg.get("attention_bias") and not glm):
        raise ValueError(f"{model_type}: mlp_bias / attention_bias (o_proj bias) are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_type}: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{model_type}: sliding-window attention is not supported")
    if model_type == "qwen2_moe" and cfg.get("qkv_bias") is False:
        raise ValueError("qwen2_moe: qkv_bias false is not supported")
    max_positions = cfg.get("max_position_embeddings", 4096)
    if model_type == "mistral" and cfg.get("sliding_window"):
        # full attention equals Mistral's sliding window on sequences no longer than the window
        max_positions = min(max_positions, cfg["sliding_window"])
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    qk_norm = model_type in QK_NORM_TYPES or (glm and bool(cfg.get("use_qk_norm")))
    if head_dim * heads != cfg["hidden_size"] and not (qk_norm or glm):
        raise ValueError(f"{model_type}: head_dim {head_dim} x {heads} heads != hidden_size")
    if glm:
        moe = glm4_moe_fields(cfg)
    else:
        moe = moe_fields(model_type, cfg) if model_type.endswith("_moe") else {}
    return ModelSpec(
        name=name or f"hf-{model_type}",
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        vocab_size=cfg["vocab_size"],
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type in QKV_BIAS_TYPES or (glm and bool(cfg.get("attention_bias"))),
        rope_theta=rope_theta_of(cfg),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        kv_channels=head_dim if head_dim * heads != cfg["hidden_size"] else 0,
        qk_norm=qk_norm,
        **moe,
    )


# What the weights' shapes and the forward pass depend on: a registry name and an HF directory
# must agree on all of them (max_position_embeddings may differ; the smaller one is used).
MATCHED_FIELDS = (
    *(f.name for f in fields(ModelSpec) if f.name not in ("name", "max_position_embeddings", "kv_channels")),
    "head_dim",
)


def spec_in_dir(path: str | Path) -> ModelSpec:
    """The spec of a model directory: an HF one (config.json) or an rl3d Megatron weight
    directory (rl3d_meta.json); named after the directory. A missing or unreadable config, or
    an unsupported architecture, is a ValueError naming the file."""
    path = Path(path)
    meta, config = path / "rl3d_meta.json", path / "config.json"
    source = meta if meta.is_file() else config
    if not source.is_file():
        raise ValueError(f"{path}: no config.json (nor rl3d_meta.json): not a model directory")
    try:
        record = json.loads(source.read_text())
        if source is meta:
            return replace(ModelSpec(**record["spec"]), name=str(path))
        return spec_from_hf_config(record, name=str(path))
    except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{source}: {type(err).__name__}: {err}") from None


def spec_of(model_cfg: Any) -> ModelSpec:
    """The spec a run builds from its `model` section (`rl3d.config.ModelConfig`).

    `name` only: the registry's. `hf_path` only: the shapes in its config.json. Both: the
    registry's, which must agree with the directory on every `MATCHED_FIELDS` entry (a
    ValueError names both and each differing field), with the smaller max_position_embeddings.
    An `hf_path` that does not exist here is not read when `name` is set (the preflight reports
    it where the run starts).
    """
    name, hf_path = model_cfg.name, model_cfg.hf_path
    if name is None:
        if not hf_path:
            raise ValueError("model: set model.name (a registry shape) or model.hf_path (an HF directory)")
        return spec_in_dir(hf_path)
    spec = get_model_spec(name)
    if not hf_path or not Path(hf_path).is_dir():
        return spec
    found = spec_in_dir(hf_path)
    differ = [f for f in MATCHED_FIELDS if getattr(found, f) != getattr(spec, f)]
    if differ:
        theirs = ", ".join(f"{f}={getattr(found, f)}" for f in differ)
        ours = ", ".join(f"{f}={getattr(spec, f)}" for f in differ)
        raise ValueError(
            f"{_config_file(hf_path)} holds a model with {theirs}, but model.name {name!r} has {ours} "
            "(unset model.name, e.g. model.name=null, to take the shapes from the directory)"
        )
    if found.max_position_embeddings < spec.max_position_embeddings:
        spec = replace(spec, max_position_embeddings=found.max_position_embeddings)
    return spec


def _config_file(path: str | Path) -> Path:
    meta = Path(path) / "rl3d_meta.json"
    return meta if meta.is_file() else Path(path) / "config.json"
