"""LoRA in tests: a real `peft` adapter on an HF model, saved and read back as the engines get it,
and the Megatron tensors of an HF model (what the trainer would hold)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rl3d.models.hf_mapping import tensor_maps
from rl3d.models.lora_names import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_TARGETS
from rl3d.models.spec import ModelSpec


def peft_adapter(
    model: Any,
    directory: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    targets: Sequence[str] = LORA_TARGETS,
    seed: int = 0,
    scale: float = 0.2,
) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """`get_peft_model(model)` with random nonzero lora_A and lora_B (N(0, scale^2)), saved with
    `save_pretrained` to `directory`; returns the peft model, the saved tensors and config."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
    peft_model = get_peft_model(model, config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    directory = Path(directory)
    peft_model.save_pretrained(directory)
    tensors = load_file(directory / ADAPTER_WEIGHTS)
    return peft_model, tensors, json.loads((directory / ADAPTER_CONFIG).read_text())


def megatron_from_hf(spec: ModelSpec, model: Any, padded_vocab: int) -> dict[str, torch.Tensor]:
    """The full (t=1) Megatron tensors of an HF model's weights (vocab padded)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return {
        m.mcore: m.to_mcore([state[h] for h in m.hf]).contiguous() for m in tensor_maps(spec, padded_vocab)
    }


def hf_logprobs(model: Any, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The model's log-probs of `response` after `prompt` (one unpadded sequence, fp32)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
