"""LLaVA's parameters for the 3D-HybridEngine: the decoder's, the vision tower's and the projector's.

`llava_params(spec, train_tp=t)` lists every parameter of megatron-core's `LLaVAModel` as
rl3d builds it (`rl3d.models.llava`) under the model's own names: the decoder's are the
Llama family's inventory (`rl3d.models.params.model_params`) under `language_model.`, the CLIP
tower's and the projector's follow with the split megatron-core trains them under (the tower's
QKV one query group per head, `linear_fc1` column-parallel with its bias, `linear_proj` and
`linear_fc2` row-parallel with their biases whole; norms, patch and position embeddings and the
class token replicated). The tower and projector sit on the first pipeline stage, as megatron
puts the encoder (`layer` FIRST). Passed as `params` to `plan_transition` and `Resharder`, they
move like any parameter: the bytes each rank counts equal the planned bytes by construction, and
`rl3d.rollout.vision.LlavaRolloutEngine` loads the resulting `GenerationWeights`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rl3d.hybrid_engine.plan import TransitionPlan, plan_transition
from rl3d.models.params import FIRST, ParamInfo, model_params
from rl3d.parallel import ParallelLayout
from rl3d.parallel.sharding import ShardKind

DECODER = "language_model."
TOWER = "vision_model."
PROJECTOR = "vision_projection.encoder."
_HF_LAYER = {  # megatron-core suffix of a CLIP layer -> HF's (save_pretrained's names)
    "input_layernorm": "layer_norm1",
    "self_attention.linear_proj": "self_attn.out_proj",
    "pre_mlp_layernorm": "layer_norm2",
    "mlp.linear_fc1": "mlp.fc1",
    "mlp.linear_fc2": "mlp.fc2",
}


def vision_params(spec: Any) -> list[ParamInfo]:
    """The tower's and projector's parameters (`spec`: a `rl3d.models.llava.LlavaSpec`)."""
    h, f, heads = spec.vision_hidden_size, spec.vision_ffn_hidden_size, spec.vision_heads
    text = spec.text.hidden_size
    hf = "vision_tower."
    rep = ShardKind.REPLICATED

    def one(name: str, kind: ShardKind, shape: tuple[int, ...], hf_names: tuple[str, ...], **kw) -> ParamInfo:
        return ParamInfo(name, kind, shape, FIRST, hf=hf_names, **kw)

    out = [
        one(f"{TOWER}class_token", rep, (1, 1, h), (f"{hf}embeddings.class_embedding",)),
        one(f"{TOWER}conv1.weight", rep, (h, 3, spec.patch_size, spec.patch_size),
            (f"{hf}embeddings.patch_embedding.weight",)),
        one(f"{TOWER}position_embeddings.weight", rep, (spec.num_patches + 1, h),
            (f"{hf}embeddings.position_embedding.weight",)),
    ]  # fmt: skip
    out += [one(f"{TOWER}ln_pre.{k}", rep, (h,), (f"{hf}pre_layrnorm.{k}",)) for k in ("weight", "bias")]
    shapes = {  # (kind, weight shape) per layer module; a bias has the weight's rows
        "input_layernorm": (rep, (h,)),
        "self_attention.linear_qkv": (ShardKind.QKV, (3 * h, h)),
        "self_attention.linear_proj": (ShardKind.ROW, (h, h)),
        "pre_mlp_layernorm": (rep, (h,)),
        "mlp.linear_fc1": (ShardKind.COLUMN, (f, h)),
        "mlp.linear_fc2": (ShardKind.ROW, (h, f)),
    }
    for i in range(spec.vision_layers):
        ours, theirs = f"{TOWER}decoder.layers.{i}.", f"{hf}encoder.layers.{i}."
        for module, (kind, shape) in shapes.items():
            for k in ("weight", "bias"):
                is_bias = k == "bias" and len(shape) == 2
                p_kind = rep if is_bias and kind is ShardKind.ROW else kind
                p_shape = shape[:1] if k == "bias" else shape
                if module == "self_attention.linear_qkv":
                    names = tuple(f"{theirs}self_attn.{x}_proj.{k}" for x in "qkv")
                    out.append(
                        one(f"{ours}{module}.{k}", p_kind, p_shape, names, heads=(heads, heads, h // heads))
                    )
                else:
                    out.append(
                        one(f"{ours}{module}.{k}", p_kind, p_shape, (f"{theirs}{_HF_LAYER[module]}.{k}",))
                    )
    projector = {1: (ShardKind.COLUMN, (text, h)), 2: (ShardKind.ROW, (text, text))}
    for i, (kind, shape) in projector.items():
        hf_name = f"multi_modal_projector.linear_{i}."
        out.append(one(f"{PROJECTOR}linear_fc{i}.weight", kind, shape, (hf_name + "weight",)))
        bias_kind = ShardKind.COLUMN if kind is ShardKind.COLUMN else rep
        out.append(one(f"{PROJECTOR}linear_fc{i}.bias", bias_kind, shape[:1], (hf_name + "bias",)))
    return out


def llava_params(spec: Any, *, train_tp: int) -> list[ParamInfo]:
    """Every parameter of the LLaVA model at t=1 (vocab padded for `train_tp`): the decoder's
    under `language_model.` (their HF names under `language_model.`, as save_pretrained writes),
    then the tower's and the projector's."""
    decoder = [
        replace(p, name=DECODER + p.name, hf=tuple(DECODER + n for n in p.hf))
        for p in model_params(spec.text, train_tp=train_tp)
    ]
    return decoder + vision_params(spec)


def plan_llava_transition(
    spec: Any, train: ParallelLayout, t_g: int, *, dtype: str = "bfloat16", strategy: str = "hybridflow"
) -> TransitionPlan:
    """The train -> generate transition of the whole LLaVA model."""
    params = llava_params(spec, train_tp=train.t)
    return plan_transition(spec.text, train, t_g, dtype=dtype, strategies=(strategy,), params=params)
