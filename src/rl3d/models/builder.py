"""Actor, critic and reference models on megatron-core's GPTModel (Llama / Qwen2 / Qwen3 family,
dense or a mixture of experts).

`build_gpt(spec, groups, role=...)` builds this rank's PP stage and TP shard. The layer spec is
Transformer Engine's when TE imports, CUDA is present and the role packs its sequences
(`packed=True`), megatron's local spec otherwise (and always on CPU); packing on CUDA without
TE is refused (`use_transformer_engine`). The critic's output
layer is a value head (hidden -> 1, replicated over TP).

Parameter names, shapes and shard kinds are `rl3d.models.params`'s (re-exported here for the
modules that import them from the builder).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

import rl3d.models.cpu_shim as cpu_shim
from rl3d.models.bootstrap import MegatronGroups
from rl3d.models.mla_attention import with_mla_core_attention
from rl3d.models.params import (  # noqa: F401  (re-exported)
    TE_NAMES,
    global_layer_index,
    layers_per_stage,
    local_layer_index,
    megatron_param_kinds,
    stage_param_names,
)
from rl3d.models.ring_attention import with_ring_attention
from rl3d.models.spec import ModelSpec
from rl3d.parallel.layout import EP1_DRIFT
from rl3d.parallel.sharding import padded_vocab_size

logger = logging.getLogger(__name__)

ROLES = ("actor", "critic", "reference")


# Transformer Engine's attention ignores the padding mask rl3d builds: megatron 0.16 runs it as
# `causal`, and `padding_causal` derives sequence lengths from the mask assuming right padding.
# With left-padded prompts real tokens would attend to pads and every log-prob and value would be
# silently wrong, so the TE spec is refused for padded batches. Packed batches have no pads:
# their boundaries reach TE as THD cu_seqlens, for which megatron switches the mask type to
# `padding_causal` itself (TEDotProductAttention), so a packing role gets the TE spec.
TE_SUPPORTS_LEFT_PADDING = False


class NeedsTransformerEngine(ValueError):
    """Packing on a CUDA device where Transformer Engine does not import; `key` is the setting."""

    def __init__(self, key: str):
        self.key = key
        self.reason = (
            "true on a CUDA device needs Transformer Engine, which does not import here: without it "
            "a packed micro-batch of N tokens would run megatron's local attention on an [N, N] "
            "block-causal mask, keeping N x N fp32 scores per head and layer (memory quadratic in N: "
            "256 MiB each at N = 8192). Install Transformer Engine with the gpu extra "
            "(`make install-gpu`), or set "
            f"{key}: false"
        )
        super().__init__(f"{key}: {self.reason}")


def transformer_engine_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # a broken TE install raises more than ImportError
        return False
    return True


def use_transformer_engine(
    device: torch.device,
    *,
    packed: bool = False,
    key: str = "packing",
    transformer_engine: bool | None = None,
) -> bool:
    """TE's layer spec: only in a CUDA run with Transformer Engine (`transformer_engine`: whether
    the run has it; None: whether it imports here), and only where its attention can honour the
    batches: packed ones, or left-padded ones once `TE_SUPPORTS_LEFT_PADDING`. The memory plan
    counts attention by this decision too (`rl3d.engine.techniques.Packing.footprint`).

    Packing on CUDA without TE raises `NeedsTransformerEngine` naming `key` (the role's
    `<section>.packing`) rather than falling back to the local spec."""
    if device.type != "cuda":
        return False
    if not (transformer_engine_importable() if transformer_engine is None else transformer_engine):
        if packed:
            raise NeedsTransformerEngine(key)
        return False
    if not (packed or TE_SUPPORTS_LEFT_PADDING):
        logger.warning("Transformer Engine found, but its attention ignores left padding: local layer spec")
        return False
    return True


def context_parallel_size(groups: MegatronGroups) -> int:
    """The size of the CP group megatron built for `groups` (1 where it built none)."""
    cp = getattr(groups.pg_collection, "cp", None)
    return 1 if cp is None else cp.size()


def transformer_config(
    spec: ModelSpec,
    groups: MegatronGroups,
    *,
    params_dtype: torch.dtype = torch.float32,
    packed: bool = False,
    sequence_parallel: bool = False,
    **overrides: Any,
) -> Any:
    """megatron TransformerConfig of a Llama/Qwen2-family decoder (no dropout: RL wants exact logp)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    layers_per_stage(spec, groups.layout.p)
    if groups.layout.ep > 1 and not spec.is_moe:
        raise ValueError(f"expert parallelism ep={groups.layout.ep}: {spec.name} is dense (no experts)")
    if spec.is_moe and spec.num_experts % groups.layout.ep:
        raise ValueError(f"ep={groups.layout.ep} must divide the number of experts ({spec.num_experts})")
    if groups.layout.etp is not None and not spec.is_moe:
        raise ValueError(
            f"expert tensor parallelism etp={groups.layout.etp}: {spec.name} is dense (no experts)"
        )
    if groups.layout.etp is not None and groups.layout.ep == 1:
        raise ValueError(f"etp={groups.layout.etp} apart from tp={groups.layout.t} needs ep > 1: {EP1_DRIFT}")
    if spec.is_moe and spec.moe_ffn_hidden_size % groups.layout.expert_t:
        raise ValueError(
            f"etp={groups.layout.expert_t} must divide the experts' width "
            f"{spec.moe_ffn_hidden_size} ({spec.name})"
        )
    on_cpu = groups.device.type == "cpu"
    fused = use_transformer_engine(
        groups.device, packed=packed
    )  # megatron's fused kernels are only sure to exist with TE
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=groups.layout.t,
        pipeline_model_parallel_size=groups.layout.p,
        expert_model_parallel_size=groups.layout.ep,
        expert_tensor_parallel_size=groups.layout.expert_t,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        attention_softmax_in_fp32=True,
        # Fused kernels need CUDA (and TE or apex); elsewhere everything runs unfused.
        use_cpu_initialization=on_cpu,
        bias_activation_fusion=fused,
        masked_softmax_fusion=fused,
        bias_dropout_fusion=fused,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        sequence_parallel=sequence_parallel,
        context_parallel_size=context_parallel_size(groups),
    )
    kwargs.update(moe_config(spec))
    kwargs.update(mla_config(spec))
    if overrides.get("variable_seq_lengths"):
        # PP stages exchange each micro-batch's shape (packed rows differ in length). megatron
        # refuses that with its default MoE dispatcher even in a dense model; the MoE-only
        # setting below changes nothing else.
        kwargs["moe_token_dispatcher_type"] = "alltoall"
    kwargs.update(overrides)
    if kwargs.get("moe_aux_loss_coeff"):
        kwargs.setdefault("moe_router_load_balancing_type", "aux_loss")
        if kwargs["moe_router_load_balancing_type"] == "none":
            kwargs["moe_router_load_balancing_type"] = "aux_loss"
    return (MLATransformerConfig if spec.is_mla else TransformerConfig)(**kwargs)


def mla_config(spec: ModelSpec) -> dict[str, Any]:
    """MLATransformerConfig fields of DeepSeek-V3's multi-latent attention (none otherwise):
    plain RoPE (`rope_type="rope"`; megatron de-interleaves the rope channels as HF's
    `rope_interleave` does), softmax scale 1 / sqrt(q/k width) (YaRN's mscale off)."""
    if not spec.is_mla:
        return {}
    return dict(
        multi_latent_attention=True,
        q_lora_rank=spec.q_lora_rank or None,
        kv_lora_rank=spec.kv_lora_rank,
        qk_head_dim=spec.head_dim - spec.qk_rope_head_dim,
        qk_pos_emb_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        rope_type="rope",
        rotary_base=spec.rope_theta,
        rotary_percent=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
        qk_layernorm=True,  # the layer spec's latent norms (q_layernorm, kv_layernorm)
    )


def rank_param_names(spec: ModelSpec, groups: MegatronGroups, *, role: str = "actor") -> dict[str, str]:
    """Global name -> this rank's name of every parameter it holds (its PP stage's, its EP rank's
    experts)."""
    layout = groups.layout
    return stage_param_names(spec, layout.p, groups.pp_rank, role=role, ep=layout.ep, ep_rank=groups.ep_rank)


def moe_config(spec: ModelSpec) -> dict[str, Any]:
    """TransformerConfig fields of q/k norm and a mixture of experts (none for a dense Llama).

    Qwen's router takes a softmax over all experts, then the top k; with `norm_topk_prob` the k
    probabilities are renormalised to sum 1, which is a softmax over the k largest logits:
    megatron's default order (top-k, then softmax). Without it the probabilities stay the full
    softmax's: megatron's `moe_router_pre_softmax`. GLM-4.5's sigmoid router with its expert bias
    is megatron's `moe_router_score_function="sigmoid"` with `moe_router_enable_expert_bias`, and
    its dense first layers a `moe_layer_freq` list. Every token reaches its experts (no capacity,
    nothing dropped); experts run one after another (SequentialMLP: no grouped GEMM, no TE).
    No router loss: `moe_aux_loss_coeff` / `moe_z_loss_coeff` overrides add them (training).
    """
    out: dict[str, Any] = {"qk_layernorm": spec.qk_norm}
    if not spec.is_moe:
        return out
    out.update(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_top_k,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.moe_norm_topk_prob,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=None,
        moe_router_load_balancing_type="none",
        moe_permute_fusion=False,
    )
    if spec.shared_expert_ffn_hidden_size:
        out.update(
            moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=spec.shared_expert_gate,
        )
    if spec.moe_score_function == "sigmoid":
        # sigmoid scores, top k of scores + expert_bias, their sigmoids renormalised (megatron
        # always does for k > 1), times the scaling factor: GLM-4.5's Glm4MoeTopkRouter
        out.update(
            moe_router_score_function="sigmoid",
            moe_router_pre_softmax=False,
            moe_router_enable_expert_bias=spec.moe_expert_bias,
            moe_router_bias_update_rate=0.0,  # frozen unless <role>.moe.expert_bias_update_rate
            moe_router_topk_scaling_factor=spec.moe_routed_scaling,
        )
    if spec.moe_router_groups > 1:  # DeepSeek-V3's group-limited routing
        out.update(
            moe_router_num_groups=spec.moe_router_groups, moe_router_group_topk=spec.moe_router_group_topk
        )
    if spec.moe_first_dense_layers:
        out["moe_layer_freq"] = [int(spec.is_moe_layer(i)) for i in range(spec.num_layers)]
    return out


def build_gpt(
    spec: ModelSpec,
    groups: MegatronGroups,
    *,
    role: str = "actor",
    params_dtype: torch.dtype = torch.float32,
    padded_vocab: int | None = None,
    seed: int = 1234,
    packed: bool = False,
    sequence_parallel: bool = False,
    **config_overrides: Any,
) -> Any:
    """This rank's GPTModel (one PP stage, one TP shard) for `role`.

    `sequence_parallel` splits the hidden states between the TP blocks along the sequence
    (`rl3d.models.sequence_parallel`; every forward's length must then be a multiple of t).

    `padded_vocab` defaults to `padded_vocab_size(spec.vocab_size, t)`; pass the training
    layout's padding when building a model for another TP size that must hold the same tensors.
    The reference model is the actor's network with no gradients.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    layout = groups.layout
    if spec.is_moe:
        cpu_shim.define_missing_te_gemm()
    config = transformer_config(
        spec,
        groups,
        params_dtype=params_dtype,
        packed=packed,
        sequence_parallel=sequence_parallel,
        **config_overrides,
    )
    te = use_transformer_engine(groups.device, packed=packed)
    if te and spec.is_mla:
        raise ValueError(
            f"{spec.name}: multi-latent attention runs on megatron's local layer spec only (packing: false)"
        )

    def one_layer(num_experts: int | None) -> Any:
        if te:
            return specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_norm
            )
        local = specs.get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=spec.qk_norm or spec.is_mla,
            normalization="RMSNorm",
            multi_latent_attention=spec.is_mla,
        )
        if spec.is_mla:  # megatron's local attention does not take MLA's key and value widths
            if config.context_parallel_size > 1:
                raise ValueError(f"{spec.name}: context parallelism is not built for multi-latent attention")
            return with_mla_core_attention(local)
        # megatron's local attention refuses CP: ring attention over the CP group instead
        return with_ring_attention(local) if config.context_parallel_size > 1 else local

    layer_spec = one_layer(spec.num_experts or None)
    per_stage = layers_per_stage(spec, layout.p)
    if spec.moe_first_dense_layers:  # this stage's layers, each dense or a mixture of experts
        dense, first = one_layer(None), groups.pp_rank * per_stage
        layer_spec = [layer_spec if spec.is_moe_layer(first + i) else dense for i in range(per_stage)]
    if sequence_parallel and not te:  # torch's norm module, which megatron's local spec uses, refuses it
        layer_spec = sp_block_spec(layer_spec, per_stage)
    elif isinstance(layer_spec, list):
        layer_spec = block_spec(layer_spec)
    vocab = padded_vocab or padded_vocab_size(spec.vocab_size, layout.t)
    assert vocab >= spec.vocab_size and vocab % layout.t == 0, (vocab, spec.vocab_size, layout.t)
    tied = spec.tied_embeddings and role != "critic"
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        rotary_percent=spec.rotary_fraction,
        pg_collection=groups.pg_collection,
    )
    offset = groups.pp_rank * layers_per_stage(spec, layout.p)
    assert model.decoder.layers[0].layer_number - 1 == offset, "megatron split layers unevenly"
    if role == "critic" and groups.is_last_stage:
        model.output_layer = ValueHead(
            spec.hidden_size, params_dtype, seed=seed, tp_group=groups.tp_group if sequence_parallel else None
        )
    if role == "reference":
        model.requires_grad_(False)
        model.eval()
    model.to(groups.device)
    logger.debug("built %s %s stage %d/%d", role, spec.name, groups.pp_rank, layout.p)
    return model


def block_spec(layer_specs: list[Any], layer_norm: Any = None) -> Any:
    """The decoder block's spec of a stage whose layers differ (dense first layers); the final
    norm megatron's default for a block built from one layer spec."""
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=layer_norm or LayerNormImpl)


def sp_block_spec(layer_spec: Any, num_layers: int) -> Any:
    """The decoder block's spec for sequence parallelism on the local spec: every norm (the
    layers' and the final one) `rl3d.models.sequence_parallel.RMSNorm`. `layer_spec` is one
    layer's spec for all, or a list of this stage's."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from rl3d.models.sequence_parallel import RMSNorm, swap_module

    layers = layer_spec if isinstance(layer_spec, list) else [layer_spec] * num_layers
    return block_spec([swap_module(spec, WrappedTorchNorm, RMSNorm) for spec in layers], RMSNorm)


class ValueHead(torch.nn.Module):
    """hidden -> 1, replicated on every TP rank; called like megatron's output layer.

    Its weight carries no `tensor_model_parallel` attribute, so megatron treats it like a norm
    weight (counted once in the grad norm, all-reduced over DP only). Under sequence parallelism
    (`tp_group` given) it gathers the sequence first, so every TP rank values every position and
    its weight's gradient is whole on each (not marked `sequence_parallel`: no sum over TP).
    """

    def __init__(
        self, hidden_size: int, dtype: torch.dtype, *, seed: int, std: float = 0.02, tp_group: Any = None
    ) -> None:
        super().__init__()
        # A private generator gives every TP rank and every layout the same initial head.
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=gen, dtype=torch.float32) * std
        self.weight = torch.nn.Parameter(weight.to(dtype))
        self.tp_group = tp_group
        self.sequence_parallel = tp_group is not None  # read (and switched) like megatron's layer's

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        if self.sequence_parallel:
            from rl3d.models.sequence_parallel import gather_sequence

            hidden_states = gather_sequence(hidden_states, self.tp_group)
        return F.linear(hidden_states, self.weight), None
