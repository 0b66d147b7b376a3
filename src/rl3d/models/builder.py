"""Actor, critic and reference models on megatron-core's GPTModel (Llama / Qwen2 family).

`build_gpt(spec, groups, role=...)` builds this rank's PP stage and TP shard. The layer spec is
Transformer Engine's when TE imports and CUDA is present, megatron's local spec otherwise (and
always on CPU). The critic's output layer is a value head (hidden -> 1, replicated over TP).

Parameter names are those of megatron-core's local-spec GPTModel (checked against 0.16.1). The
*global* name of a parameter uses the PP-global layer index; on a rank, `decoder.layers.{i}`
uses the stage-local index (see `global_layer_index` / `local_layer_index`):

    embedding.word_embeddings.weight                           VOCAB      [V_pad, h]
    decoder.layers.{i}.input_layernorm.weight                  REPLICATED [h]
    decoder.layers.{i}.self_attention.linear_proj.weight       ROW        [h, nh hd]
    decoder.layers.{i}.self_attention.linear_qkv.weight        QKV        [(nh + 2 ng) hd, h]
    decoder.layers.{i}.self_attention.linear_qkv.bias          QKV        [(nh + 2 ng) hd]  (Qwen2)
    decoder.layers.{i}.pre_mlp_layernorm.weight                REPLICATED [h]
    decoder.layers.{i}.mlp.linear_fc1.weight                   SWIGLU_FC1 [2 f, h]
    decoder.layers.{i}.mlp.linear_fc2.weight                   ROW        [h, f]
    decoder.final_layernorm.weight                             REPLICATED [h]
    output_layer.weight                                        VOCAB      [V_pad, h] (untied only;
                                                               critic: REPLICATED [1, h])

With tied embeddings and p > 1 the last stage also holds a copy of the embedding as
`output_layer.weight` (megatron keeps the two in sync); it is not a separate global parameter.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from rl3d.models.bootstrap import MegatronGroups
from rl3d.models.spec import ModelSpec
from rl3d.ops.layouts import ShardKind, padded_vocab_size

logger = logging.getLogger(__name__)

ROLES = ("actor", "critic", "reference")

# In the order megatron-core's local-spec layer registers them.
_LAYER_KINDS = {
    "input_layernorm.weight": ShardKind.REPLICATED,
    "self_attention.linear_proj.weight": ShardKind.ROW,
    "self_attention.linear_qkv.weight": ShardKind.QKV,
    "self_attention.linear_qkv.bias": ShardKind.QKV,
    "pre_mlp_layernorm.weight": ShardKind.REPLICATED,
    "mlp.linear_fc1.weight": ShardKind.SWIGLU_FC1,
    "mlp.linear_fc2.weight": ShardKind.ROW,
}
# Transformer Engine fuses the norms into the following linear; same tensor, other name.
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def layers_per_stage(spec: ModelSpec, p: int) -> int:
    if spec.num_layers % p:
        raise ValueError(f"model {spec.name}: {spec.num_layers} layers do not split into {p} stages")
    return spec.num_layers // p


def global_layer_index(spec: ModelSpec, p: int, pp_rank: int, local: int) -> int:
    per_stage = layers_per_stage(spec, p)
    assert 0 <= local < per_stage, (local, per_stage)
    return pp_rank * per_stage + local


def local_layer_index(spec: ModelSpec, p: int, global_index: int) -> tuple[int, int]:
    """(pp_rank, local index) of a global layer index."""
    return divmod(global_index, layers_per_stage(spec, p))


def megatron_param_kinds(spec: ModelSpec, *, role: str = "actor") -> dict[str, ShardKind]:
    """Global (t=1, p=1) Megatron parameter names of a model, in order, with their shard kind."""
    kinds = {"embedding.word_embeddings.weight": ShardKind.VOCAB}
    for i in range(spec.num_layers):
        for suffix, kind in _LAYER_KINDS.items():
            if suffix.endswith(".bias") and not spec.qkv_bias:
                continue
            kinds[f"decoder.layers.{i}.{suffix}"] = kind
    kinds["decoder.final_layernorm.weight"] = ShardKind.REPLICATED
    if role == "critic":
        kinds["output_layer.weight"] = ShardKind.REPLICATED
    elif not spec.tied_embeddings:
        kinds["output_layer.weight"] = ShardKind.VOCAB
    return kinds


def stage_param_names(spec: ModelSpec, p: int, pp_rank: int, *, role: str = "actor") -> dict[str, str]:
    """Global name -> stage-local name of the parameters PP stage `pp_rank` owns.

    The tied output copy on the last stage (p > 1) is left out: it is not a global parameter.
    """
    per_stage = layers_per_stage(spec, p)
    lo, hi = pp_rank * per_stage, (pp_rank + 1) * per_stage
    names = {}
    for name in megatron_param_kinds(spec, role=role):
        if name.startswith("decoder.layers."):
            index = int(name.split(".")[2])
            if lo <= index < hi:
                names[name] = name.replace(f"layers.{index}.", f"layers.{index - lo}.", 1)
        elif name.startswith("embedding.") and pp_rank == 0:
            names[name] = name
        elif not name.startswith(("embedding.", "decoder.layers.")) and pp_rank == p - 1:
            names[name] = name
    return names


def use_transformer_engine() -> bool:
    """TE's layer spec is used only with CUDA and an importable transformer_engine."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # a broken TE install raises more than ImportError
        return False
    return True


def transformer_config(
    spec: ModelSpec, groups: MegatronGroups, *, params_dtype: torch.dtype = torch.float32, **overrides: Any
) -> Any:
    """megatron TransformerConfig of a Llama/Qwen2-family decoder (no dropout: RL wants exact logp)."""
    from megatron.core.transformer import TransformerConfig

    layers_per_stage(spec, groups.layout.p)
    on_cpu = not torch.cuda.is_available()
    fused = use_transformer_engine()  # megatron's fused kernels are only sure to exist with TE
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
        sequence_parallel=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(
    spec: ModelSpec,
    groups: MegatronGroups,
    *,
    role: str = "actor",
    params_dtype: torch.dtype = torch.float32,
    padded_vocab: int | None = None,
    seed: int = 1234,
    **config_overrides: Any,
) -> Any:
    """This rank's GPTModel (one PP stage, one TP shard) for `role`.

    `padded_vocab` defaults to `padded_vocab_size(spec.vocab_size, t)`; pass the training
    layout's padding when building a model for another TP size that must hold the same tensors.
    The reference model is the actor's network with no gradients.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    layout = groups.layout
    config = transformer_config(spec, groups, params_dtype=params_dtype, **config_overrides)
    if use_transformer_engine():
        layer_spec = specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm")
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
        pg_collection=groups.pg_collection,
    )
    offset = groups.pp_rank * layers_per_stage(spec, layout.p)
    assert model.decoder.layers[0].layer_number - 1 == offset, "megatron split layers unevenly"
    if role == "critic" and groups.is_last_stage:
        model.output_layer = ValueHead(spec.hidden_size, params_dtype, seed=seed)
    if role == "reference":
        model.requires_grad_(False)
        model.eval()
    model.to(groups.device)
    logger.debug("built %s %s stage %d/%d", role, spec.name, groups.pp_rank, layout.p)
    return model


class ValueHead(torch.nn.Module):
    """hidden -> 1, replicated on every TP rank; called like megatron's output layer.

    Its weight carries no `tensor_model_parallel` attribute, so megatron treats it like a norm
    weight (counted once in the grad norm, all-reduced over DP only).
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, *, seed: int, std: float = 0.02) -> None:
        super().__init__()
        # A private generator gives every TP rank and every layout the same initial head.
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=gen, dtype=torch.float32) * std
        self.weight = torch.nn.Parameter(weight.to(dtype))
        self.sequence_parallel = False

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        return F.linear(hidden_states, self.weight), None
