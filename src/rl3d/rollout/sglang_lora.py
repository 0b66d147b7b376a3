"""LoRA adapters into SGLang through the pinned wheel's own LoRA API (no file on disk).

SGLang keeps the base weights it was given and takes adapters as PEFT saves them: whole tensors
under PEFT's names plus adapter_config.json's dict, through
`Engine.load_lora_adapter_from_tensors(lora_name=, tensors=, config_dict=)`; it serializes one
copy per TP rank and each rank slices its own part. A request uses an adapter by name
(`generate(lora_path=[name, ...])`); `unload_lora_adapter(lora_name=)` frees it. The engine must
start with LoRA enabled and sized (`sglang_lora_server_args`): the largest rank and the targeted
projections, which is why the adapter shape is fixed at launch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl3d.models.lora_names import adapter_config
from rl3d.rollout.lora import AdapterConfig


def sglang_lora_server_args(config: Any) -> dict[str, Any]:
    """The `sglang.Engine` fields that enable LoRA for adapters like `config` (a PEFT config,
    adapter_config.json's dict, `actor.lora` or an AdapterConfig). One adapter at a time: each
    step's replaces the previous one."""
    cfg = AdapterConfig.from_peft(config)
    return dict(
        enable_lora=True,
        max_lora_rank=cfg.rank,
        lora_target_modules=list(cfg.target_modules),
        max_loras_per_batch=1,
    )


def peft_config_dict(config: Any) -> dict[str, Any]:
    """adapter_config.json's dict, as SGLang's `config_dict` expects it."""
    if isinstance(config, Mapping):
        return dict(config)
    cfg = AdapterConfig.from_peft(config)
    return adapter_config(
        rank=cfg.rank,
        alpha=cfg.alpha,
        targets=cfg.target_modules,
        dropout=0.0,
        use_rslora=cfg.use_rslora,
        base=None,
    )


def check_lora_update(ret: Any, what: str) -> None:
    """SGLang's LoRA calls answer a `LoRAUpdateOutput` (success, error_message)."""
    if not getattr(ret, "success", False):
        raise RuntimeError(f"SGLang {what} failed: {getattr(ret, 'error_message', ret)}")
