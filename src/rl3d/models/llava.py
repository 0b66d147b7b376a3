"""LLaVA (a CLIP vision tower, an MLP projector and a Llama-family decoder) through
megatron-core's `LLaVAModel`, from an HF `LlavaConfig`.

    spec = llava_spec_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    model = build_llava(spec, groups)
    load_llava_weights(model, spec, hf_dir, groups)  # or load_llava_state_dict(..., tensors, groups)
    logits, _ = model(pixel_values, llava_input_ids(ids_hf, spec), position_ids, None)

The two sides place an image differently in the token ids: HF's processor writes one image token
per image embedding (`spec.num_image_tokens` of them), megatron-core's LLaVA takes one image token
per image and widens it to that many embeddings itself. `llava_input_ids` turns the first into the
second; the logits then have the same length and order. A text-only batch passes `no_images(spec)`.

The vision tower is megatron-core's `CLIPViTModel` on the local layer spec, its attention made
bidirectional as CLIP's is (the local ViT spec is causal). It runs as many layers as HF's
`vision_feature_layer` reads (-2, LLaVA-1.5's: all but the last), so the hidden states it returns
are the ones HF's LLaVA projects; `vision_feature_select_strategy: default` drops the class token.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import rl3d.models.cpu_shim as cpu_shim
from rl3d.models.bootstrap import MegatronGroups
from rl3d.models.builder import transformer_config
from rl3d.models.spec import ModelSpec, spec_from_hf_config
from rl3d.parallel.sharding import padded_vocab_size

ACTIVATIONS = {"gelu": "gelu", "quick_gelu": "quick_gelu"}  # HF hidden_act -> what rl3d builds


@dataclass(frozen=True)
class LlavaSpec:
    """The shapes of a LLaVA model: its decoder's `ModelSpec` and its vision tower's."""

    text: ModelSpec
    vision_hidden_size: int
    vision_ffn_hidden_size: int
    vision_heads: int
    vision_layers: int  # the layers LLaVA reads features from (HF's vision_feature_layer)
    image_size: int
    patch_size: int
    vision_eps: float
    vision_act: str  # "quick_gelu" (CLIP's) or "gelu"
    projector_act: str
    image_token_id: int
    drop_class_token: bool  # vision_feature_select_strategy "default"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Decoder positions one image takes."""
        return self.num_patches + (0 if self.drop_class_token else 1)


def llava_spec_from_hf_config(cfg: dict[str, Any]) -> LlavaSpec:
    """A `LlavaSpec` of an HF LLaVA config.json; ValueError naming the key rl3d cannot build."""
    if cfg.get("model_type") != "llava":
        raise ValueError(f"model_type {cfg.get('model_type')!r} is not 'llava'")
    vision, text = cfg.get("vision_config") or {}, cfg.get("text_config") or {}
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"vision_config.model_type {vision.get('model_type')!r}: rl3d builds CLIP only")
    layer = cfg.get("vision_feature_layer", -2)
    num_layers = vision.get("num_hidden_layers", 24)
    if not isinstance(layer, int) or not -num_layers <= layer < 0:
        raise ValueError(f"vision_feature_layer {layer!r}: rl3d reads one layer, counted from the end")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r}: 'default' or 'full'")
    if not cfg.get("multimodal_projector_bias", True):
        raise ValueError("multimodal_projector_bias false: megatron's projector has biases")
    acts = {
        "vision_config.hidden_act": vision.get("hidden_act", "quick_gelu"),
        "projector_hidden_act": cfg.get("projector_hidden_act", "gelu"),
    }
    for key, act in acts.items():
        if act not in ACTIVATIONS:
            raise ValueError(f"{key} {act!r}: rl3d builds {', '.join(ACTIVATIONS)}")
    hidden = vision.get("hidden_size", 1024)
    return LlavaSpec(
        text=spec_from_hf_config(text),
        vision_hidden_size=hidden,
        vision_ffn_hidden_size=vision.get("intermediate_size", 4096),
        vision_heads=vision.get("num_attention_heads", 16),
        vision_layers=num_layers + 1 + layer,  # hidden_states[0] is the embeddings
        image_size=vision.get("image_size", 336),
        patch_size=vision.get("patch_size", 14),
        vision_eps=vision.get("layer_norm_eps", 1e-5),
        vision_act=acts["vision_config.hidden_act"],
        projector_act=acts["projector_hidden_act"],
        image_token_id=cfg.get("image_token_id", cfg.get("image_token_index", 32000)),
        drop_class_token=strategy == "default",
    )


def _activation(name: str) -> Any:
    from megatron.core.activations import quick_gelu

    return quick_gelu if name == "quick_gelu" else F.gelu


def _plain_config(groups: MegatronGroups, params_dtype: torch.dtype, **fields: Any) -> Any:
    """A TransformerConfig for the vision tower or the projector: biases, no dropout, unfused."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        add_bias_linear=True,
        gated_linear_unit=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=groups.layout.t,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=groups.device.type == "cpu",
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        attention_softmax_in_fp32=True,
        **fields,
    )


def _bidirectional_vit_spec() -> Any:
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    spec = get_vit_layer_with_local_spec()
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(
        attention, params={**attention.params, "attn_mask_type": AttnMaskType.no_mask}
    )
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
    )


def build_llava(spec: LlavaSpec, groups: MegatronGroups, *, params_dtype: torch.dtype = torch.float32) -> Any:
    """This rank's megatron-core `LLaVAModel` (local layer specs; its TP shard; one stage: no PP)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    if groups.layout.p > 1:
        raise ValueError("LLaVA under pipeline parallelism is not built yet (p must be 1)")
    if spec.text.is_moe:
        raise ValueError(f"LLaVA with a mixture-of-experts decoder ({spec.text.name}) is not built yet")
    cpu_shim.define_clip_vit_norm_without_te()
    text = spec.text
    vision = _plain_config(
        groups,
        params_dtype,
        num_layers=spec.vision_layers,
        hidden_size=spec.vision_hidden_size,
        ffn_hidden_size=spec.vision_ffn_hidden_size,
        num_attention_heads=spec.vision_heads,
        normalization="LayerNorm",
        layernorm_epsilon=spec.vision_eps,
        activation_func=_activation(spec.vision_act),
    )
    vision.vision_model_type = "clip"  # read by LLaVAModel, not a TransformerConfig field
    projection = _plain_config(
        groups,
        params_dtype,
        num_layers=1,
        hidden_size=text.hidden_size,
        ffn_hidden_size=text.hidden_size,
        num_attention_heads=groups.layout.t,  # unused by an MLP; megatron wants it divisible by t
        activation_func=_activation(spec.projector_act),
    )
    model = LLaVAModel(
        language_transformer_config=transformer_config(text, groups, params_dtype=params_dtype),
        language_transformer_layer_spec=gpt_layer_specs.get_gpt_layer_local_spec(
            qk_layernorm=text.qk_norm, normalization="RMSNorm"
        ),
        language_vocab_size=padded_vocab_size(text.vocab_size, groups.layout.t),
        language_max_sequence_length=text.max_position_embeddings,
        vision_transformer_config=vision,
        vision_transformer_layer_spec=_bidirectional_vit_spec(),
        drop_vision_class_token=spec.drop_class_token,
        vision_projection_config=projection,
        vision_projection_layer_spec=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
        ),
        parallel_output=True,
        share_embeddings_and_output_weights=text.tied_embeddings,
        language_position_embedding_type="rope",
        language_rotary_base=int(text.rope_theta),
        img_h=spec.image_size,
        img_w=spec.image_size,
        patch_dim=spec.patch_size,
        image_token_index=spec.image_token_id,
        pg_collection=groups.pg_collection,
    )
    return model.to(groups.device)


def llava_input_ids(ids_BT: torch.Tensor, spec: LlavaSpec) -> torch.Tensor:
    """HF's ids (`num_image_tokens` image tokens per image) as megatron's LLaVA takes them (one
    per image). Every row must hold the same number of images (they shrink alike)."""
    rows = [_one_token_per_image(row, spec) for row in ids_BT]
    if len({len(row) for row in rows}) > 1:
        raise ValueError("rows with different numbers of images shrink unequally; pass them one by one")
    return torch.stack(rows)


def _one_token_per_image(ids: torch.Tensor, spec: LlavaSpec) -> torch.Tensor:
    n = spec.num_image_tokens
    image = ids == spec.image_token_id
    first = image & ~torch.cat([image.new_zeros(1), image[:-1]])  # the first token of each run
    runs = torch.cumsum(first.int(), 0)
    lengths = torch.bincount(runs[image], minlength=int(runs.max()) + 1)[1:]
    if bool((lengths % n != 0).any()):  # adjacent images make one run of a multiple of n
        raise ValueError(f"image token runs of {lengths.tolist()}, expected multiples of {n}")
    starts = torch.nonzero(first)[:, 0]
    position = torch.arange(len(ids))
    in_run = position - starts[(runs - 1).clamp(min=0)] if len(starts) else position
    return ids[~image | (in_run % n == 0)]


def hf_input_ids(ids: list[int], spec: LlavaSpec) -> list[int]:
    """`llava_input_ids`' inverse for one prompt: each image token widened to `num_image_tokens`
    of them, as HF's processor writes (a loaded prompt holds one `<image>` per image, which is
    megatron's form already)."""
    out: list[int] = []
    for token in ids:
        out.extend([token] * spec.num_image_tokens if token == spec.image_token_id else [token])
    return out


def no_images(spec: LlavaSpec) -> torch.Tensor:
    """The `images` argument of a text-only batch (megatron's LLaVA reads `images.dtype`: None fails)."""
    return torch.zeros(0, 3, spec.image_size, spec.image_size)


def llava_pixel_values(images: list[Any], spec: LlavaSpec, hf_dir: str | Path | None = None) -> torch.Tensor:
    """Decoded images (`PIL.Image`s, `rl3d.data.images`) as the tower's input [n, 3, size, size]:
    transformers' CLIP image processor, from `hf_dir`'s preprocessor_config.json when it has one
    (LLaVA-1.5's: shortest side to 336, centre crop, CLIP's mean and std), else CLIP's defaults at
    `spec.image_size`."""
    if not images:
        return no_images(spec)
    from transformers import CLIPImageProcessorPil

    config = Path(hf_dir) / "preprocessor_config.json" if hf_dir is not None else None
    if config is not None and config.is_file():
        processor = CLIPImageProcessorPil.from_pretrained(str(hf_dir))
    else:
        size = spec.image_size
        processor = CLIPImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        )
    return processor(images=images, return_tensors="pt")["pixel_values"]


def load_llava_weights(model: Any, spec: LlavaSpec, hf_dir: str | Path, groups: MegatronGroups) -> None:
    """Load an HF LLaVA directory's safetensors into this rank's `model` (its TP shard)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    load_llava_state_dict(model, spec, tensors, groups)


def load_llava_state_dict(
    model: Any, spec: LlavaSpec, hf_tensors: dict[str, torch.Tensor], groups: MegatronGroups
) -> None:
    """Copy HF LLaVA tensors (any naming transformers has used) into this rank's `model`, each
    cut to its TP shard: every megatron parameter is set exactly once, or this fails naming it."""
    from rl3d.models.llava_mapping import llava_shard_kinds, llava_to_megatron
    from rl3d.ops.layouts import shard_for_tp

    wanted = dict(model.named_parameters())
    padded = model.language_model.vocab_size
    mapped = llava_to_megatron(spec, hf_tensors, padded_vocab=padded)
    kinds = llava_shard_kinds(spec, list(mapped), padded)
    missing, extra = sorted(set(wanted) - set(mapped)), sorted(set(mapped) - set(wanted))
    if missing or extra:
        raise ValueError(f"LLaVA weights: megatron parameters not set {missing}, unknown {extra}")
    t, rank = groups.layout.t, groups.tp_rank
    with torch.no_grad():
        for name, param in wanted.items():
            value = shard_for_tp(mapped[name], kinds[name], t, rank)
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{name}: HF gives {tuple(value.shape)}, megatron has {tuple(param.shape)}")
            param.copy_(value)


def read_llava_config(hf_dir: str | Path) -> LlavaSpec:
    return llava_spec_from_hf_config(json.loads((Path(hf_dir) / "config.json").read_text()))
