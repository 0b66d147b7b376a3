"""The shapes of LoRA factors (pure Python): whole, or one TP shard split the way the actor
trains them (a column-parallel projection splits lora_B's output rows, a row-parallel one
lora_A's input columns, as the base layer is split)."""

from __future__ import annotations

from rl3d.models.lora_names import TARGETS
from rl3d.models.spec import ModelSpec


def module_shape(spec: ModelSpec, module: str) -> tuple[int, int]:
    """(out, in) of the HF projection `module` (q_proj ... down_proj)."""
    h, f = spec.hidden_size, spec.ffn_hidden_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_query_groups * spec.head_dim
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (f, h),
        "up_proj": (f, h),
        "down_proj": (h, f),
    }[module]


def factor_shapes(
    spec: ModelSpec, module: str, rank: int, num_shards: int = 1
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of (lora_A, lora_B) of `module` in one of `num_shards` TP shards (whole at 1)."""
    rows, cols = module_shape(spec, module)
    if TARGETS[module].row_parallel:
        return (rank, cols // num_shards), (rows, rank)
    return (rank, cols), (rows // num_shards, rank)
