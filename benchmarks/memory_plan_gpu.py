"""The memory plan beside the device's own count, on the one-GPU GRPO quickstart.

Builds the quickstart's actor and reference as a rank does (world of 1), runs two steps of
reshard + generate, then reference log-probs + actor update, and writes per phase the plan's
peak (`rl3d.planning.plan_memory`) beside three counts over that phase of step 2 (Adam's states
exist by then): `torch.cuda.max_memory_allocated` (tensors), `torch.cuda.max_memory_reserved`
(the caching allocator's segments) and, from `torch.cuda.mem_get_info` at the phase's end, the
device memory in use less what was in use before any role existed (the CUDA context and NCCL).
Every role's held bytes by item sit beside the plan's. On CPU (`--device cpu`) only the held
bytes are compared (there is no allocator count).

    python benchmarks/memory_plan_gpu.py --out DIR [--device cuda|cpu] [key=value ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch

RECIPE = "recipes/quickstart_cpu_grpo.yaml"
STEPS = 2
COUNTS = ("max_memory_allocated", "max_memory_reserved", "mem_get_info_used_at_end")


def _device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _peak(device: str, fn, baseline: int | None):
    """(result, the device's counts over fn: None on CPU)."""
    if device != "cuda":
        return fn(), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, {
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "mem_get_info_used_at_end": _device_used() - baseline,
    }


def run(device: str, extra: list[str]) -> dict:
    import torch.distributed as dist

    from rl3d.config import load_config
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.spec import spec_of
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.planning import plan_memory
    from rl3d.planning.held import SavedActivations, engine_held_bytes, role_held_bytes
    from rl3d.planning.memory_activations import MicroBatchShape, kept_bytes
    from rl3d.single_controller.batch import DataBatch
    from rl3d.testing.spawn import free_port
    from rl3d.utils.device import init_process_group
    from rl3d.utils.dtypes import DTYPE_BYTES
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker, ReferenceWorker

    overrides = [f"launch.device={device}", "launch.nproc_per_node=1", "actor.parallel.tp=1", *extra]
    cfg = load_config(RECIPE, overrides).config
    init_process_group(
        device, timeout_s=300, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    groups = init_megatron(ParallelLayout(1, 1, 1), seed=cfg.trainer.seed)
    baseline = _device_used() if device == "cuda" else None  # the context and NCCL, no role yet
    spec = spec_of(cfg.model)
    actor = ActorRolloutWorker(RoleContext(cfg, spec, groups, tokenizer=None))
    reference = None
    if cfg.reference_enabled:
        reference = ReferenceWorker(RoleContext(cfg, spec, groups, tokenizer=None, init_from=actor.role))
    gen = torch.Generator().manual_seed(5)
    num = cfg.data.prompts_per_step
    ids = [
        torch.randint(3, spec.vocab_size, (cfg.data.max_prompt_length,), generator=gen).tolist()
        for _ in range(num)
    ]
    prompts = DataBatch(meta={"prompt_ids": ids, "uid": list(range(num))})
    measured: dict[str, dict | None] = {}
    for step in range(STEPS):

        def generate(step=step):
            actor.reshard()
            return actor.generate_sequences(prompts, step=step), engine_held_bytes(actor)

        (batch, engine), measured["generate"] = _peak(device, generate, baseline)
        actor.release_generation()
        mask = batch["response_mask"]
        batch = batch.set("advantages", torch.ones_like(mask, dtype=torch.float32) * mask)

        def train(batch=batch):
            if reference is not None:
                batch = batch.union(reference.compute_ref_log_prob(batch))
            with SavedActivations(actor.role.model) as saved:
                actor.update_actor(batch)
            return max(saved.per_forward), batch["input_ids"].shape[1]

        (saved_bytes, width), measured["train"] = _peak(device, train, baseline)
    plan = plan_memory(cfg).ranks[0]
    total = torch.cuda.mem_get_info()[1] if device == "cuda" else 80 << 30
    on_gpu = plan_memory(cfg, total).ranks[0]  # with the allowances no tensor counts
    held = {"actor": role_held_bytes(actor.role)}
    if reference is not None:
        held["reference"] = role_held_bytes(reference.role)
    destroy_megatron()
    dist.destroy_process_group()
    planned_generate = max(plan.peaks["reshard"], plan.peaks["generate"])
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "baseline_mem_get_info_used": baseline,
        "phases": {
            "train": {"planned": plan.peaks["train"], **(measured["train"] or {})},
            "reshard+generate": {"planned": planned_generate, **(measured["generate"] or {})},
        },
        "held": held,
        "planned": {name: plan.phases["train"][name].items() for name in held},
        "engine_held": engine,
        # autograd's saved bytes in one actor micro-batch (the widest), against the plan's
        "activations": {
            "measured": saved_bytes,
            "planned": kept_bytes(
                spec,
                tp=1,
                layers=spec.num_layers,
                shape=MicroBatchShape(
                    width, cfg.actor.micro_batch_size, cfg.rollout.max_new_tokens, flash=False
                ),
                dtype_bytes=DTYPE_BYTES[cfg.model.dtype],
            ),
        },
        "engine_planned": plan.phases["generate"]["engine"].items(),
        # the plan's allowances (contexts, NCCL, fragmentation) beside what they stand for: the
        # context (and NCCL) in use before any role, reserved-but-unallocated bytes per phase
        "allowances": {phase: on_gpu.phases[phase]["device"].items() for phase in on_gpu.phases},
        "device_bytes_read": total if device == "cuda" else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides of the recipe (e.g. model.name=llama2-7b)"
    )
    args = parser.parse_args()
    os.environ.setdefault("LOCAL_RANK", "0")
    started = datetime.datetime.now(datetime.timezone.utc)
    result = run(args.device, args.overrides)
    result["overrides"] = args.overrides
    result["seconds"] = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "memory_plan.json").write_text(json.dumps(result, indent=1))
    for phase, v in result["phases"].items():
        counts = [f"{k} {v[k]} B (ratio {v[k] / v['planned']:.3f})" for k in COUNTS if k in v]
        print(f"{phase}: planned {v['planned']} B, " + (", ".join(counts) or "no device counts on CPU"))
    for role, items in result["held"].items():
        print(f"{role} held {items} planned {result['planned'][role]}")
    print(f"engine held {result['engine_held']} planned {result['engine_planned']}")
    act = result["activations"]
    ratio = act["measured"] / act["planned"]
    print(f"activations saved {act['measured']} B planned {act['planned']} B ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
