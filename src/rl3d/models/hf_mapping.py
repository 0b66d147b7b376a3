"""HF <-> Megatron parameter mapping for Llama, Qwen2 and Mistral (plain torch, per tensor).

Each `TensorMap` ties one global Megatron parameter (t=1, p=1, vocab padded) to the HF tensors
it is made of, with the two conversions. Nothing here needs process groups or megatron-core;
the converter streams checkpoints through these maps one parameter at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rl3d.models.params import megatron_param_kinds
from rl3d.models.spec import (  # noqa: F401  (re-exported: the HF config side of the mapping)
    SUPPORTED_MODEL_TYPES,
    ModelSpec,
    spec_from_hf_config,
)
from rl3d.ops.layouts import (
    ShardKind,
    fc1_hf_to_megatron,
    fc1_megatron_to_hf,
    qkv_hf_to_megatron,
    qkv_megatron_to_hf,
)


@dataclass(frozen=True)
class TensorMap:
    """One Megatron parameter and the HF tensors it is built from."""

    mcore: str
    hf: tuple[str, ...]
    kind: ShardKind
    to_mcore: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]


def hf_config_from_spec(spec: ModelSpec, **extra: Any) -> Any:
    """A `transformers` config (LlamaConfig, or Qwen2Config when the spec has a QKV bias)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups,
        rms_norm_eps=spec.norm_eps,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tied_embeddings,
        rope_theta=spec.rope_theta,
    )
    common.update(extra)
    return Qwen2Config(**common) if spec.qkv_bias else LlamaConfig(**common)


def _pad_rows(padded: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def pad(tensors: list[torch.Tensor]) -> torch.Tensor:
        (t,) = tensors
        if t.shape[0] == padded:
            return t
        # Padded vocab rows are zero; log-probs mask them (see logprobs.py), so they never matter.
        out = t.new_zeros(padded, *t.shape[1:])
        out[: t.shape[0]] = t
        return out

    return pad


def _unpad_rows(vocab: int) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    return lambda t: [t[:vocab]]


def _one(tensors: list[torch.Tensor]) -> torch.Tensor:
    (t,) = tensors
    return t


def _same(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def tensor_maps(spec: ModelSpec, padded_vocab: int) -> list[TensorMap]:
    """The maps of every global Megatron parameter of `spec`, in Megatron's parameter order."""
    nh, ng = spec.num_attention_heads, spec.num_query_groups

    def qkv_to_mcore(tensors: list[torch.Tensor]) -> torch.Tensor:
        return qkv_hf_to_megatron(*tensors, num_heads=nh, num_query_groups=ng)

    def qkv_to_hf(t: torch.Tensor) -> list[torch.Tensor]:
        return list(qkv_megatron_to_hf(t, num_heads=nh, num_query_groups=ng))

    per_layer = {
        "input_layernorm.weight": (("input_layernorm.weight",), _one, _same),
        "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), _one, _same),
        "self_attention.linear_qkv.weight": (
            tuple(f"self_attn.{x}_proj.weight" for x in "qkv"),
            qkv_to_mcore,
            qkv_to_hf,
        ),
        "self_attention.linear_qkv.bias": (
            tuple(f"self_attn.{x}_proj.bias" for x in "qkv"),
            qkv_to_mcore,
            qkv_to_hf,
        ),
        "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), _one, _same),
        "mlp.linear_fc1.weight": (
            ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            lambda ts: fc1_hf_to_megatron(*ts),
            lambda t: list(fc1_megatron_to_hf(t)),
        ),
        "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), _one, _same),
    }
    vocab_maps = (_pad_rows(padded_vocab), _unpad_rows(spec.vocab_size))
    maps = []
    for name, kind in megatron_param_kinds(spec).items():
        if name.startswith("decoder.layers."):
            _, _, index, suffix = name.split(".", 3)
            hf_suffixes, to_mcore, to_hf = per_layer[suffix]
            hf = tuple(f"model.layers.{index}.{s}" for s in hf_suffixes)
        elif name == "embedding.word_embeddings.weight":
            hf, (to_mcore, to_hf) = ("model.embed_tokens.weight",), vocab_maps
        elif name == "output_layer.weight":
            hf, (to_mcore, to_hf) = ("lm_head.weight",), vocab_maps
        elif name == "decoder.final_layernorm.weight":
            hf, to_mcore, to_hf = ("model.norm.weight",), _one, _same
        else:
            raise AssertionError(f"no HF mapping for {name}")
        maps.append(TensorMap(name, hf, kind, to_mcore, to_hf))
    return maps


def mcore_shape(spec: ModelSpec, padded_vocab: int, tmap: TensorMap) -> tuple[int, ...]:
    """Shape of the full (t=1) Megatron tensor of `tmap`, from shapes only."""
    h, f, hd = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    qkv_rows = (spec.num_attention_heads + 2 * spec.num_query_groups) * hd
    suffix = tmap.mcore.rsplit(".", 2)
    leaf = ".".join(suffix[-2:])
    shapes = {
        "word_embeddings.weight": (padded_vocab, h),
        "output_layer.weight": (padded_vocab, h),
        "input_layernorm.weight": (h,),
        "pre_mlp_layernorm.weight": (h,),
        "final_layernorm.weight": (h,),
        "linear_proj.weight": (h, spec.num_attention_heads * hd),
        "linear_qkv.weight": (qkv_rows, h),
        "linear_qkv.bias": (qkv_rows,),
        "linear_fc1.weight": (2 * f, h),
        "linear_fc2.weight": (h, f),
    }
    return shapes[leaf]
