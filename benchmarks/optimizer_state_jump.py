"""Adam's state would appear at the first optimizer step, not when the role is built: torch's
Adam makes `exp_avg` and `exp_avg_sq` (fp32, one each per master parameter) lazily, so a role's
memory would jump by 8 bytes per parameter in the middle of its first update, after the memory
plan and the rollout engine's launch-time sizing had run beside a smaller footprint. rl3d makes
the state when it builds the optimizer (`rl3d.models.training.make_optimizer_state`: megatron's
own `init_state_fn` plus torch's step counter).

This measures both on a bf16 megatron role (`torch.cuda.memory_allocated` after the build, after
step 1, after step 2, and each step's peak): the lazy arm is a role whose state this script
empties after the build (torch's default), the premade arm rl3d's role as built. The premade
arm's first step should add nothing, and after two steps both must hold the same parameters
and state bit for bit. `removal` says whether rl3d's build made the state.

    python benchmarks/optimizer_state_jump.py --out DIR                                  # CUDA
    python benchmarks/optimizer_state_jump.py --out DIR --device cpu --model tiny-llama   # no counts

Writes optimizer_state_jump.json into --out; exits 1 when the twins differ, when rl3d's build
left the state to the first step, or, on CUDA, when the pre-made state leaves a jump above 1%
of the lazy one.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from offload_cuda import train  # noqa: E402  (benchmarks/ is the script's folder)

from rl3d.config import OptimConfig
from rl3d.engine import InitialWeights, MegatronEngine, Training
from rl3d.models.bootstrap import init_megatron
from rl3d.models.hf_mapping import hf_config_from_spec
from rl3d.models.offload import kind_tensors
from rl3d.models.spec import get_model_spec
from rl3d.models.weights import save_weights
from rl3d.parallel.layout import ParallelLayout
from rl3d.utils.device import init_process_group, synchronize

LEFT_JUMP = 0.01  # of the lazy jump, what a pre-made state may still add at step 1


def megatron_optimizers(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def state_entries(optimizer) -> int:
    return sum(len(o.optimizer.state) for o in megatron_optimizers(optimizer))


def empty_state(optimizer) -> None:
    """torch's default: no state until the first step."""
    for opt in megatron_optimizers(optimizer):
        opt.optimizer.state.clear()


def tensors(role: MegatronEngine) -> list[torch.Tensor]:
    """Parameters, master copies and Adam's state, the state by key (the two make it in other orders)."""
    out = [t.detach().cpu().clone() for t in kind_tensors(role.ddp, role.optimizer, "params")]
    for opt in megatron_optimizers(role.optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state = opt.optimizer.state[p]
                out += [p.detach().cpu().clone(), *(state[k].detach().cpu().clone() for k in sorted(state))]
    return out


def measure(role_of, device: torch.device, premake: bool) -> tuple[MegatronEngine, dict]:
    counted = device.type == "cuda"

    def now() -> int | None:
        synchronize(device)
        return torch.cuda.memory_allocated(device) if counted else None

    before = now()
    role = role_of()
    out = {"built": now(), "state_entries_after_build": state_entries(role.optimizer)}
    if not premake:
        empty_state(role.optimizer)
        if counted:
            torch.cuda.empty_cache()
    for step in (1, 2):
        if counted:
            torch.cuda.reset_peak_memory_stats(device)
        train(role, step)
        out[f"after_step_{step}"] = now()
        out[f"peak_step_{step}"] = torch.cuda.max_memory_allocated(device) if counted else None
    if counted:
        ready = out["built"] if premake else now()
        out["role_bytes"] = ready - before
        out["jump_at_step_1"] = out["after_step_1"] - ready
        out["jump_at_step_2"] = out["after_step_2"] - out["after_step_1"]
    return role, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default="llama2-7b-shape-1/8")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    init_process_group(args.device, timeout_s=300, rank=0, world_size=1)
    groups = init_megatron(ParallelLayout(1, 1, 1), seed=1)
    device, spec = groups.device, get_model_spec(args.model)

    def role(hf_path=None):
        return MegatronEngine(spec, groups, role="actor", params_dtype=torch.bfloat16, seed=1,
                              training=Training(OptimConfig(lr=1e-4), total_steps=10),
                              weights=InitialWeights(hf_path=hf_path))  # fmt: skip

    with tempfile.TemporaryDirectory() as start:  # one starting point for both (master copies too)
        first = role()
        save_weights(first.model, spec, groups, start, hf_config=hf_config_from_spec(spec).to_dict())
        del first
        lazy, lazy_counts = measure(lambda: role(start), device, premake=False)
        lazy_tensors = tensors(lazy)
        del lazy
        premade, premade_counts = measure(lambda: role(start), device, premake=True)
    adam_bytes = 2 * 4 * sum(p.numel() for p in premade.ddp.parameters() if p.requires_grad)
    same = all(torch.equal(a, b) for a, b in zip(lazy_tensors, tensors(premade), strict=True))
    in_rl3d = premade_counts["state_entries_after_build"] > 0
    results = {
        "model": spec.name,
        "device": str(device),
        "adam_state_bytes_expected": adam_bytes,
        "lazy": lazy_counts,
        "premade": premade_counts,
        "premade_equals_lazy_after_two_steps": same,
        "removal": "in rl3d: the state exists after the build" if in_rl3d
        else "not in rl3d: its build left the state to the first step",
    }  # fmt: skip
    ok = same and in_rl3d
    if device.type == "cuda":
        left = premade_counts["jump_at_step_1"]
        ok = ok and left <= LEFT_JUMP * max(lazy_counts["jump_at_step_1"], 1)
    results["ok"] = ok
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimizer_state_jump.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
