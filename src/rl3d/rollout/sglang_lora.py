"""LoRA adapters into SGLang through the pinned wheel's own LoRA API (no file on disk).

SGLang keeps the base weights it was given and takes adapters as PEFT saves them: whole tensors
under PEFT's names plus adapter_config.json's dict, through
`Engine.load_lora_adapter_from_tensors(lora_name=, tensors=, config_dict=)`; it serializes one
copy per TP rank and each rank slices its own part. A request uses an adapter by name
(`generate(lora_path=[name, ...])`); `unload_lora_adapter(lora_name=)` frees it. The engine must
start with LoRA enabled and sized (`sglang_lora_server_args`): the largest rank and the targeted
projections, which is why the adapter shape is fixed at launch. It keeps the base it was pushed
once across the memory saver's releases by `enable_weights_cpu_backup` (released weights are
copied to host memory and back on resume; without it they lose their values).

The adapter transition hands a rank its generation-TP shards of the adapters (a
`GenerationWeights` over `rl3d.hybrid_engine.lora_plan.lora_params`, PEFT's names);
`whole_adapters` gathers them over the group into the whole tensors SGLang takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rl3d.models.lora_names import adapter_config
from rl3d.ops.layouts import ShardKind
from rl3d.rollout.lora import AdapterConfig
from rl3d.rollout.sglang_weights import gathered_shards


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
        enable_weights_cpu_backup=True,
    )


def whole_adapters(weights: Any, comm: Any = None) -> dict[str, torch.Tensor]:
    """PEFT's names -> whole lora_A / lora_B tensors from a rank's generation-TP shards of the
    adapters (collective over `comm`'s group, `rl3d.rollout.model.TPComm`): a column-parallel
    projection's lora_B is split by rows, a row-parallel one's lora_A by columns, the other
    factor is whole on every rank."""
    if isinstance(weights, Mapping):
        return dict(weights)
    out = {}
    for name, info in weights.params.items():
        shards = gathered_shards(weights, name, comm)
        dim = 1 if info.kind is ShardKind.ROW else 0
        out[name] = shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)
    return out


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
