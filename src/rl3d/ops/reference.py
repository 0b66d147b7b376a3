"""The plain torch form of every resharding kernel: the definition the Triton and CUDA forms
are tested against, and what runs wherever there is no GPU.

`gather_to_layout_into` is written from `rl3d.ops.layouts` (merge_tp_shards,
qkv_megatron_to_hf, fc1_megatron_to_hf), independently of the view plan the compiled forms share,
so a mistake in that plan shows up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rl3d.ops.gather import GatheredShards, ParamLayout, as_shard_list, kept_vocab_rows, qkv_gen_heads
from rl3d.ops.layouts import ShardKind, merge_tp_shards, qkv_megatron_to_hf


def pack_bucket_into(tensors: Sequence[torch.Tensor], bucket: torch.Tensor) -> None:
    offset = 0
    for tensor in tensors:
        numel = tensor.numel()
        bucket[offset : offset + numel].view(tensor.shape).copy_(tensor)
        offset += numel


def unpack_bucket_into(bucket: torch.Tensor, destinations: Sequence[torch.Tensor]) -> None:
    offset = 0
    for destination in destinations:
        numel = destination.numel()
        destination.copy_(bucket[offset : offset + numel].view(destination.shape))
        offset += numel


def strided_copy_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


def gather_to_layout_into(
    shards: Sequence[torch.Tensor] | GatheredShards,
    layout: ParamLayout,
    *,
    train_tp: int,
    gen_tp: int,
    gen_rank: int,
    target: str,
    out: torch.Tensor,
) -> None:
    kind = layout.kind
    shards = as_shard_list(shards)
    if kind is ShardKind.QKV and gen_tp > train_tp:
        result = _qkv_replicated_kv(shards[0], layout, train_tp, gen_tp, gen_rank)
    else:
        merged = merge_tp_shards(shards, kind)
        result = merged
        if target == "hf" and kind is ShardKind.QKV:
            q, k, v = qkv_megatron_to_hf(
                merged,
                num_heads=layout.num_heads // gen_tp,
                num_query_groups=layout.num_query_groups // gen_tp,
            )
            result = torch.cat([q, k, v], dim=0)
        elif kind is ShardKind.VOCAB:
            result = merged[: kept_vocab_rows(layout, merged.shape[0], gen_rank, target)]
    out.copy_(result)


def _qkv_replicated_kv(
    source: torch.Tensor, layout: ParamLayout, train_tp: int, gen_tp: int, gen_rank: int
) -> torch.Tensor:
    """Generation rank `gen_rank`'s [q; k; v] cut out of one coarser training shard."""
    source_rank = gen_rank * train_tp // gen_tp
    source_heads = layout.num_heads // train_tp
    source_groups = layout.num_query_groups // train_tp
    q, k, v = qkv_megatron_to_hf(source, num_heads=source_heads, num_query_groups=source_groups)
    head_dim = q.shape[0] // source_heads
    num_q, num_kv = qkv_gen_heads(layout, gen_tp)
    first_q = gen_rank * num_q - source_rank * source_heads
    first_kv = gen_rank * layout.num_query_groups // gen_tp - source_rank * source_groups
    q_rows = slice(first_q * head_dim, (first_q + num_q) * head_dim)
    kv_rows = slice(first_kv * head_dim, (first_kv + num_kv) * head_dim)
    return torch.cat([q[q_rows], k[kv_rows], v[kv_rows]], dim=0)
