"""Resharding ops: one dispatch point per kernel (CUDA extension -> Triton -> torch reference).

`rl3d.ops.layouts` is the canonical layout contract every kernel is tested against.
"""

from rl3d.ops.layouts import (
    ShardKind,
    fc1_hf_to_megatron,
    fc1_megatron_to_hf,
    merge_tp_shards,
    padded_vocab_size,
    qkv_hf_to_megatron,
    qkv_megatron_to_hf,
    shard_for_tp,
)

__all__ = [
    "ShardKind",
    "fc1_hf_to_megatron",
    "fc1_megatron_to_hf",
    "merge_tp_shards",
    "padded_vocab_size",
    "qkv_hf_to_megatron",
    "qkv_megatron_to_hf",
    "shard_for_tp",
]
