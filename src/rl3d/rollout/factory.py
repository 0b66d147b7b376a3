"""The rollout engine a recipe asks for, built from its `rollout` section and what the actor
worker knows (model, generation-TP group, pad id, HF directory, device).

    engine = build_rollout_engine(cfg.rollout, spec=spec, group=gen_tp, pad_token_id=pad,
                                  model_path=cfg.model.hf_path, device=groups.device)

One call site serves every engine: `engine_kwargs` maps the section onto the keyword arguments of
the chosen class (`engine_class`), and tests bind them to its real signature. Refusals come here,
before anything is launched. The section is a `rl3d.config.RolloutConfig`, read and not
imported: the config layer sits above rollout.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rl3d.models.spec import ModelSpec
from rl3d.rollout.base import RolloutEngine
from rl3d.utils.dtypes import torch_dtype

ENGINES = ("torch", "sglang")
logger = logging.getLogger(__name__)


def push_bucket_mb(rollout: Any) -> float | None:
    """The bucket size of the push to `rollout.engine` where the engine keeps its own copy of
    the weights as whole HF tensors (SGLang: `rollout.sglang.bucket_mb`); None where it reads the
    generation weights in place (torch), which pushes nothing. The transition plans the push."""
    return rollout.sglang.bucket_mb if rollout.engine == "sglang" else None


def engine_class(name: str) -> type:
    """The class of engine `name`; importing the SGLang adapter does not import SGLang."""
    if name == "torch":
        from rl3d.rollout.torch_engine import TorchRolloutEngine

        return TorchRolloutEngine
    if name == "sglang":
        from rl3d.rollout.sglang_engine import SGLangRolloutEngine

        return SGLangRolloutEngine
    raise ValueError(f"rollout.engine: unknown engine {name!r}; known: {', '.join(ENGINES)}")


def engine_kwargs(
    rollout: Any,
    *,
    spec: ModelSpec,
    group: Any = None,
    control_group: Any = None,
    pad_token_id: int = 0,
    model_path: str | None = None,
    device: torch.device | str | None = None,
    dtype: str = "bfloat16",
    seed: int | None = None,
    lora_mode: str | None = None,
    lora: Any = None,
    record_routing: bool = False,
    push_plan: Any = None,
) -> dict[str, Any]:
    """The keyword arguments of `engine_class(rollout.engine)` for this recipe and rank.
    `lora_mode`: how the torch engine uses the adapters it is given (`actor.lora.engine_mode`);
    `lora`: the adapters' config where the engine receives adapters (the adapter transition),
    which SGLang is launched for (None: merged weights, or no LoRA);
    `record_routing`: the torch engine records a mixture of experts' routing per token;
    `push_plan`: the transition's planned push (`Resharder.push_plan`), which SGLang follows."""
    name = rollout.engine
    engine_class(name)  # unknown names fail here
    if rollout.p_g != 1:
        raise ValueError(
            f"rollout.p_g={rollout.p_g}: the {name} rollout engine generates with p_g = 1 "
            "(with p_g > 1 each engine would receive only its own stage's layers)"
        )
    kwargs: dict[str, Any] = dict(spec=spec, group=group, pad_token_id=pad_token_id)
    if name == "torch":  # generates on the resharded training weights unless told another dtype
        kwargs["dtype"] = torch_dtype(rollout.dtype) if rollout.dtype else None
        kwargs |= {"record_routing": True} if record_routing else {}
        return kwargs if lora_mode is None else kwargs | {"lora_mode": lora_mode}
    if record_routing:
        raise ValueError(
            f"algorithm.routing_replay: the {name} engine records no routing; use rollout.engine=torch"
        )
    if not model_path:
        raise ValueError("model.hf_path: the sglang rollout engine starts from an HF directory; set it")
    sg = rollout.sglang
    device = torch.device(device) if device is not None else None
    kwargs.update(
        model_path=str(model_path),
        control_group=control_group,
        push_plan=push_plan,
        update_mode=sg.weight_update,
        mem_fraction_static=sg.mem_fraction_static,
        enable_memory_saver=sg.enable_memory_saver,
        deterministic=sg.deterministic,
        max_total_tokens=_kv_tokens(sg.max_total_tokens),
        base_gpu_id=sg.base_gpu_id
        if sg.base_gpu_id is not None
        else (device.index if device is not None and device.type == "cuda" else None),
        dtype=rollout.dtype or dtype,
        seed=seed,
    )
    return kwargs if lora is None else kwargs | {"lora": lora}


def _kv_tokens(setting: int | str | None) -> int | None:
    """`rollout.sglang.max_total_tokens` as SGLang takes it. "plan" is resolved into an integer
    by `rl3d train` on a CUDA host; a run started another way sizes the pool SGLang's way."""
    if setting == "plan":
        logger.warning(
            "rollout.sglang.max_total_tokens: 'plan' was not resolved (the run was not started by "
            "`rl3d train` on a CUDA host); SGLang sizes its KV pool by mem_fraction_static"
        )
        return None
    return setting


def build_rollout_engine(rollout: Any, **options: Any) -> RolloutEngine:
    """Build the engine `rollout.engine` with the section's settings; `options` are
    `engine_kwargs`'s (spec, group, control_group, pad_token_id, model_path, device, dtype, seed,
    lora_mode, lora, record_routing, push_plan)."""
    return engine_class(rollout.engine)(**engine_kwargs(rollout, **options))
