"""The view plan shared by the Triton and CUDA forms: every resharding op is a few strided copies.

`gather_copy_pairs` turns one `gather_to_layout` call into (source view, destination view) pairs
built with torch view ops only (no data moves), and `copy_blocks` reduces each pair to copies of
at most three dimensions, which is what the kernels take. Merging dimensions first keeps the
innermost run as long as possible, so the kernels read and write long contiguous rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rl3d.ops.gather import GatheredShards, ParamLayout, num_shards_of, qkv_gen_heads
from rl3d.ops.layouts import ShardKind

MAX_KERNEL_DIMS = 3


@dataclass(frozen=True)
class CopyBlock:
    """dst[b, i, j] = src[b, i, j] over `sizes`, both addressed from their own data pointer by
    element strides. `src` and `dst` are the tensors whose data pointers the kernel starts from."""

    src: torch.Tensor
    dst: torch.Tensor
    sizes: tuple[int, int, int]
    src_strides: tuple[int, int, int]
    dst_strides: tuple[int, int, int]

    @property
    def numel(self) -> int:
        return self.sizes[0] * self.sizes[1] * self.sizes[2]


def coalesce(
    sizes: tuple[int, ...], src_strides: tuple[int, ...], dst_strides: tuple[int, ...]
) -> tuple[list[int], list[int], list[int]]:
    """Drop size-1 dimensions and merge neighbours that are contiguous with each other on both sides."""
    dims = [(n, s, d) for n, s, d in zip(sizes, src_strides, dst_strides) if n != 1]
    merged: list[list[int]] = []
    for size, src_stride, dst_stride in reversed(dims):
        if merged:
            inner_size, inner_src, inner_dst = merged[-1]
            if src_stride == inner_size * inner_src and dst_stride == inner_size * inner_dst:
                merged[-1] = [size * inner_size, inner_src, inner_dst]
                continue
        merged.append([size, src_stride, dst_stride])
    merged.reverse()
    return [m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged]


def copy_blocks(src: torch.Tensor, dst: torch.Tensor) -> list[CopyBlock]:
    """`dst.copy_(src)` (same shape) as kernel-sized blocks of at most three dimensions."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"strided_copy: shapes differ: {tuple(src.shape)} vs {tuple(dst.shape)}")
    if src.numel() == 0:
        return []
    sizes, src_strides, dst_strides = coalesce(tuple(src.shape), src.stride(), dst.stride())
    if len(sizes) > MAX_KERNEL_DIMS:
        # Rare (only exotic views): peel the outermost dimension off until three are left.
        src_view = src.as_strided(sizes, src_strides)
        dst_view = dst.as_strided(sizes, dst_strides)
        return [block for i in range(sizes[0]) for block in copy_blocks(src_view[i], dst_view[i])]
    pad = MAX_KERNEL_DIMS - len(sizes)
    return [
        CopyBlock(
            src=src,
            dst=dst,
            sizes=tuple([1] * pad + sizes),
            src_strides=tuple([0] * pad + src_strides),
            dst_strides=tuple([0] * pad + dst_strides),
        )
    ]


def gather_copy_pairs(
    stacked: torch.Tensor,
    first_shard: int,
    num_shards: int,
    layout: ParamLayout,
    *,
    train_tp: int,
    gen_tp: int,
    gen_rank: int,
    target: str,
    out: torch.Tensor,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Source/destination view pairs that write the part of `out` coming from `stacked`, which holds
    shards `first_shard ..` (of `num_shards` in the group) as [n, rows, ...]."""
    kind = layout.kind
    count, rows = stacked.shape[0], stacked.shape[1]
    if kind is ShardKind.REPLICATED:
        return [(stacked[0], out)] if first_shard == 0 else []
    if kind is ShardKind.ROW:
        cols = stacked.shape[2]
        out_by_shard = out.unflatten(1, (num_shards, cols)).narrow(1, first_shard, count)
        return [(stacked, out_by_shard.transpose(0, 1))]
    if kind is ShardKind.SWIGLU_FC1:
        half = rows // 2
        out_halves = out.unflatten(0, (2, num_shards, half)).narrow(1, first_shard, count)
        return [(stacked.unflatten(1, (2, half)), out_halves.transpose(0, 1))]
    if kind is ShardKind.QKV and target == "hf":
        return _qkv_hf_pairs(stacked, first_shard, num_shards, layout, train_tp, gen_tp, gen_rank, out)
    # COLUMN, VOCAB and Megatron QKV: shards concatenate; padding rows past `out` are dropped, so
    # a prefix of whole shards goes as one [n, rows, ...] copy and at most one shard is cut short.
    start = first_shard * rows
    kept_rows = max(0, min(count * rows, out.shape[0] - start))
    whole, rest = divmod(kept_rows, rows)
    pairs = []
    if whole:
        pairs.append((stacked[:whole], out.narrow(0, start, whole * rows).unflatten(0, (whole, rows))))
    if rest:
        pairs.append((stacked[whole, :rest], out.narrow(0, start + whole * rows, rest)))
    return pairs


def _qkv_hf_pairs(
    stacked: torch.Tensor,
    first_shard: int,
    num_shards: int,
    layout: ParamLayout,
    train_tp: int,
    gen_tp: int,
    gen_rank: int,
    out: torch.Tensor,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    count, rows = stacked.shape[0], stacked.shape[1]
    heads_per_group = layout.heads_per_group
    source_groups = layout.num_query_groups // train_tp
    head_dim = rows // (source_groups * (heads_per_group + 2))
    # [shard, group, slot, head_dim, ...]: slots 0..hpg-1 are q heads, then k, then v.
    grouped = stacked.unflatten(1, (source_groups, heads_per_group + 2, head_dim))
    if gen_tp <= train_tp:
        groups, q_heads = num_shards * source_groups, heads_per_group
        q_rows, kv_rows = groups * q_heads * head_dim, groups * head_dim
        out_q = out.narrow(0, 0, q_rows).unflatten(0, (num_shards, source_groups, q_heads, head_dim))
        out_k = out.narrow(0, q_rows, kv_rows).unflatten(0, (num_shards, source_groups, head_dim))
        out_v = out.narrow(0, q_rows + kv_rows, kv_rows).unflatten(0, (num_shards, source_groups, head_dim))
        window = slice(first_shard, first_shard + count)
        return [
            (grouped[:, :, :heads_per_group], out_q[window]),
            (grouped[:, :, heads_per_group], out_k[window]),
            (grouped[:, :, heads_per_group + 1], out_v[window]),
        ]
    # KV-head replication: one coarser source shard; keep a window of groups and of q heads.
    num_q, num_kv = qkv_gen_heads(layout, gen_tp)
    source_rank = gen_rank * train_tp // gen_tp
    first_group = gen_rank * layout.num_query_groups // gen_tp - source_rank * source_groups
    q_heads = min(num_q, heads_per_group)
    first_head = gen_rank * num_q % heads_per_group
    source = grouped[0, first_group : first_group + num_kv]
    q_rows, kv_rows = num_kv * q_heads * head_dim, num_kv * head_dim
    out_q = out.narrow(0, 0, q_rows).unflatten(0, (num_kv, q_heads, head_dim))
    out_k = out.narrow(0, q_rows, kv_rows).unflatten(0, (num_kv, head_dim))
    out_v = out.narrow(0, q_rows + kv_rows, kv_rows).unflatten(0, (num_kv, head_dim))
    return [
        (source[:, first_head : first_head + q_heads], out_q),
        (source[:, heads_per_group], out_k),
        (source[:, heads_per_group + 1], out_v),
    ]


def stacked_sources(shards: Sequence[torch.Tensor] | GatheredShards) -> list[tuple[int, torch.Tensor]]:
    """(first shard index, [n, ...] view) pieces: the whole window of a gathered buffer at once,
    or one piece per separately allocated shard."""
    if isinstance(shards, GatheredShards):
        return [(0, shards.stacked())]
    return [(index, shard.unsqueeze(0)) for index, shard in enumerate(shards)]


def gather_blocks(
    shards: Sequence[torch.Tensor] | GatheredShards,
    layout: ParamLayout,
    *,
    train_tp: int,
    gen_tp: int,
    gen_rank: int,
    target: str,
    out: torch.Tensor,
) -> list[CopyBlock]:
    num_shards = num_shards_of(shards)
    blocks = []
    for first_shard, stacked in stacked_sources(shards):
        pairs = gather_copy_pairs(
            stacked, first_shard, num_shards, layout,
            train_tp=train_tp, gen_tp=gen_tp, gen_rank=gen_rank, target=target, out=out,
        )  # fmt: skip
        blocks.extend(block for src, dst in pairs for block in copy_blocks(src, dst))
    return blocks


def pack_blocks(tensors: Sequence[torch.Tensor], bucket: torch.Tensor) -> list[CopyBlock]:
    blocks, offset = [], 0
    for tensor in tensors:
        numel = tensor.numel()
        blocks.extend(copy_blocks(tensor, bucket[offset : offset + numel].view(tensor.shape)))
        offset += numel
    return blocks


def unpack_blocks(bucket: torch.Tensor, destinations: Sequence[torch.Tensor]) -> list[CopyBlock]:
    blocks, offset = [], 0
    for destination in destinations:
        numel = destination.numel()
        blocks.extend(copy_blocks(bucket[offset : offset + numel].view(destination.shape), destination))
        offset += numel
    return blocks


class BlockOps:
    """The four resharding ops of a form that only knows how to run copy blocks (the Triton and
    CUDA forms): each op plans its blocks here, and `run` executes them."""

    def __init__(self, run: Callable[[list[CopyBlock]], None]):
        self.run = run

    def strided_copy_into(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.run(copy_blocks(src, dst))

    def pack_bucket_into(self, tensors: Sequence[torch.Tensor], bucket: torch.Tensor) -> None:
        self.run(pack_blocks(tensors, bucket))

    def unpack_bucket_into(self, bucket: torch.Tensor, destinations: Sequence[torch.Tensor]) -> None:
        self.run(unpack_blocks(bucket, destinations))

    def gather_to_layout_into(
        self,
        shards: Sequence[torch.Tensor] | GatheredShards,
        layout: ParamLayout,
        *,
        train_tp: int,
        gen_tp: int,
        gen_rank: int,
        target: str,
        out: torch.Tensor,
    ) -> None:
        self.run(
            gather_blocks(
                shards, layout, train_tp=train_tp, gen_tp=gen_tp, gen_rank=gen_rank, target=target, out=out
            )
        )
