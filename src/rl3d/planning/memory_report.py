"""`rl3d plan RECIPE --memory`: the memory plan as a table or JSON, and the one-line refusal
that preflight prints when a plan does not fit the device."""

from __future__ import annotations

import json
from typing import Any

from rl3d.config.schema import RL3DConfig
from rl3d.planning.memory import DEVICE, ENGINE, MemoryPlan, RankPlan, plan_memory

GIB = 1 << 30


def device_bytes_of(gib: float | None) -> int | None:
    if gib is None:
        return None
    if gib <= 0:
        raise ValueError(f"--device-gib must be > 0, got {gib}")
    return int(gib * GIB)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}"


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / (1 << 20):.2f} MiB"


def biggest_item(rank: RankPlan) -> tuple[str, str, int]:
    """(role or "engine", item, bytes) of the largest single item in the rank's peak phase (the
    device's allowances aside: no recipe key shrinks them)."""
    entries = rank.phases[rank.peak_phase]
    return max(
        (
            (name, item, value)
            for name, entry in entries.items()
            if name != DEVICE
            for item, value in entry.items().items()
        ),
        key=lambda x: x[2],
    )


def role_key(role: str) -> str:
    """The recipe section that sets `role` up."""
    return {"cost_critic": "critic", "reward_model": "reward.model", "cost_model": "reward.cost_model"}.get(
        role, role
    )


def remedies(phase: str, role: str, item: str) -> str:
    """What would shrink `item` of `role` in `phase`: the recipe keys to change."""
    key = role_key(role)
    if role == ENGINE:
        if item == "kv_cache":
            return (
                "fewer sequences at once (data.prompts_per_step, rollout.n), a larger rollout.t_g "
                "or a shorter rollout.max_new_tokens; with SGLang, rollout.sglang.max_total_tokens: "
                "plan (the pool capped at what the phase leaves) or a lower "
                "rollout.sglang.mem_fraction_static"
            )
        if item == "weights":
            return "a larger rollout.t_g"
        return (
            "a smaller hybrid_engine.bucket_mb or rollout.sglang.bucket_mb, or an identity generation layout"
        )
    if item == "activations":
        return (
            f"{key}.packing: true (fused attention keeps no [b*heads, T, T] scores), "
            f"full recompute, or a smaller {key}.micro_batch_size"
        )
    layout = f"a larger tp or pp in {key}.parallel"
    if phase != "train":
        return f"{key}.offload: [params, grads, optimizer] (on the host while generating), or {layout}"
    if item in ("master", "optimizer", "grads"):
        return f"{key}.optim.distributed_optimizer: true, or {layout}"
    return layout


def refusal(plan: MemoryPlan) -> str | None:
    """One line naming the worst rank, its phase, role and biggest item, and what would make
    the recipe fit; None when it fits (or no device size is known)."""
    if plan.fits is not False:
        return None
    for rank in plan.ranks:
        if rank.problems:
            return f"memory plan: rank {rank.rank} (node {rank.node}): {rank.problems[0]}"
    worst = plan.worst()
    role, item, nbytes = biggest_item(worst)
    return (
        f"memory plan: rank {worst.rank} (node {worst.node}) needs {_size(worst.peak_bytes)} in its "
        f"{worst.peak_phase} phase, over the device's {_size(plan.device_bytes)}; biggest item: "
        f"{role} {item} {_size(nbytes)}; to fit: {remedies(worst.peak_phase, role, item)}"
    )


def _groups(plan: MemoryPlan) -> list[tuple[list[int], RankPlan]]:
    """Consecutive ranks with identical plans, as ([ranks], one of them)."""
    out: list[tuple[list[int], RankPlan]] = []
    for rank in plan.ranks:
        same = (
            out
            and out[-1][1].pool == rank.pool
            and out[-1][1].to_json()["phases"] == rank.to_json()["phases"]
        )
        if same:
            out[-1][0].append(rank.rank)
        else:
            out.append(([rank.rank], rank))
    return out


def _span(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def format_memory_plan(plan: MemoryPlan) -> str:
    lines = ["GiB per rank by phase (peak marked *):"]
    for ranks, rank in _groups(plan):
        peaks = "  ".join(
            f"{phase} {_gib(v)}{'*' if phase == rank.peak_phase else ''}" for phase, v in rank.peaks.items()
        )
        lines.append(f"  ranks {_span(ranks):>7} ({rank.pool} pool): {peaks}")
    worst = plan.worst()
    lines.append(f"rank {worst.rank} by item (GiB):")
    for phase, entries in worst.phases.items():
        for name, entry in entries.items():
            items = ", ".join(f"{k} {_gib(v)}" for k, v in entry.items().items() if v)
            lines.append(f"  {phase:<8} {name:<12} {_gib(entry.total):>7}  {items}")
    if plan.not_planned:
        lines.append(f"not planned (their workers' memory is unknown): {', '.join(plan.not_planned)}")
    if plan.device_bytes is None:
        lines.append("fits: unknown (give --device-gib)")
    else:
        lines.append(f"fits {_gib(plan.device_bytes)} GiB: {'yes' if plan.fits else 'no'}")
        if (line := refusal(plan)) is not None:
            lines.append(line)
    return "\n".join(lines)


def run_memory_plan(args: Any, cfg: RL3DConfig | None) -> str:
    if cfg is None:
        raise ValueError("--memory needs a RECIPE")
    if not isinstance(cfg, RL3DConfig):
        raise ValueError(f"--memory plans RL recipes; this recipe is a {type(cfg).__name__}")
    plan = plan_memory(cfg, device_bytes_of(args.device_gib))
    if args.json:
        return json.dumps(plan.to_json(), indent=1)
    return format_memory_plan(plan)
