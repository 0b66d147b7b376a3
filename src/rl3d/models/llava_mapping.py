"""HF LLaVA tensors -> megatron-core `LLaVAModel` parameters (t=1).

Three namings are read: the modules' in transformers 5.x (`model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.*`), what its
`save_pretrained` writes (`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`,
`multi_modal_projector.*`), and the hub's LLaVA-1.5 files (the same, with
`vision_tower.vision_model.*`). The
decoder's tensors go through rl3d's Llama-family maps (`rl3d.models.hf_mapping.tensor_maps`);
the CLIP tower's q, k and v are fused as megatron's QKV with one query group per head. The
vision layers past `vision_feature_layer` and CLIP's `post_layernorm` are not read by LLaVA, and
not loaded. `llava_to_hf` is the inverse, under `save_pretrained`'s names.
"""

from __future__ import annotations

import torch

from rl3d.models.hf_mapping import tensor_maps
from rl3d.ops.layouts import qkv_hf_to_megatron, qkv_megatron_to_hf
from rl3d.parallel.sharding import ShardKind

# HF prefix -> rl3d's own (the decoder's names as for a plain Llama; the tower's and projector's)
_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision."),
    ("vision_tower.", "vision."),
    ("model.multi_modal_projector.", "projector."),
    ("multi_modal_projector.", "projector."),
)

_LAYER = {  # megatron suffix -> CLIP encoder layer suffix (weight and bias each)
    "input_layernorm": "layer_norm1",
    "self_attention.linear_proj": "self_attn.out_proj",
    "pre_mlp_layernorm": "layer_norm2",
    "mlp.linear_fc1": "mlp.fc1",
    "mlp.linear_fc2": "mlp.fc2",
}


def canonical_names(hf_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in hf_tensors.items():
        for prefix, ours in _PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix) :]
                break
        if name.startswith("vision.vision_model."):  # CLIPVisionModel's level, as the hub holds it
            name = "vision." + name[len("vision.vision_model.") :]
        out[name] = tensor
    return out


def llava_to_megatron(
    spec, hf_tensors: dict[str, torch.Tensor], *, padded_vocab: int
) -> dict[str, torch.Tensor]:
    """Every megatron-core parameter name of `spec`'s LLaVAModel -> its full tensor."""
    hf = canonical_names(hf_tensors)

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"the HF LLaVA tensors have no {name!r} (in rl3d's naming)")
        return hf[name]

    out = {}
    for m in tensor_maps(spec.text, padded_vocab):
        out["language_model." + m.mcore] = m.to_mcore([get(n) for n in m.hf])
    tower, vit = "vision.", "vision_model."
    out[vit + "class_token"] = get(tower + "embeddings.class_embedding").reshape(1, 1, -1)
    out[vit + "conv1.weight"] = get(tower + "embeddings.patch_embedding.weight")
    out[vit + "position_embeddings.weight"] = get(tower + "embeddings.position_embedding.weight")
    for kind in ("weight", "bias"):
        out[f"{vit}ln_pre.{kind}"] = get(f"{tower}pre_layrnorm.{kind}")
        for i in range(spec.vision_layers):
            src, dst = f"{tower}encoder.layers.{i}.", f"{vit}decoder.layers.{i}."
            for ours, theirs in _LAYER.items():
                out[f"{dst}{ours}.{kind}"] = get(f"{src}{theirs}.{kind}")
            q, k, v = (get(f"{src}self_attn.{x}_proj.{kind}") for x in "qkv")
            heads = spec.vision_heads
            out[f"{dst}self_attention.linear_qkv.{kind}"] = qkv_hf_to_megatron(
                q, k, v, num_heads=heads, num_query_groups=heads
            )
        for i in (1, 2):
            out[f"vision_projection.encoder.linear_fc{i}.{kind}"] = get(f"projector.linear_{i}.{kind}")
    return out


# how megatron-core splits the tower's and the projector's tensors between TP ranks (the
# decoder's kinds are the Llama family's); the rest (norms, patch and position embeddings, class
# token, row-parallel biases) is replicated
_VISION_KINDS = (
    (".linear_qkv.", ShardKind.QKV),  # one query group per head: whole heads per rank
    (".linear_fc1.", ShardKind.COLUMN),
    (".linear_proj.weight", ShardKind.ROW),
    (".linear_fc2.weight", ShardKind.ROW),
)


def llava_shard_kinds(spec, names: list[str], padded_vocab: int) -> dict[str, ShardKind]:
    """How each of the megatron-core parameters `names` of `spec`'s LLaVAModel is split under TP."""
    decoder = {"language_model." + m.mcore: m.kind for m in tensor_maps(spec.text, padded_vocab)}
    return {
        name: decoder.get(name)
        or next((k for part, k in _VISION_KINDS if part in name), ShardKind.REPLICATED)
        for name in names
    }


_SAVED = (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))


def llava_to_hf(spec, mcore: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`llava_to_megatron`'s inverse: the full megatron-core tensors -> the HF tensors LLaVA
    reads, named as transformers' `save_pretrained` writes them."""
    out: dict[str, torch.Tensor] = {}
    padded = mcore["language_model.embedding.word_embeddings.weight"].shape[0]
    for m in tensor_maps(spec.text, padded):
        for name, tensor in zip(m.hf, m.to_hf(mcore["language_model." + m.mcore]), strict=True):
            prefix, saved = next(p for p in _SAVED if name.startswith(p[0]))
            out[saved + name[len(prefix) :]] = tensor
    tower, vit = "vision_tower.", "vision_model."
    out[tower + "embeddings.class_embedding"] = mcore[vit + "class_token"].reshape(-1)
    out[tower + "embeddings.patch_embedding.weight"] = mcore[vit + "conv1.weight"]
    out[tower + "embeddings.position_embedding.weight"] = mcore[vit + "position_embeddings.weight"]
    for kind in ("weight", "bias"):
        out[f"{tower}pre_layrnorm.{kind}"] = mcore[f"{vit}ln_pre.{kind}"]
        for i in range(spec.vision_layers):
            dst, src = f"{tower}encoder.layers.{i}.", f"{vit}decoder.layers.{i}."
            for ours, theirs in _LAYER.items():
                out[f"{dst}{theirs}.{kind}"] = mcore[f"{src}{ours}.{kind}"]
            heads = spec.vision_heads
            qkv = qkv_megatron_to_hf(
                mcore[f"{src}self_attention.linear_qkv.{kind}"], num_heads=heads, num_query_groups=heads
            )
            for x, tensor in zip("qkv", qkv, strict=True):
                out[f"{dst}self_attn.{x}_proj.{kind}"] = tensor
        for i in (1, 2):
            out[f"multi_modal_projector.linear_{i}.{kind}"] = mcore[
                f"vision_projection.encoder.linear_fc{i}.{kind}"
            ]
    return out
