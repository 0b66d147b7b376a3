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
