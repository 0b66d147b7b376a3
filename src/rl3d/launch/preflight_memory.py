"""Preflight's memory check: a recipe whose per-rank memory plan (`rl3d.planning.memory`) does
not fit the device is refused before any rank starts, in one line that names the rank, the
phase, the role and its biggest item, and what would make it fit.

The device size is the launching host's GPU on a CUDA run (`launch.device` cuda, or auto on a
host with CUDA), or the size given with `--device-gib` (any device: how the check runs on CPU).
A CPU run without `--device-gib` is not checked. A CUDA run from this host has this host's
Transformer Engine; a plan made elsewhere takes the gpu extra's (`run_has_transformer_engine`).
Packing without it is refused naming the role's `packing`, as the role build would refuse it.
"""

from __future__ import annotations

from rl3d.config import LoadedConfig
from rl3d.config.errors import ConfigError

GIB = 1 << 30


class MemoryPlanError(ConfigError):
    """The recipe's memory plan does not fit the device (exit 2, one line)."""


def device_bytes_for(loaded: LoadedConfig, device_gib: float | None) -> int | None:
    """The device size the plan must fit, or None when this run is not checked."""
    if device_gib is not None:
        if device_gib <= 0:
            raise ValueError(f"--device-gib must be > 0, got {device_gib}")
        return int(device_gib * GIB)
    from rl3d.utils.device import cuda_available, device_total_bytes

    requested = loaded.config.launch.device
    if requested == "cpu" or not cuda_available():
        return None  # launch.device cuda without CUDA here: the ranks' own check reports it
    return device_total_bytes()


def run_has_transformer_engine(loaded: LoadedConfig) -> bool:
    """Whether the planned run has Transformer Engine: this host's when the run is a CUDA run
    here (`launch.device` other than cpu on a host with CUDA), else the CUDA machine it is
    planned for is taken to have the gpu extra installed (`make install-gpu`)."""
    from rl3d.models.builder import transformer_engine_importable
    from rl3d.utils.device import cuda_available

    if loaded.config.launch.device == "cpu" or not cuda_available():
        return True
    return transformer_engine_importable()


def check_memory(loaded: LoadedConfig, device_gib: float | None = None) -> None:
    """Raise `MemoryPlanError` when the plan of `loaded` does not fit the device, or packs
    without the Transformer Engine it needs."""
    from rl3d.models.builder import NeedsTransformerEngine
    from rl3d.planning.memory import plan_memory
    from rl3d.planning.memory_report import biggest_item, refusal, role_key

    device_bytes = device_bytes_for(loaded, device_gib)
    if device_bytes is None:
        return
    try:
        plan = plan_memory(loaded.config, device_bytes, transformer_engine=run_has_transformer_engine(loaded))
    except NeedsTransformerEngine as err:
        raise MemoryPlanError(err.reason, key=err.key, source=loaded.source_of(err.key)) from None
    line = refusal(plan)
    if line is None:
        return
    if any(rank.problems for rank in plan.ranks):  # SGLang's own sizing (the only problem there is)
        key = "rollout.sglang.mem_fraction_static"
        raise MemoryPlanError(line, key=key, source=loaded.source_of(key))
    role, _, _ = biggest_item(plan.worst())
    key = "rollout" if role == "engine" else role_key(role)
    raise MemoryPlanError(line, key=key, source=loaded.source_of(key))


def kv_pool_override(loaded: LoadedConfig, device_gib: float | None = None) -> str | None:
    """The override that fixes `rollout.sglang.max_total_tokens: plan` to the plan's KV pool on
    this device, or None when there is nothing to resolve (another engine, a set value, no
    device size known)."""
    cfg = loaded.config
    if cfg.rollout.engine != "sglang" or cfg.rollout.sglang.max_total_tokens != "plan":
        return None
    device_bytes = device_bytes_for(loaded, device_gib)
    if device_bytes is None:
        return None
    from rl3d.planning.memory import sglang_kv_tokens

    tokens = sglang_kv_tokens(cfg, device_bytes)
    return None if tokens is None else f"rollout.sglang.max_total_tokens={tokens}"
