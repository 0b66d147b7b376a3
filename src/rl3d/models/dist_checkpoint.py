"""Megatron distributed checkpoints: model + optimizer + LR scheduler + RNG state.

    save_checkpoint(path, ddp=ddp, optimizer=opt, scheduler=sched, groups=groups, iteration=10)
    iteration = load_checkpoint(path, ddp=ddp, optimizer=opt, scheduler=sched, groups=groups)

Uses `megatron.core.dist_checkpointing` (torch.distributed.checkpoint underneath; gloo on CPU,
NCCL on GPU). Model weights and the plain optimizer's state reshard to any (t, p, d); the
distributed optimizer's state is saved `dp_reshardable` (same t and p, any d). RNG state is per
rank and restored only into the same layout; otherwise `init_megatron`'s seeding stays and a
warning says so. Every rank calls both functions. megatron's checkpoint writer needs `psutil`.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl3d.models.bootstrap import MegatronGroups
from rl3d.models.training import unwrap_model

logger = logging.getLogger(__name__)

# megatron 0.16's "fully_reshardable" (and model-space) loaders drop torch Adam's per-param
# `step`, which the apex/TE-free fallback optimizer keeps, and fail on it; "dp_reshardable"
# keeps it, at the price of loading only into the same (t, p).
_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _materialize_adam_state(optimizer: Any) -> None:
    """Give a fresh torch Adam the state it otherwise creates at its first step.

    Without apex/TE, megatron's distributed optimizer reads every param's Adam `step` to build
    even the loading template; a freshly built optimizer has none. The zeros are overwritten by
    the load.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param.data)
                    state["exp_avg_sq"] = torch.zeros_like(param.data)


def _restore_adam_steps(optimizer: Any, loaded: dict[str, Any]) -> None:
    """Give every param its own, correct torch Adam `step` after a distributed-optimizer load.

    Without apex/TE, megatron keeps the step count in the saved param groups, puts one shared
    `step` tensor into every param's state (torch Adam would then advance it once per param),
    and its dp_reshardable loader overwrites it with the template's per-param value.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if "param_state" not in loaded:  # not the distributed optimizer: torch's own state_dict
        return
    assert len(chained) == 1, "one optimizer per model chunk (no MoE expert optimizer)"
    steps = {group["step"] for group in loaded["optimizer"]["param_groups"] if "step" in group}
    if not steps:  # apex/TE optimizers keep `step` themselves
        return
    (step,) = steps
    for state in chained[0].optimizer.state.values():
        if "step" in state:
            state["step"] = torch.tensor(float(step))


def _sharded_state(ddp: Any, optimizer: Any, groups: MegatronGroups, *, is_loading: bool) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    layout, coords = groups.layout, groups.coords
    model_state = unwrap_model(ddp).sharded_state_dict()
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=_OPTIM_METADATA
        )
    state["rng"] = ShardedObject(
        "rng_state",
        _rng_state(),
        # one per rank: CP ranks are data replicas here (at cp 1 the shape is p, t, d)
        (layout.p, layout.t, layout.d * layout.cp),
        (coords.pp, coords.tp, coords.dp * layout.cp + coords.cp),
        replica_id=0,
    )
    return state


def save_checkpoint(
    path: str | Path,
    *,
    ddp: Any,
    optimizer: Any,
    scheduler: Any,
    groups: MegatronGroups,
    iteration: int,
) -> None:
    """Save a distributed checkpoint into the (new or empty) directory `path`."""
    from megatron.core import dist_checkpointing

    try:
        import psutil  # noqa: F401
    except ImportError as err:
        # The torch_dist writer's subprocesses call psutil; without it they die and save hangs.
        raise RuntimeError("megatron-core's checkpoint writer needs psutil: pip install psutil") from err
    path = Path(path)
    if groups.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    state = _sharded_state(ddp, optimizer, groups, is_loading=False)
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    state["iteration"] = iteration
    state["layout"] = str(groups.layout)
    dist_checkpointing.save(state, str(path))
    torch.distributed.barrier()
    logger.info("saved checkpoint %s (iteration %d)", path, iteration)


def load_checkpoint(
    path: str | Path,
    *,
    ddp: Any,
    optimizer: Any,
    scheduler: Any,
    groups: MegatronGroups,
) -> int:
    """Load a checkpoint saved by `save_checkpoint` (any layout); returns its iteration."""
    from megatron.core import dist_checkpointing

    path = str(path)
    common = dist_checkpointing.load_common_state_dict(path)
    same_layout = common.get("layout") == str(groups.layout)
    if optimizer is not None:
        _materialize_adam_state(optimizer)
    state = _sharded_state(ddp, optimizer, groups, is_loading=True)
    if not same_layout:
        del state["rng"]
    loaded = dist_checkpointing.load(state, path)
    unwrap_model(ddp).load_state_dict(loaded["model"], strict=True)
    if optimizer is not None:
        # The dp_reshardable loader copies into fp32 main params that are views of the model's
        # parameters, and (unlike megatron's other loaders) is not itself under no_grad.
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer, loaded["optimizer"])
    if scheduler is not None and loaded.get("scheduler") is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng"])
    else:
        logger.warning(
            "checkpoint layout %s != %s: RNG state not restored", common.get("layout"), groups.layout
        )
    return int(loaded["iteration"])
