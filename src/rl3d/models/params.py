"""The GPT model's parameter inventory, by shape only (no tensors): the one list of its names.

Names are megatron-core GPTModel's (local layer spec, checked against 0.16.1) for the Llama /
Qwen2 / Qwen3 family, dense or a mixture of experts. The builder, the 3D-HybridEngine planner
and the torch rollout engine all read the names, shapes and shard kinds from here. A *global*
name uses the PP-global layer index; on a rank, `decoder.layers.{i}` uses the stage-local index
(`stage_param_names`):

    embedding.word_embeddings.weight                           VOCAB      [V_pad, h]
    decoder.layers.{i}.input_layernorm.weight                  REPLICATED [h]
    decoder.layers.{i}.self_attention.linear_proj.weight       ROW        [h, nh hd]
    decoder.layers.{i}.self_attention.linear_qkv.weight        QKV        [(nh + 2 ng) hd, h]
    decoder.layers.{i}.self_attention.linear_qkv.bias          QKV        [(nh + 2 ng) hd]  (Qwen2)
    decoder.layers.{i}.self_attention.q_layernorm.weight       REPLICATED [hd]   (q/k norm: Qwen3)
    decoder.layers.{i}.self_attention.k_layernorm.weight       REPLICATED [hd]   (q/k norm: Qwen3)
    decoder.layers.{i}.self_attention.linear_q_down_proj.weight  COLUMN   [rq, h]      (MLA)
    decoder.layers.{i}.self_attention.linear_q_up_proj.weight  COLUMN     [n qk, rq]   (MLA)
    decoder.layers.{i}.self_attention.linear_q_proj.weight     COLUMN     [n qk, h]    (MLA, no rq)
    decoder.layers.{i}.self_attention.linear_kv_down_proj.weight COLUMN   [rkv + rope, h] (MLA)
    decoder.layers.{i}.self_attention.linear_kv_up_proj.weight COLUMN     [n (qk - rope + v), rkv]
    decoder.layers.{i}.self_attention.q_layernorm.weight       REPLICATED [rq]   (MLA: q's latent)
    decoder.layers.{i}.self_attention.kv_layernorm.weight      REPLICATED [rkv]  (MLA)
    decoder.layers.{i}.pre_mlp_layernorm.weight                REPLICATED [h]
    decoder.layers.{i}.mlp.linear_fc1.weight                   SWIGLU_FC1 [2 f, h]   (dense)
    decoder.layers.{i}.mlp.linear_fc2.weight                   ROW        [h, f]     (dense)
    decoder.layers.{i}.mlp.router.weight                       REPLICATED [E, h]     (MoE)
    decoder.layers.{i}.mlp.router.expert_bias                  REPLICATED [E] fp32   (GLM-4.5: a buffer)
    decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight
                                                               SWIGLU_FC1 [2 fe, h]  (MoE)
    decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight
                                                               ROW        [h, fe]    (MoE)
    decoder.layers.{i}.mlp.shared_experts.gate_weight          REPLICATED [1, h]     (Qwen2-MoE)
    decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight    SWIGLU_FC1 [2 fs, h]  (Qwen2-MoE, GLM)
    decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight    ROW        [h, fs]    (Qwen2-MoE, GLM)
    decoder.final_layernorm.weight                             REPLICATED [h]
    output_layer.weight                                        VOCAB      [V_pad, h] (untied only;
                                                               critic: REPLICATED [1, h])

Each parameter also names the Hugging Face (Llama/Qwen2/Mistral) tensors it is made of
(`ParamInfo.hf`): `model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v}_proj.weight`
(one fused QKV), `model.layers.{i}.mlp.{gate,up}_proj.weight` (one fused fc1), ...,
`model.norm.weight`, `lm_head.weight`; a mixture of experts' `mlp.gate.weight` (router),
`mlp.experts.{e}.{gate,up,down}_proj.weight` and Qwen2-MoE's `mlp.shared_expert.*_proj.weight`
and `mlp.shared_expert_gate.weight` (the hub's per-expert layout, which `save_pretrained` writes);
GLM-4.5's ungated `mlp.shared_experts.*_proj.weight` and its router's
`mlp.gate.e_score_correction_bias`. `rl3d.models.hf_mapping` converts between the two.
DeepSeek-V3's multi-latent attention (MLA: `self_attn.q_a_proj`, `q_a_layernorm`, `q_b_proj`,
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`) takes the place of the fused QKV:
each HF tensor is one megatron parameter as it is (megatron's MLA reads the rope channels in
HF's interleaved order); the down projections are column-parallel like megatron's local spec
(split along the latent, gathered before the norm).

A model whose first layers are dense (GLM-4.5's `first_k_dense_replace`) lists the dense MLP in
those layers and the experts in the others (`ModelSpec.is_moe_layer`).

The router's expert bias is a buffer in megatron-core (not trained by gradients; megatron's
`finalize_model_grads` moves it after each step), listed here like a parameter because it is
part of the weights: loaded, saved, exported and moved to the rollout engine like the others.
`model_tensors(model)` is a built model's parameters with these buffers, in the inventory's order.

Experts (megatron's SequentialMLP, `moe_grouped_gemm: false`): a global name uses the global
expert index `e`; with expert parallelism of size `ep`, EP rank `k` holds experts
`k E/ep .. (k+1) E/ep - 1` as `local_experts.{e - k E/ep}` (`stage_param_names(..., ep=,
ep_rank=)`).
`ParamInfo.expert` is the global expert index (None for every other parameter).

With tied embeddings and p > 1 the last stage also holds a copy of the embedding as
`output_layer.weight` (megatron keeps the two in sync); it is not a separate global parameter.

Two orders of the same list: `model_params` lists a layer in forward order (the planner's
segment ids, and seeded test weights, follow it); `megatron_params` in the order the built
model's `named_parameters()` yields them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rl3d.models.spec import ModelSpec
from rl3d.parallel.sharding import ShardKind, padded_vocab_size

FIRST, LAST = -1, -2  # pseudo layer indices: embedding stage, output stage

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"
HF_NAMES = {  # the HF tensors of the parameters outside the decoder layers
    EMBEDDING: ("model.embed_tokens.weight",),
    FINAL_NORM: ("model.norm.weight",),
    OUTPUT_LAYER: ("lm_head.weight",),
}
HF_LAYER = "model.layers.{}."  # an HF decoder layer's prefix

# Suffixes of a decoder layer's parameters, after "decoder.layers.{i}.".
INPUT_NORM = "input_layernorm.weight"
QKV_WEIGHT = "self_attention.linear_qkv.weight"
QKV_BIAS = "self_attention.linear_qkv.bias"
PROJ_WEIGHT = "self_attention.linear_proj.weight"
MLP_NORM = "pre_mlp_layernorm.weight"
FC1_WEIGHT = "mlp.linear_fc1.weight"
FC2_WEIGHT = "mlp.linear_fc2.weight"
Q_NORM = "self_attention.q_layernorm.weight"
K_NORM = "self_attention.k_layernorm.weight"
ROUTER = "mlp.router.weight"
EXPERT_BIAS = "mlp.router.expert_bias"
EXPERT_FC1 = "mlp.experts.local_experts.{e}.linear_fc1.weight"
EXPERT_FC2 = "mlp.experts.local_experts.{e}.linear_fc2.weight"
SHARED_GATE = "mlp.shared_experts.gate_weight"
SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
SHARED_FC2 = "mlp.shared_experts.linear_fc2.weight"
EXPERT_PREFIX = "mlp.experts.local_experts."
Q_DOWN = "self_attention.linear_q_down_proj.weight"
Q_UP = "self_attention.linear_q_up_proj.weight"
Q_PROJ = "self_attention.linear_q_proj.weight"
KV_DOWN = "self_attention.linear_kv_down_proj.weight"
KV_UP = "self_attention.linear_kv_up_proj.weight"
KV_NORM = "self_attention.kv_layernorm.weight"


@dataclass(frozen=True)
class LayerParam:
    """One parameter of every decoder layer."""

    suffix: str
    kind: ShardKind
    registered: int  # its position in the layer's named_parameters() (megatron-core local spec)
    hf: tuple[str, ...]  # the HF tensors it is made of, after "model.layers.{i}."
    te_suffix: str | None = None  # its name under Transformer Engine's layer spec, where different


# Forward order. megatron registers linear_proj before linear_qkv (Attention builds the former,
# SelfAttention adds the latter); Transformer Engine fuses each norm into the following linear.
LAYER_PARAMS = (
    LayerParam(
        INPUT_NORM,
        ShardKind.REPLICATED,
        0,
        ("input_layernorm.weight",),
        te_suffix="self_attention.linear_qkv.layer_norm_weight",
    ),
    LayerParam(QKV_WEIGHT, ShardKind.QKV, 2, tuple(f"self_attn.{x}_proj.weight" for x in "qkv")),
    LayerParam(QKV_BIAS, ShardKind.QKV, 3, tuple(f"self_attn.{x}_proj.bias" for x in "qkv")),
    LayerParam(Q_NORM, ShardKind.REPLICATED, 4, ("self_attn.q_norm.weight",)),
    LayerParam(K_NORM, ShardKind.REPLICATED, 5, ("self_attn.k_norm.weight",)),
    LayerParam(PROJ_WEIGHT, ShardKind.ROW, 1, ("self_attn.o_proj.weight",)),
    LayerParam(
        MLP_NORM,
        ShardKind.REPLICATED,
        6,
        ("post_attention_layernorm.weight",),
        te_suffix="mlp.linear_fc1.layer_norm_weight",
    ),
    LayerParam(FC1_WEIGHT, ShardKind.SWIGLU_FC1, 7, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    LayerParam(FC2_WEIGHT, ShardKind.ROW, 8, ("mlp.down_proj.weight",)),
    # A mixture of experts' MLP; each expert template ("{e}") stands for num_experts parameters.
    LayerParam(ROUTER, ShardKind.REPLICATED, 7, ("mlp.gate.weight",)),
    LayerParam(EXPERT_BIAS, ShardKind.REPLICATED, 7, ("mlp.gate.e_score_correction_bias",)),
    LayerParam(
        EXPERT_FC1,
        ShardKind.SWIGLU_FC1,
        8,
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
    ),
    LayerParam(EXPERT_FC2, ShardKind.ROW, 8, ("mlp.experts.{e}.down_proj.weight",)),
    # SharedExpertMLP registers its gate before its linears.
    LayerParam(SHARED_GATE, ShardKind.REPLICATED, 9, ("mlp.shared_expert_gate.weight",)),
    LayerParam(
        SHARED_FC1,
        ShardKind.SWIGLU_FC1,
        10,
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
    ),
    LayerParam(SHARED_FC2, ShardKind.ROW, 11, ("mlp.shared_expert.down_proj.weight",)),
)
# Multi-latent attention in forward order (its norms registered after the four projections).
MLA_PARAMS = (
    LayerParam(Q_DOWN, ShardKind.COLUMN, 2, ("self_attn.q_a_proj.weight",)),
    LayerParam(Q_NORM, ShardKind.REPLICATED, 5, ("self_attn.q_a_layernorm.weight",)),
    LayerParam(Q_UP, ShardKind.COLUMN, 2, ("self_attn.q_b_proj.weight",)),
    LayerParam(Q_PROJ, ShardKind.COLUMN, 2, ("self_attn.q_proj.weight",)),
    LayerParam(KV_DOWN, ShardKind.COLUMN, 2, ("self_attn.kv_a_proj_with_mqa.weight",)),
    LayerParam(KV_NORM, ShardKind.REPLICATED, 5, ("self_attn.kv_a_layernorm.weight",)),
    LayerParam(KV_UP, ShardKind.COLUMN, 2, ("self_attn.kv_b_proj.weight",)),
)
_DENSE_MLP = (FC1_WEIGHT, FC2_WEIGHT)
_MOE_MLP = (ROUTER, EXPERT_BIAS, EXPERT_FC1, EXPERT_FC2)
_SHARED_EXPERT = (SHARED_GATE, SHARED_FC1, SHARED_FC2)
# GLM-4.5 (DeepSeek's naming): the shared expert without a gate, under `shared_experts`
_UNGATED_SHARED_HF = {
    SHARED_FC1: ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
    SHARED_FC2: ("mlp.shared_experts.down_proj.weight",),
}
BUFFERS = (EXPERT_BIAS,)  # megatron-core buffers that are part of the weights
TE_NAMES = {p.suffix: p.te_suffix for p in LAYER_PARAMS if p.te_suffix}


def model_tensors(model: Any) -> dict[str, Any]:
    """A built model's `named_parameters()` with, after each router's weight, its expert bias
    (a buffer): every tensor the inventory lists, in its order."""
    buffers = {n: b for n, b in model.named_buffers() if n.endswith(BUFFERS)}
    out = {}
    for name, param in model.named_parameters():
        out[name] = param
        if name.endswith(ROUTER) and (bias := name[: -len(ROUTER)] + EXPERT_BIAS) in buffers:
            out[bias] = buffers[bias]
    return out


def local_param(params: dict[str, Any], local: str) -> Any:
    """The model's parameter `local` (a stage-local megatron name) in `params`
    (`named_parameters()`), also under Transformer Engine's name, which fuses a layer's norms
    into the next linear (`...linear_qkv.layer_norm_weight`)."""
    if local in params:
        return params[local]
    for ours, te in TE_NAMES.items():
        if local.endswith(ours) and (fused := local[: -len(ours)] + te) in params:
            return params[fused]
    raise KeyError(f"model has no parameter {local}")


@dataclass(frozen=True)
class ParamInfo:
    """One Megatron parameter at t=1 (vocab padded for the training t)."""

    name: str
    kind: ShardKind
    shape: tuple[int, ...]
    layer: int  # global layer index, or FIRST / LAST
    tied_copy: bool = False  # output layer of a tied model: exists only when pipelined
    heads: tuple[int, int, int] | None = None  # QKV only: (num_heads, num_query_groups, head_dim)
    hf: tuple[str, ...] = ()  # the HF tensors it is made of (none: the critic's value head)
    expert: int | None = None  # a routed expert's weight: its global expert index

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def row_numel(self) -> int:
        return self.numel // self.shape[0]


def hf_shapes(param: ParamInfo, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of the whole HF tensors `param` is made of, in `param.hf`'s order: the fused
    QKV's q, k and v; fc1's gate and up; a vocabulary's `vocab_size` rows, padding removed."""
    rows, *rest = param.shape
    if param.kind is ShardKind.QKV:
        nq, ng, hd = param.heads
        return ((nq * hd, *rest), (ng * hd, *rest), (ng * hd, *rest))
    if param.kind is ShardKind.SWIGLU_FC1:
        return ((rows // 2, *rest),) * 2
    if param.kind is ShardKind.VOCAB:
        return ((vocab_size, *rest),)
    return (param.shape,)


def layer_param_name(layer: int, suffix: str) -> str:
    return f"decoder.layers.{layer}.{suffix}"


def layer_suffixes(spec: ModelSpec, layer: int, *, registered_order: bool = False) -> tuple[LayerParam, ...]:
    """The parameters decoder layer `layer` of `spec` has, in forward (or megatron's) order; an
    expert template ("{e}") stands for each of the layer's experts."""
    moe = spec.is_moe_layer(layer)
    absent = set(_DENSE_MLP if moe else _MOE_MLP)
    if not (moe and spec.shared_expert_ffn_hidden_size):
        absent |= set(_SHARED_EXPERT)
    if not spec.shared_expert_gate:
        absent.add(SHARED_GATE)
    if not spec.moe_expert_bias:
        absent.add(EXPERT_BIAS)
    if not spec.qkv_bias:
        absent.add(QKV_BIAS)
    if not spec.qk_norm:
        absent |= {Q_NORM, K_NORM}
    if spec.is_mla:
        absent |= {QKV_WEIGHT, QKV_BIAS, Q_NORM, K_NORM}
    params = [p for p in LAYER_PARAMS if p.suffix not in absent]
    if spec.is_mla:  # after the input norm
        q = {Q_PROJ} if spec.q_lora_rank else {Q_DOWN, Q_NORM, Q_UP}
        params[1:1] = [p for p in MLA_PARAMS if p.suffix not in q]
    if not spec.shared_expert_gate:
        params = [replace(p, hf=_UNGATED_SHARED_HF.get(p.suffix, p.hf)) for p in params]
    if registered_order:
        params.sort(key=lambda p: p.registered)
    return tuple(params)


def _layer_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, f, hd = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    nq, ng = spec.num_attention_heads, spec.num_query_groups
    qkv_rows = (nq + 2 * ng) * hd
    fe, fs = spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size
    rq, rkv, rope = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim
    mla = {
        Q_DOWN: (rq, h),
        Q_NORM: (rq,),
        Q_UP: (nq * hd, rq),
        Q_PROJ: (nq * hd, h),
        KV_DOWN: (rkv + rope, h),
        KV_NORM: (rkv,),
        KV_UP: (nq * (hd - rope + spec.v_head_dim), rkv),
        PROJ_WEIGHT: (h, nq * spec.v_head_dim),
    }
    return {
        INPUT_NORM: (h,),
        QKV_WEIGHT: (qkv_rows, h),
        QKV_BIAS: (qkv_rows,),
        Q_NORM: (hd,),
        K_NORM: (hd,),
        PROJ_WEIGHT: (h, nq * hd),
        MLP_NORM: (h,),
        FC1_WEIGHT: (2 * f, h),
        FC2_WEIGHT: (h, f),
        ROUTER: (spec.num_experts, h),
        EXPERT_BIAS: (spec.num_experts,),
        EXPERT_FC1: (2 * fe, h),
        EXPERT_FC2: (h, fe),
        SHARED_GATE: (1, h),
        SHARED_FC1: (2 * fs, h),
        SHARED_FC2: (h, fs),
        **(mla if spec.is_mla else {}),
    }


def layer_params(spec: ModelSpec, layer: int, *, registered_order: bool = False) -> list[ParamInfo]:
    """Decoder layer `layer`'s parameters, in forward (or megatron's) order; experts as megatron
    registers them (expert 0's fc1 and fc2, then expert 1's, ...), with global expert indices."""
    shapes = _layer_shapes(spec)
    nq, ng, hd = spec.num_attention_heads, spec.num_query_groups, spec.head_dim
    prefix = HF_LAYER.format(layer)

    def info(p: LayerParam, expert: int | None = None) -> ParamInfo:
        fill = {} if expert is None else {"e": expert}
        return ParamInfo(
            layer_param_name(layer, p.suffix.format(**fill)),
            p.kind,
            shapes[p.suffix],
            layer,
            heads=(nq, ng, hd) if p.kind is ShardKind.QKV else None,
            hf=tuple(prefix + s.format(**fill) for s in p.hf),
            expert=expert,
        )

    out = []
    suffixes = layer_suffixes(spec, layer, registered_order=registered_order)
    experts = [p for p in suffixes if p.suffix in (EXPERT_FC1, EXPERT_FC2)]
    for p in suffixes:
        if p.suffix == EXPERT_FC1:
            out += [info(q, e) for e in range(spec.num_experts) for q in experts]
        elif p.suffix != EXPERT_FC2:
            out.append(info(p))
    return out


def expert_owner(spec: ModelSpec, expert: int, ep: int) -> tuple[int, int]:
    """(EP rank, EP-local index) of global expert `expert` under expert parallelism `ep`."""
    if spec.num_experts % ep:
        raise ValueError(f"model {spec.name}: {spec.num_experts} experts do not split into ep={ep} ranks")
    return divmod(expert, spec.num_experts // ep)


def model_params(spec: ModelSpec, *, train_tp: int) -> list[ParamInfo]:
    """Every parameter of the actor, layers in forward order; a tied output layer is listed as
    `tied_copy` (held only when pipelined). What the 3D-HybridEngine plans over."""
    h = spec.hidden_size
    vocab = padded_vocab_size(spec.vocab_size, train_tp)
    out = [ParamInfo(EMBEDDING, ShardKind.VOCAB, (vocab, h), FIRST, hf=HF_NAMES[EMBEDDING])]
    for i in range(spec.num_layers):
        out += layer_params(spec, i)
    out.append(ParamInfo(FINAL_NORM, ShardKind.REPLICATED, (h,), LAST, hf=HF_NAMES[FINAL_NORM]))
    out.append(
        ParamInfo(
            OUTPUT_LAYER,
            ShardKind.VOCAB,
            (vocab, h),
            LAST,
            tied_copy=spec.tied_embeddings,
            hf=HF_NAMES[OUTPUT_LAYER],
        )
    )
    return out


def megatron_params(
    spec: ModelSpec, *, role: str = "actor", padded_vocab: int | None = None
) -> list[ParamInfo]:
    """The global (t=1, p=1) parameters of a built model of `role`, in `named_parameters()` order.

    No tied output copy; the critic's output layer is its value head (REPLICATED [1, h]).
    `padded_vocab` defaults to the padding for t=1."""
    h = spec.hidden_size
    vocab = padded_vocab_size(spec.vocab_size, 1) if padded_vocab is None else padded_vocab
    out = [ParamInfo(EMBEDDING, ShardKind.VOCAB, (vocab, h), FIRST, hf=HF_NAMES[EMBEDDING])]
    for i in range(spec.num_layers):
        out += layer_params(spec, i, registered_order=True)
    out.append(ParamInfo(FINAL_NORM, ShardKind.REPLICATED, (h,), LAST, hf=HF_NAMES[FINAL_NORM]))
    if role == "critic":
        out.append(ParamInfo(OUTPUT_LAYER, ShardKind.REPLICATED, (1, h), LAST))
    elif not spec.tied_embeddings:
        out.append(ParamInfo(OUTPUT_LAYER, ShardKind.VOCAB, (vocab, h), LAST, hf=HF_NAMES[OUTPUT_LAYER]))
    return out


def megatron_param_kinds(spec: ModelSpec, *, role: str = "actor") -> dict[str, ShardKind]:
    """Global (t=1, p=1) Megatron parameter names of a model, in order, with their shard kind."""
    return {p.name: p.kind for p in megatron_params(spec, role=role)}


def stages_of(param: ParamInfo, num_layers: int, pp: int) -> range:
    """Pipeline stages that hold `param` at pipeline size pp (layers split evenly)."""
    if param.layer == FIRST:
        return range(0, 1)
    if param.layer == LAST:
        # A tied output layer is the embedding itself unless the model is pipelined, in which
        # case megatron keeps a synced copy on the last stage.
        return range(0) if param.tied_copy and pp == 1 else range(pp - 1, pp)
    per = num_layers // pp
    return range(param.layer // per, param.layer // per + 1)


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


def stage_param_names(
    spec: ModelSpec, p: int, pp_rank: int, *, role: str = "actor", ep: int = 1, ep_rank: int = 0
) -> dict[str, str]:
    """Global name -> rank-local name of the parameters PP stage `pp_rank` (and, with expert
    parallelism `ep`, EP rank `ep_rank`) owns: stage-local layer, EP-local expert index.

    The tied output copy on the last stage (p > 1) is left out: it is not a global parameter.
    """
    lo = pp_rank * layers_per_stage(spec, p)
    names = {}
    for param in megatron_params(spec, role=role):
        if pp_rank not in stages_of(param, spec.num_layers, p):
            continue
        local = param.name
        if param.expert is not None:
            owner, index = expert_owner(spec, param.expert, ep)
            if owner != ep_rank:
                continue
            local = local.replace(f"{EXPERT_PREFIX}{param.expert}.", f"{EXPERT_PREFIX}{index}.", 1)
        if param.layer >= 0:
            local = local.replace(f"layers.{param.layer}.", f"layers.{param.layer - lo}.", 1)
        names[param.name] = local
    return names
