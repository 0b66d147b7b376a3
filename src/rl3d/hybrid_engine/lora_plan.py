"""The adapter-only transition: with LoRA the rollout engine keeps the base, only adapters move.

The adapters are planned as parameters of their own, one per PEFT factor and decoder layer
(`lora_params`), with the split the actor trains them under: a column-parallel projection (q,
k, v, gate, up) splits lora_B's rows over TP as the base splits its output rows, and keeps
lora_A whole; a row-parallel one (o, down) splits lora_A's input columns and keeps lora_B
whole. The 3D-HybridEngine's planner and executor then move them like any parameter: each
generation rank receives the pieces of its generation-TP shard held by the other members of
its micro-DP group, and the bytes the executor counts equal the planned bytes by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl3d.hybrid_engine.plan import TransitionPlan, plan_transition
from rl3d.models.lora_names import LORA_TARGETS, TARGETS, peft_key
from rl3d.models.lora_shapes import module_shape
from rl3d.models.params import ParamInfo
from rl3d.models.spec import ModelSpec
from rl3d.parallel import ParallelLayout
from rl3d.parallel.sharding import ShardKind

ADAPTER_DTYPE = "float32"  # the actor trains fp32 adapters over a (bf16) base


def lora_params(spec: ModelSpec, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> list[ParamInfo]:
    """The adapters as planner parameters (PEFT names, whole shapes, TP kinds), layer by layer."""
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"LoRA targets {list(targets)}: name one or more of {', '.join(LORA_TARGETS)}")
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    out = []
    for layer in range(spec.num_layers):
        for module in (m for m in LORA_TARGETS if m in targets):
            rows, cols = module_shape(spec, module)
            row_parallel = TARGETS[module].row_parallel
            a_kind = ShardKind.ROW if row_parallel else ShardKind.REPLICATED
            b_kind = ShardKind.REPLICATED if row_parallel else ShardKind.COLUMN
            name_a, name_b = peft_key(layer, module, "A"), peft_key(layer, module, "B")
            out.append(ParamInfo(name_a, a_kind, (rank, cols), layer, hf=(name_a,)))
            out.append(ParamInfo(name_b, b_kind, (rows, rank), layer, hf=(name_b,)))
    return out


@dataclass(frozen=True)
class LoraTransition:
    """The adapter-only transition next to the full one, for the same layouts."""

    rank: int
    targets: tuple[str, ...]
    lora: TransitionPlan
    full: TransitionPlan

    def summary(self, strategy: str = "hybridflow") -> dict:
        lora, full = self.lora.strategies[strategy], self.full.strategies[strategy]
        return {
            "rank": self.rank,
            "targets": list(self.targets),
            "strategy": strategy,
            "adapter_bytes": self.lora.model_bytes,
            "adapter_dtype_bytes": self.lora.dtype_bytes,
            "lora_recv_max": lora.comm_bytes_max,
            "lora_recv_mean": lora.comm_bytes_mean,
            "lora_held_max": lora.peak_param_bytes,
            "full_recv_max": full.comm_bytes_max,
            "full_recv_mean": full.comm_bytes_mean,
        }


def plan_lora_transition(
    spec: ModelSpec,
    train: ParallelLayout,
    t_g: int,
    p_g: int = 1,
    *,
    rank: int,
    targets: tuple[str, ...] = LORA_TARGETS,
    dtype: str = "bfloat16",
    adapter_dtype: str = ADAPTER_DTYPE,
    strategy: str = "hybridflow",
) -> LoraTransition:
    """Plan the adapters' transition (in `adapter_dtype`) and the full model's (in `dtype`)."""
    targets = tuple(m for m in LORA_TARGETS if m in targets) or tuple(targets)
    params = lora_params(spec, rank, targets)
    lora = plan_transition(spec, train, t_g, p_g, dtype=adapter_dtype, strategies=(strategy,), params=params)
    full = plan_transition(spec, train, t_g, p_g, dtype=dtype, strategies=(strategy,))
    return LoraTransition(rank, targets, lora, full)


def _size(nbytes: float) -> str:
    for name, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.3f} {name}"
    return f"{nbytes:.0f} B"


def format_lora(t: LoraTransition) -> str:
    """`rl3d plan`'s LoRA section: per-rank bytes of the adapter-only transition beside the full one."""
    s = t.summary()
    lora, full = t.lora.strategies[s["strategy"]], t.full.strategies[s["strategy"]]
    ratio = "n/a" if lora.comm_bytes_max == 0 else f"{full.comm_bytes_max / lora.comm_bytes_max:,.0f}x fewer"
    return "\n".join(
        [
            f"LoRA transition (rank {t.rank}, {', '.join(t.targets)}; adapters in {t.lora.dtype_bytes}-byte "
            f"floats, {_size(s['adapter_bytes'])} in all; the engine keeps the base):",
            f"{'':<14}{'recv max':>14}{'recv mean':>14}{'held':>14}   (per rank, {s['strategy']})",
            f"{'full model':<14}{_size(full.comm_bytes_max):>14}{_size(full.comm_bytes_mean):>14}"
            f"{_size(full.peak_param_bytes):>14}",
            f"{'adapters':<14}{_size(lora.comm_bytes_max):>14}{_size(lora.comm_bytes_mean):>14}"
            f"{_size(lora.peak_param_bytes):>14}   ({ratio} bytes received)",
        ]
    )
