"""A mixture of experts' transition with its expert and dense weights apart.

Each expert's fc1 and fc2 are TP-sharded like the dense MLP's in generation, and in training
too unless the expert TP size is set apart (`ParallelLayout.etp`: split over etp ranks).
With expert parallelism in training (`ParallelLayout.ep > 1`) a rank trains only its EP rank's
experts, so it holds fewer expert bytes than it needs for generation (every expert of its stage)
and receives the rest over its EP group (`rl3d.hybrid_engine.hybridflow`). Planning the two
classes separately (`plan_transition(..., params=)`) gives each rank's bytes of each; the two add
up to the whole plan's, rank by rank, because each parameter's pieces are planned on their own.
"""

from __future__ import annotations

from rl3d.hybrid_engine.plan import plan_transition
from rl3d.models.params import model_params
from rl3d.models.spec import ModelSpec
from rl3d.parallel import ParallelLayout


def plan_moe_split(
    spec: ModelSpec,
    train: ParallelLayout,
    t_g: int,
    p_g: int = 1,
    *,
    dtype: str = "bfloat16",
    strategy: str = "hybridflow",
) -> dict:
    """Per class (`experts`: every expert's weights; `dense`: the rest, routers and shared
    experts included) the model's bytes and, under `strategy`, the per-rank bytes trained
    (max: the training shard), received (max, mean) and held once the transition is done (max)."""
    if not spec.is_moe:
        raise ValueError(f"model {spec.name} has no experts")
    params = model_params(spec, train_tp=train.t)
    out: dict = {"strategy": strategy}
    for name, subset in (
        ("experts", [p for p in params if p.expert is not None]),
        ("dense", [p for p in params if p.expert is None]),
    ):
        plan = plan_transition(spec, train, t_g, p_g, dtype=dtype, strategies=(strategy,), params=subset)
        cost = plan.strategies[strategy]
        out[name] = {
            "model_bytes": plan.model_bytes,
            "train_max": max(plan.rank_bytes(r)[0] for r in range(train.world_size)),
            "recv_max": cost.comm_bytes_max,
            "recv_mean": cost.comm_bytes_mean,
            "held_max": cost.peak_param_bytes,
        }
    return out


def format_moe(split: dict) -> str:
    """`rl3d plan`'s mixture-of-experts section, in GB, or MB / KB for a small model."""
    largest = max(split[name]["model_bytes"] for name in ("experts", "dense"))
    unit, size = next(((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)) if largest >= s), ("B", 1))
    lines = [f"mixture of experts: the transition by weight class ({unit} per rank, {split['strategy']}):"]
    lines.append(f"{'':<10}{'model':>10}{'trained':>10}{'recv max':>12}{'recv mean':>12}{'held max':>12}")
    for name in ("experts", "dense"):
        c = split[name]
        lines.append(
            f"{name:<10}{c['model_bytes'] / size:>10.3f}{c['train_max'] / size:>10.3f}"
            f"{c['recv_max'] / size:>12.3f}{c['recv_mean'] / size:>12.3f}{c['held_max'] / size:>12.3f}"
        )
    return "\n".join(lines)
