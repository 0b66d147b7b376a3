"""What `gather_to_layout` consumes and produces, shared by all three kernel forms.

The r = train_tp / gen_tp shards of one parameter that a micro-DP group all-gathers are
training-TP ranks `gen_rank*r .. gen_rank*r + r - 1`; together they make up generation-TP shard
`gen_rank`. They reach `gather_to_layout` either as a list of tensors or, with no extra copy, as
`GatheredShards`: a window into the flat all-gather output buffer.

The output is always one fused tensor (`output_shape`). Target "megatron" is the generation-TP
Megatron shard (`merge_tp_shards`). Target "hf" is the same bytes the HF-named engines keep in
their fused parameters (vLLM/SGLang `qkv_proj` = [q; k; v], `gate_up_proj` = [gate; up]), with
vocab padding removed; `split_hf` cuts it into the HF tensors as views.

KV-head replication (gen_tp > num_query_groups, as SGLang/vLLM do): Megatron training never
shards finer than the query groups, so gen_tp > train_tp there. Then `shards` is the single
training shard `gen_rank * train_tp // gen_tp` (train_tp=1: the full-model tensor), and generation
rank a keeps its H/gen_tp query heads and the KV head `a * num_query_groups // gen_tp`. Only
QKV with target "hf" accepts gen_tp > train_tp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rl3d.ops.layouts import ShardKind

TARGETS = ("megatron", "hf")


@dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """How one parameter is sharded. Head counts are the full model's; `vocab_size` is the true
    (unpadded) vocabulary, used by target "hf" to drop the padding rows (0 keeps them)."""

    kind: ShardKind
    num_heads: int = 0
    num_query_groups: int = 0
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.kind is ShardKind.QKV:
            if self.num_heads <= 0 or self.num_query_groups <= 0:
                raise ValueError("ParamLayout.num_heads and .num_query_groups are required for QKV")
            if self.num_heads % self.num_query_groups:
                raise ValueError(
                    f"ParamLayout.num_heads={self.num_heads} is not a multiple of "
                    f"num_query_groups={self.num_query_groups}"
                )

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups


@dataclass(frozen=True)
class GatheredShards:
    """`num_shards` equally shaped shards in one flat buffer; shard b is
    `buffer[offset + b*stride : ... + numel(shard_shape)]` viewed as `shard_shape`.
    `stride=0` means tightly packed (stride = numel of one shard)."""

    buffer: torch.Tensor
    shard_shape: tuple[int, ...]
    num_shards: int
    offset: int = 0
    stride: int = 0

    def __post_init__(self) -> None:
        if self.buffer.dim() != 1 or not self.buffer.is_contiguous():
            raise ValueError("GatheredShards.buffer must be a contiguous 1-D tensor")
        end = self.offset + (self.num_shards - 1) * self.shard_stride + self.shard_numel
        if self.offset < 0 or self.shard_stride < self.shard_numel or end > self.buffer.numel():
            raise ValueError(
                f"GatheredShards window (offset={self.offset}, stride={self.shard_stride}, "
                f"{self.num_shards} x {self.shard_shape}) exceeds the buffer of {self.buffer.numel()}"
            )

    @property
    def shard_numel(self) -> int:
        return int(torch.Size(self.shard_shape).numel())

    @property
    def shard_stride(self) -> int:
        return self.stride or self.shard_numel

    def stacked(self) -> torch.Tensor:
        """A [num_shards, *shard_shape] view of the buffer (no copy)."""
        inner = torch.empty(self.shard_shape, device="meta").stride()
        return self.buffer.as_strided(
            (self.num_shards, *self.shard_shape),
            (self.shard_stride, *inner),
            self.buffer.storage_offset() + self.offset,
        )

    def shards(self) -> list[torch.Tensor]:
        return list(self.stacked().unbind(0))


def as_shard_list(shards: Sequence[torch.Tensor] | GatheredShards) -> list[torch.Tensor]:
    if isinstance(shards, GatheredShards):
        return shards.shards()
    return list(shards)


def shard_shape_of(shards: Sequence[torch.Tensor] | GatheredShards) -> tuple[int, ...]:
    if isinstance(shards, GatheredShards):
        return tuple(shards.shard_shape)
    shapes = {tuple(s.shape) for s in shards}
    if not shapes:
        raise ValueError("gather_to_layout: no shards")
    if len(shapes) != 1:
        raise ValueError(f"gather_to_layout: shards differ in shape: {sorted(shapes)}")
    return shapes.pop()


def num_shards_of(shards: Sequence[torch.Tensor] | GatheredShards) -> int:
    return shards.num_shards if isinstance(shards, GatheredShards) else len(shards)


def check_gather_args(
    layout: ParamLayout,
    shard_shape: tuple[int, ...],
    num_shards: int,
    train_tp: int,
    gen_tp: int,
    gen_rank: int,
    target: str,
) -> None:
    """User errors in the resharding arguments, with the argument named."""
    _check_shard_shape(layout, shard_shape, train_tp)
    if target not in TARGETS:
        raise ValueError(f"gather_to_layout: target={target!r} is not one of {TARGETS}")
    if not 0 <= gen_rank < gen_tp:
        raise ValueError(f"gather_to_layout: gen_rank={gen_rank} is outside gen_tp={gen_tp}")
    if gen_tp > train_tp:
        if layout.kind is not ShardKind.QKV or target != "hf":
            raise ValueError(
                f"gather_to_layout: gen_tp={gen_tp} > train_tp={train_tp} is only supported for "
                "QKV with target='hf' (KV-head replication)"
            )
        if gen_tp % train_tp or num_shards != 1:
            raise ValueError(
                f"gather_to_layout: gen_tp={gen_tp} > train_tp={train_tp} needs gen_tp % train_tp == 0 "
                f"and exactly one source shard, got {num_shards}"
            )
        groups, heads = layout.num_query_groups, layout.num_heads
        if gen_tp > groups and (gen_tp % groups or heads % gen_tp):
            raise ValueError(
                f"gather_to_layout: gen_tp={gen_tp} must be a multiple of num_query_groups={groups} "
                f"and divide num_heads={heads}"
            )
        if gen_tp <= groups and groups % gen_tp:
            raise ValueError(f"gather_to_layout: gen_tp={gen_tp} does not divide num_query_groups={groups}")
        return
    if train_tp % gen_tp:
        raise ValueError(f"gather_to_layout: gen_tp={gen_tp} does not divide train_tp={train_tp}")
    if num_shards != train_tp // gen_tp:
        raise ValueError(
            f"gather_to_layout: expected r = train_tp/gen_tp = {train_tp // gen_tp} shards, got {num_shards}"
        )
    if layout.kind is ShardKind.QKV and layout.num_query_groups % train_tp:
        raise ValueError(
            f"gather_to_layout: train_tp={train_tp} does not divide "
            f"num_query_groups={layout.num_query_groups}"
        )


def _check_shard_shape(layout: ParamLayout, shard_shape: tuple[int, ...], train_tp: int) -> None:
    kind, rows = layout.kind, shard_shape[0] if shard_shape else 0
    if kind is ShardKind.ROW and len(shard_shape) < 2:
        raise ValueError(f"gather_to_layout: a ROW shard needs 2 dims, got {shard_shape}")
    if kind is ShardKind.SWIGLU_FC1 and rows % 2:
        raise ValueError(f"gather_to_layout: a SwiGLU fc1 shard needs an even row count, got {shard_shape}")
    if kind is ShardKind.QKV:
        group_rows = layout.num_query_groups // max(train_tp, 1) * (layout.heads_per_group + 2)
        if group_rows == 0 or rows % group_rows:
            raise ValueError(
                f"gather_to_layout: QKV shard rows {rows} are not (heads/group + 2) x groups x head_dim "
                f"for {layout.num_heads} heads, {layout.num_query_groups} groups at train_tp={train_tp}"
            )


def kept_vocab_rows(layout: ParamLayout, gen_shard_rows: int, gen_rank: int, target: str) -> int:
    """Rows of a vocab-parallel generation shard that survive removing the padding."""
    if target != "hf" or layout.kind is not ShardKind.VOCAB or layout.vocab_size <= 0:
        return gen_shard_rows
    return max(0, min(gen_shard_rows, layout.vocab_size - gen_rank * gen_shard_rows))


def qkv_gen_heads(layout: ParamLayout, gen_tp: int) -> tuple[int, int]:
    """(query heads, KV heads) that one generation-TP rank holds, KV heads replicated if needed."""
    return layout.num_heads // gen_tp, max(1, layout.num_query_groups // gen_tp)


def output_shape(
    layout: ParamLayout,
    shard_shape: tuple[int, ...],
    num_shards: int,
    train_tp: int,
    gen_tp: int,
    gen_rank: int,
    target: str,
) -> tuple[int, ...]:
    """Shape of the fused generation tensor that `gather_to_layout` writes."""
    rows, rest = shard_shape[0], tuple(shard_shape[1:])
    kind = layout.kind
    if kind is ShardKind.REPLICATED:
        return tuple(shard_shape)
    if kind is ShardKind.ROW:
        return (rows, rest[0] * num_shards, *rest[1:])
    if kind is ShardKind.QKV and gen_tp > train_tp:
        num_q, num_kv = qkv_gen_heads(layout, gen_tp)
        head_dim = rows * train_tp // (layout.num_query_groups * (layout.heads_per_group + 2))
        return ((num_q + 2 * num_kv) * head_dim, *rest)
    gen_rows = rows * num_shards
    return (kept_vocab_rows(layout, gen_rows, gen_rank, target), *rest)


def split_hf(fused: torch.Tensor, layout: ParamLayout, gen_tp: int) -> tuple[torch.Tensor, ...]:
    """The HF tensors of a fused "hf" output, as row views: (q, k, v) for QKV, (gate, up) for
    SwiGLU fc1, (fused,) for everything else."""
    if layout.kind is ShardKind.SWIGLU_FC1:
        return tuple(fused.chunk(2, dim=0))
    if layout.kind is ShardKind.QKV:
        num_q, num_kv = qkv_gen_heads(layout, gen_tp)
        head_dim = fused.shape[0] // (num_q + 2 * num_kv)
        return tuple(fused.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=0))
    return (fused,)
