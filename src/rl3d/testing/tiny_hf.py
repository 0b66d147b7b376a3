"""Tiny random HF models (Llama, Qwen2, Qwen3, their MoEs, GLM-4.5) built from `transformers`
configs, no download."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rl3d.models.hf_mapping import hf_config_from_spec
from rl3d.models.spec import ModelSpec, get_model_spec


def make_tiny_hf_model(spec: ModelSpec | str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A random `transformers` causal LM of `spec`'s shape.

    Every tensor is random (norm weights around 1, QKV biases non-zero, a sigmoid router's
    correction bias too), so a conversion that drops or swaps one shows up in the logits.
    """
    from transformers import AutoModelForCausalLM

    spec = get_model_spec(spec) if isinstance(spec, str) else spec
    config = hf_config_from_spec(spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.05 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer in HF, part of the weights
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=gen))
    model.config.use_cache = False
    return model.to(dtype).eval()


def save_tiny_hf_model(
    spec: ModelSpec | str, directory: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Any:
    """Save a random tiny model as an HF directory; returns the model."""
    model = make_tiny_hf_model(spec, seed=seed, dtype=dtype)
    model.save_pretrained(str(directory))
    return model


def make_tiny_llava(*, seed: int = 0, text: str = "tiny-llama", image_token_id: int = 250) -> Any:
    """A random `transformers` LLaVA: a 3-layer CLIP tower on 16x16 images in 4x4 patches (16
    patches and a class token), LLaVA-1.5's projector and feature layer (-2, class token
    dropped), and `text`'s decoder; `image_token_id` is one of its vocabulary's ids."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
        hidden_act="quick_gelu",
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=hf_config_from_spec(get_model_spec(text)),
        image_token_id=image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        image_seq_length=16,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm = "norm" in name.rsplit(".", 2)[-2] or "layrnorm" in name
            param.copy_(1.0 + 0.1 * noise if is_norm and name.endswith("weight") else 0.05 * noise)
    model.config.use_cache = False
    return model.float().eval()
