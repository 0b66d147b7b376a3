"""Resharding ops: one dispatch point per kernel (CUDA extension -> Triton -> torch reference).

`rl3d.ops.layouts` is the canonical layout contract every kernel is tested against. Importing
this package imports neither triton nor the CUDA extension; a call that chooses one does.
"""

from rl3d.ops.dispatch import (
    BACKEND_ENV,
    Backend,
    bucket_numel,
    gather_to_layout,
    pack_bucket,
    resolve_backend,
    strided_copy,
    unpack_bucket,
)
from rl3d.ops.gather import GatheredShards, ParamLayout, output_shape, split_hf
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
    "BACKEND_ENV",
    "Backend",
    "GatheredShards",
    "ParamLayout",
    "ShardKind",
    "bucket_numel",
    "fc1_hf_to_megatron",
    "fc1_megatron_to_hf",
    "gather_to_layout",
    "merge_tp_shards",
    "output_shape",
    "pack_bucket",
    "padded_vocab_size",
    "qkv_hf_to_megatron",
    "qkv_megatron_to_hf",
    "resolve_backend",
    "shard_for_tp",
    "split_hf",
    "strided_copy",
    "unpack_bucket",
]
