"""The canonical layout contract of Megatron parameter shards (plain torch).

Every other piece of rl3d (planner, executor, kernels, converters, rollout engine) agrees with
the functions here; the Triton/CUDA kernels in `kernels/` are checked against them bit for bit.

A "full" tensor is the Megatron layout at t=1 (vocab already padded). Kinds:

- REPLICATED: norms; every TP rank holds the whole tensor.
- COLUMN: split along dim 0 into t contiguous chunks.
- ROW: split along dim 1 into t contiguous chunks (linear_proj, linear_fc2).
- QKV: Megatron's fused QKV, interleaved per query group: dim 0 is
  [group 0: q heads of the group, k, v | group 1: ... ] x head_dim. TP splits whole groups, so a
  shard is a contiguous dim-0 chunk and consecutive shards concatenate into a coarser shard.
- SWIGLU_FC1: fused `linear_fc1` = [gate; up]. TP shard i is [gate_i; up_i], so consecutive
  shards do NOT concatenate into a coarser shard; they must be re-interleaved.
- VOCAB: vocab-parallel embedding / output layer, split along dim 0 of the padded vocab.
"""

from __future__ import annotations

import torch

# The kinds are defined torch-free (the planner imports them); re-exported here.
from rl3d.parallel.sharding import ShardKind, padded_vocab_size  # noqa: F401


def shard_for_tp(full: torch.Tensor, kind: ShardKind, tp_size: int, tp_rank: int) -> torch.Tensor:
    """The TP shard `tp_rank` of `tp_size` of a full Megatron tensor (a view where possible)."""
    assert 0 <= tp_rank < tp_size, (tp_rank, tp_size)
    if kind is ShardKind.REPLICATED or tp_size == 1:
        return full
    if kind is ShardKind.SWIGLU_FC1:
        assert full.shape[0] % (2 * tp_size) == 0, f"fc1 rows {full.shape[0]} vs tp={tp_size}"
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    dim = kind.tp_dim
    assert full.shape[dim] % tp_size == 0, f"{kind.value} dim {dim} of {tuple(full.shape)} vs tp={tp_size}"
    return full.chunk(tp_size, dim=dim)[tp_rank]


def merge_tp_shards(shards: list[torch.Tensor], kind: ShardKind) -> torch.Tensor:
    """Consecutive TP shards (in TP order) -> the coarser shard they make up together.

    With all t shards this rebuilds the full tensor; with the r = t/t_g shards of one micro-DP
    group it builds that group's generation-TP shard. This is the torch reference of
    `gather_to_layout` for the Megatron generation layout.
    """
    if kind is ShardKind.REPLICATED or len(shards) == 1:
        return shards[0]
    if kind is ShardKind.SWIGLU_FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=kind.tp_dim)


def qkv_megatron_to_hf(
    qkv: torch.Tensor, *, num_heads: int, num_query_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused, group-interleaved QKV -> HF (q, k, v). Works for weights [out, in] and biases [out],
    and on a TP shard when given that shard's head and group counts."""
    heads_per_group = num_heads // num_query_groups
    rows_per_group = heads_per_group + 2
    head_dim = qkv.shape[0] // (num_query_groups * rows_per_group)
    grouped = qkv.reshape(num_query_groups, rows_per_group, head_dim, *qkv.shape[1:])
    q = grouped[:, :heads_per_group].reshape(num_heads * head_dim, *qkv.shape[1:])
    k = grouped[:, heads_per_group].reshape(num_query_groups * head_dim, *qkv.shape[1:])
    v = grouped[:, heads_per_group + 1].reshape(num_query_groups * head_dim, *qkv.shape[1:])
    return q, k, v


def qkv_hf_to_megatron(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_heads: int, num_query_groups: int
) -> torch.Tensor:
    """HF (q, k, v) -> Megatron's fused QKV, interleaved per query group."""
    heads_per_group = num_heads // num_query_groups
    head_dim = q.shape[0] // num_heads
    rest = tuple(q.shape[1:])
    grouped = torch.cat(
        [
            q.reshape(num_query_groups, heads_per_group, head_dim, *rest),
            k.reshape(num_query_groups, 1, head_dim, *rest),
            v.reshape(num_query_groups, 1, head_dim, *rest),
        ],
        dim=1,
    )
    return grouped.reshape(-1, *rest)


def fc1_megatron_to_hf(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused `linear_fc1` [gate; up] (full or one TP shard) -> HF (gate_proj, up_proj)."""
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def fc1_hf_to_megatron(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)
