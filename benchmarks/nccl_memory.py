"""Device memory that NCCL's communicators take, outside torch's allocator, on every rank: read
with `torch.cuda.mem_get_info` after the CUDA context alone, after the world's process group
(bound to the rank's GPU, as `rl3d.utils.device.init_process_group` makes it) and its first
all-reduce, after megatron's groups and after rl3d's resharding groups, each with one all-reduce
per group so that every communicator exists. `torch.cuda.memory_reserved` is recorded beside
each, to tell torch's own bytes apart. The layout is the 8-GPU recipes' (train 1-4-2, t_g 2) on
8 ranks, else TP over all ranks and t_g half of it:

    torchrun --standalone --nproc_per_node 8 benchmarks/nccl_memory.py --out DIR
    torchrun --standalone --nproc_per_node 2 benchmarks/nccl_memory.py --out DIR --device cpu  # no counts

Rank 0 writes DIR/nccl_memory.json (every rank's readings and the NCCL_* variables set).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist

from rl3d.models.bootstrap import destroy_megatron, init_megatron
from rl3d.parallel import GenerationLayout, ParallelLayout
from rl3d.parallel.groups import Group, build_hybrid_groups
from rl3d.utils.device import collective_device, init_process_group, synchronize


def layout_for(world: int) -> tuple[ParallelLayout, int]:
    t = 4 if world % 4 == 0 and world > 4 else world
    return ParallelLayout(1, t, world // t), max(1, t // 2)


def all_reduce_each(handles: list) -> int:
    """One small all-reduce in each group (a communicator is made at its first collective)."""
    device = collective_device()
    for handle in handles:
        dist.all_reduce(torch.ones(1, device=device), group=handle)
    synchronize(device)
    return len(handles)


def reading(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"used": total - free, "torch_reserved": torch.cuda.memory_reserved(device)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    readings: dict[str, dict] = {}
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # the CUDA context, nothing else
    readings["context"] = reading(device)
    init_process_group(args.device, timeout_s=120)
    readings["world_group"] = reading(device)
    all_reduce_each([None])
    readings["world_all_reduce"] = reading(device)
    world = dist.get_world_size()
    train, t_g = layout_for(world)
    groups = init_megatron(train)
    megatron = [groups.tp_group, groups.pp_group, groups.dp_group, groups.mp_group]
    counts = {"megatron": all_reduce_each([g for g in megatron if g is not None])}
    readings["megatron_groups"] = reading(device)
    hybrid = build_hybrid_groups(GenerationLayout.from_training(train, t_g, 1), timeout_s=120)
    mine = [getattr(hybrid, f.name) for f in fields(hybrid)]
    counts["hybrid"] = all_reduce_each(
        [g.handle for g in mine if isinstance(g, Group) and g.handle is not None]
    )
    readings["hybrid_groups"] = reading(device)
    steps = list(readings)
    grown = {
        later: readings[later]["used"] - readings[earlier]["used"]
        for earlier, later in zip(steps, steps[1:])
        if "used" in readings[later]
    }
    mine_out = {
        "rank": dist.get_rank(),
        "readings": readings,
        "grown_by_step": grown,
        "all_reduced_groups": counts,
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine_out)
    if dist.get_rank() == 0:
        result = {
            "backend": dist.get_backend(),
            "world": world,
            "layout": f"train 1-{train.t}-{train.d}, t_g {t_g}",
            "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
            "ranks": everyone,
        }
        if device.type == "cuda":
            result["max_used_over_context_per_rank"] = max(
                r["readings"]["hybrid_groups"]["used"] - r["readings"]["context"]["used"] for r in everyone
            )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "nccl_memory.json").write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "ranks"}))
    destroy_megatron()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
