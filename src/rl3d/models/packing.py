"""Packed micro-batches: a micro-batch's sequences concatenated, without pad tokens, into one row.

    row = pack_rows(micro["input_ids"], micro["attention_mask"], response_width=R)
    args, kwargs = packed_model_inputs(row, te=False)     # ids [1, N], positions [1, N], mask
    logits_BRV = unpack_response(output_1NV, row)         # the padded layout's response columns

Positions restart at 0 for every sequence (they count a sequence's real tokens, as the padded
path's `position_ids_of` does). With the Transformer Engine spec the boundaries go to megatron as
`PackedSeqParams` (THD, cu_seqlens) and its attention and RoPE honour them. The local spec (CPU)
has no THD support, so the same packed row gets a block-diagonal causal mask `[1, 1, N, N]`, and
`per_sequence_rope` hands megatron's RoPE each token's own position (megatron otherwise rotates by
the row's column index, which only gives the same attention up to fp32 rounding of larger angles).
Under sequence parallelism a row's length must be a multiple of the TP size: `pack_rows(...,
multiple=t)` appends pad tokens, which attend only among themselves and are never read.

Micro-batches (`packed_micro_batches`): under a token budget, first-fit decreasing finds how many
micro-batches the sequences need, and the tokens are then balanced over that many (longest
first, each to the lightest micro-batch it fits), so pipeline stages see micro-batches of
similar cost; without a budget, `micro_batch_size` sequences each, balanced by tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rl3d.utils.partition import balanced_partition

PACKED = "packed"  # DataBatch.info key of a micro-batch's PackedRow


@dataclass(frozen=True)
class PackedRow:
    input_ids_1N: torch.Tensor
    position_ids_1N: torch.Tensor
    cu_seqlens: torch.Tensor  # int32 [S + 1]: sequence s is columns cu_seqlens[s] .. cu_seqlens[s+1]-1
    max_seqlen: int
    # [B, R]: the packed column holding the padded layout's response column (P-1+r for token r).
    # A pad column maps to the sequence's last real token before it, so its values stay finite.
    response_index_BR: torch.Tensor
    num_pad: int = 0  # pad tokens after the sequences (the row's length a multiple of `multiple`)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_1N.shape[1])

    @property
    def num_real(self) -> int:
        return self.num_tokens - self.num_pad


def pack_rows(
    input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, *, response_width: int, multiple: int = 1
) -> PackedRow:
    """One packed row of the real tokens (attention_mask 1) of every sequence, in batch order,
    followed by pad tokens (id 0, position 0) up to a multiple of `multiple` tokens."""
    real_BT = attention_mask_BT.bool()
    lengths_B = real_BT.sum(1)
    count_BT = real_BT.long().cumsum(1)  # real tokens up to and including each column
    cu = torch.zeros(len(lengths_B) + 1, dtype=torch.int32, device=input_ids_BT.device)
    cu[1:] = lengths_B.cumsum(0)
    N = int(cu[-1])
    assert N > 0, "a micro-batch without tokens"
    T = input_ids_BT.shape[1]
    cols = count_BT[:, T - response_width - 1 : T - 1]  # the response slice of the padded layout
    index_BR = (cu[:-1, None].long() + (cols - 1).clamp(min=0)).clamp(max=N - 1)
    pad = -N % multiple
    pad_1K = input_ids_BT.new_zeros(1, pad)
    return PackedRow(
        input_ids_1N=torch.cat([input_ids_BT[real_BT][None], pad_1K], 1),
        position_ids_1N=torch.cat([(count_BT - 1)[real_BT][None], pad_1K], 1),
        cu_seqlens=cu,
        max_seqlen=int(lengths_B.max()),
        response_index_BR=index_BR,
        num_pad=pad,
    )


def segment_bounds(row: PackedRow) -> torch.Tensor:
    """int32 [S + 1] (or [S + 2] with pads): `cu_seqlens` with the pad tokens as one more
    segment, so the boundaries cover the whole row."""
    if not row.num_pad:
        return row.cu_seqlens
    end = row.cu_seqlens.new_tensor([row.num_tokens])
    return torch.cat([row.cu_seqlens, end])


def block_causal_mask(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[1, 1, N, N] bool, True = masked out: causal within each sequence, nothing across them."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_N = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    col = torch.arange(num_tokens, device=cu_seqlens.device)
    masked = (seq_N[:, None] != seq_N[None, :]) | (col[None, :] > col[:, None])
    return masked[None, None]


def packed_seq_params(row: PackedRow) -> Any:
    """megatron's THD boundaries of a packed row (Transformer Engine attention)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = segment_bounds(row)
    longest = max(row.max_seqlen, row.num_pad)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def packed_model_inputs(row: PackedRow, *, te: bool) -> tuple[tuple, dict]:
    """GPTModel's (input_ids, position_ids, attention_mask) and keyword arguments for a packed row."""
    if te:
        # GPU with the Transformer Engine spec. NOT EXERCISED by the CPU test suite (TE is not
        # installed there): THD attention and RoPE restart at every cu_seqlens boundary.
        return (row.input_ids_1N, row.position_ids_1N, None), {"packed_seq_params": packed_seq_params(row)}
    mask = block_causal_mask(segment_bounds(row), row.num_tokens)
    return (row.input_ids_1N, row.position_ids_1N, mask), {}


def unpack_response(output_1N: torch.Tensor, row: PackedRow) -> torch.Tensor:
    """[1, N, ...] model output -> [B, R, ...] in the padded layout's response columns."""
    return output_1N[0][row.response_index_BR]


@contextlib.contextmanager
def per_sequence_rope(model: Any, row: PackedRow) -> Iterator[None]:
    """While active, megatron's RoPE (local spec) rotates each token by its own sequence's
    position instead of its column in the packed row. Its output is `[N, 1, 1, dim]` for
    positions 0..N-1, and every per-sequence position is below N."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        yield
        return
    positions_N = row.position_ids_1N[0]

    def hook(module: Any, args: Any, emb: torch.Tensor) -> torch.Tensor:
        assert emb.shape[0] == row.num_tokens, (emb.shape, row.num_tokens)
        return emb[positions_N]

    handle = rope.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def packed_micro_batches(
    lengths: list[int], *, micro_batch_size: int, budget: int | None, key: str
) -> list[list[int]]:
    """Sample indices per packed micro-batch (indices within one ascend): under `budget`
    tokens each when set (`key` names it in the error), else `micro_batch_size` samples each;
    tokens balanced over the micro-batches either way."""
    if budget is not None:
        return token_budget_groups(lengths, budget, key=key)
    n = len(lengths)
    if n == 0:
        return []
    count = -(-n // micro_batch_size)
    if n % count:  # micro-batches of unequal size: keep the batch's order
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    parts = balanced_partition(lengths, count)
    assert parts is not None
    return parts


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Sample indices per group, each group's tokens at most `budget`, sequences taken longest
    first into the first group they fit (every length must be at most `budget`)."""
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g, load in enumerate(loads):
            if load + lengths[i] <= budget:
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    return [sorted(g) for g in groups]


def token_budget_groups(lengths: list[int], budget: int, *, key: str) -> list[list[int]]:
    """Sample indices per micro-batch, each group's tokens at most `budget`: as many groups as
    first-fit decreasing needs, then the tokens balanced over them (kept first-fit where the
    balancing cannot fit them); indices within a group ascend. `key` names the setting in the
    error."""
    too_long = [n for n in lengths if n > budget]
    if too_long:
        raise ValueError(f"a sequence of {max(too_long)} tokens exceeds {key}={budget}")
    groups = first_fit_decreasing(lengths, budget)
    balanced = balanced_partition(lengths, len(groups), equal_size=False, budget=budget)
    return balanced if balanced is not None else groups
