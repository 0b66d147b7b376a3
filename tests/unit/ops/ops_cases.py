"""Full Megatron tensors of each shard kind and their expected generation shards, computed from
`rl3d.ops.layouts` only (the contract), for the resharding-kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl3d.ops import GatheredShards, ParamLayout, ShardKind, padded_vocab_size, shard_for_tp
from rl3d.ops.layouts import qkv_megatron_to_hf


@dataclass(frozen=True)
class Case:
    layout: ParamLayout
    full: torch.Tensor  # the Megatron tensor at t=1 (vocab padded for train_tp)
    train_tp: int
    gen_tp: int
    gen_rank: int
    target: str

    @property
    def num_shards(self) -> int:
        return max(1, self.train_tp // self.gen_tp)

    @property
    def first_shard(self) -> int:
        return self.gen_rank * self.train_tp // self.gen_tp

    def shards(self) -> list[torch.Tensor]:
        return [
            shard_for_tp(self.full, self.layout.kind, self.train_tp, rank).contiguous()
            for rank in range(self.first_shard, self.first_shard + self.num_shards)
        ]

    def gathered(self, gap: int = 0, offset: int = 0) -> GatheredShards:
        """The shards in one flat buffer, `gap` spare elements after each, as an all-gather of
        packed buckets leaves them."""
        shards = self.shards()
        numel = shards[0].numel()
        buffer = torch.full((offset + len(shards) * (numel + gap),), -7, dtype=self.full.dtype)
        for index, shard in enumerate(shards):
            start = offset + index * (numel + gap)
            buffer[start : start + numel] = shard.reshape(-1)
        return GatheredShards(buffer, tuple(shards[0].shape), len(shards), offset=offset, stride=numel + gap)

    def expected(self) -> torch.Tensor:
        """The fused output, from the full tensor: generation shard, then the HF conversion."""
        kind, layout = self.layout.kind, self.layout
        if kind is ShardKind.QKV and self.target == "hf":
            return torch.cat(expected_hf_qkv(self.full, layout, self.gen_tp, self.gen_rank), dim=0)
        gen_shard = shard_for_tp(self.full, kind, self.gen_tp, self.gen_rank)
        if kind is ShardKind.VOCAB and self.target == "hf":
            rows = gen_shard.shape[0]
            first = self.gen_rank * rows
            return gen_shard[: max(0, min(rows, layout.vocab_size - first))]
        return gen_shard


def expected_hf_qkv(
    full: torch.Tensor, layout: ParamLayout, gen_tp: int, gen_rank: int
) -> tuple[torch.Tensor, ...]:
    """What SGLang/vLLM put on generation rank `gen_rank`: its q heads, and its KV heads
    (KV head gen_rank * G // gen_tp, replicated, once gen_tp exceeds the KV heads)."""
    heads, groups = layout.num_heads, layout.num_query_groups
    q, k, v = qkv_megatron_to_hf(full, num_heads=heads, num_query_groups=groups)
    head_dim = q.shape[0] // heads
    num_q = heads // gen_tp
    num_kv = max(1, groups // gen_tp)
    first_kv = gen_rank * groups // gen_tp
    q_rows = slice(gen_rank * num_q * head_dim, (gen_rank + 1) * num_q * head_dim)
    kv_rows = slice(first_kv * head_dim, (first_kv + num_kv) * head_dim)
    return q[q_rows], k[kv_rows], v[kv_rows]


def full_tensor(
    layout: ParamLayout, *, rows_unit: int, cols: int, train_tp: int, dtype: torch.dtype, seed: int = 0
) -> torch.Tensor:
    """A random full tensor of `layout.kind`. `rows_unit` is head_dim for QKV and the per-rank row
    count otherwise; cols=0 makes a 1-D tensor (a bias)."""
    generator = torch.Generator().manual_seed(seed)
    kind = layout.kind
    if kind is ShardKind.QKV:
        rows = layout.num_query_groups * (layout.heads_per_group + 2) * rows_unit
    elif kind is ShardKind.VOCAB:
        rows = padded_vocab_size(layout.vocab_size, train_tp, divisible_by=rows_unit)
    elif kind is ShardKind.SWIGLU_FC1:
        rows = 2 * train_tp * rows_unit
    else:
        rows = train_tp * rows_unit
    if kind is ShardKind.ROW:
        shape = (rows_unit, train_tp * max(cols, 1))
    else:
        shape = (rows, cols) if cols else (rows,)
    values = torch.randn(shape, generator=generator) * 3
    return values.to(dtype)
