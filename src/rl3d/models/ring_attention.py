"""Ring attention over the context-parallel group: megatron's core attention without Transformer Engine.

megatron-core's local `DotProductAttention` refuses `context_parallel_size > 1`; this module takes
its place in a GPT layer's `ModuleSpec` (same constructor and forward) and computes the same
attention when the sequence is split over a CP group the way megatron splits it
(`get_batch_on_this_cp_rank`: with `cp` ranks the sequence is cut into `2 * cp` chunks and rank `r`
holds chunks `r` and `2 * cp - 1 - r`, so causal work is balanced).

    out_sbh = ring_attention(q_sbnd, k_sbgd, v_sbgd, mask_b1qk, cp_group=group, softmax_scale=s)

Each rank keeps its queries and passes its keys and values around the ring, `cp - 1` steps of one
fused send/receive each (`batch_isend_irecv`, so NCCL pairs a step's send with its receive). Every
step gives a partial softmax over one block of keys (its output, and its log-sum-exp kept as row
maxima and row sums); the blocks are merged by their shares of the total sum of exponentials (the
online-softmax merge), which equals the softmax over all keys.

Masking follows megatron's local attention exactly: scaled scores where the mask is True are
filled with -10000 (not -inf), so a row whose keys are all masked (a left-padding query) gets the
same uniform weights it gets at CP 1. The mask is megatron's `[b, 1, sq, sk]` bool (True = masked)
with the keys in global order: either all rows (`sq` = the full sequence) or this rank's rows
(`get_batch_on_this_cp_rank` cuts `attention_mask` along dim 2 only). Without a mask the attention
is causal by global position.

The backward is autograd through the ring: the shift of keys and values is an autograd function
whose backward sends the gradient the other way round. The gradients are then those of the
forward's own arithmetic, exact by construction, at the cost of keeping every step's key and
value block for the backward (O(sequence) per rank, as the non-CP attention keeps too). A custom
backward that re-circulates the blocks would keep one; it is not written yet.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

MASKED_SCORE = -10000.0  # megatron's attention_mask_func fill value


def cp_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions of the tokens a CP rank holds, in its local order (megatron's split)."""
    assert seq_len % (2 * cp_size) == 0, f"sequence length {seq_len} not divisible by 2 * cp = {2 * cp_size}"
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


class _RingShift(torch.autograd.Function):
    """Send a tensor to the next rank of the ring and receive the previous rank's; the backward
    sends the gradient to the previous rank and receives the next rank's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _shift(x, group, +1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _shift(grad.contiguous(), ctx.group, -1), None


def _shift(x: torch.Tensor, group: dist.ProcessGroup, direction: int) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    dst = dist.get_global_rank(group, (rank + direction) % size)
    src = dist.get_global_rank(group, (rank - direction) % size)
    out = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.irecv, out, src, group=group),
        dist.P2POp(dist.isend, x.contiguous(), dst, group=group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


def _block(q_bnsd, k_bnsd, v_bnsd, masked_bnqk, scale):
    """One block's softmax output over its keys, its row maxima and its sums of exponentials.

    The log-sum-exp is kept as (max, sum) rather than one number: a fully masked row's scores are
    all -10000, where fp32 has a spacing of 1e-3, which a single log-sum-exp would round away. The
    maxima are constants of the autograd graph (softmax does not depend on the shift)."""
    scores = torch.matmul(q_bnsd, k_bnsd.transpose(-1, -2)) * scale
    scores = scores.masked_fill(masked_bnqk, MASKED_SCORE)
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v_bnsd) / row_sum, row_max, row_sum


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    cp_group: dist.ProcessGroup | None,
    softmax_scale: float,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys, in megatron's layouts.

    `query` [sq, b, np, hn], `key` and `value` [sk, b, ng, hn] (GQA: np a multiple of ng), this
    rank's part of the sequence in megatron's CP order; returns [sq, b, np * hn]. `cp_group` None
    (or of size 1) is plain attention."""
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
    s_local, b, np_, hn = query.shape
    seq_len = s_local * cp_size
    groups = np_ // key.size(2)
    q_pos = cp_positions(seq_len, cp_size, cp_rank, query.device)
    masked_q = _rows(attention_mask, q_pos, seq_len)
    q_bnsd = query.permute(1, 2, 0, 3)
    kv = torch.stack([key, value])  # one message per ring step
    blocks = []
    for step in range(cp_size):
        if step > 0:
            kv = _RingShift.apply(kv, cp_group)
        k_pos = cp_positions(seq_len, cp_size, (cp_rank - step) % cp_size, query.device)
        if masked_q is None:
            masked = (k_pos[None, :] > q_pos[:, None])[None, None]
        else:
            masked = masked_q[..., k_pos]
        k_bnsd, v_bnsd = (t.repeat_interleave(groups, dim=2).permute(1, 2, 0, 3) for t in kv.unbind(0))
        blocks.append(_block(q_bnsd, k_bnsd, v_bnsd, masked, softmax_scale))
    context = _merge(blocks)
    return context.permute(2, 0, 1, 3).reshape(s_local, b, np_ * hn)


def _merge(blocks):
    """The softmax over all keys from each block's (output, row max, row sum): each block is
    weighted by its share of the total sum of exponentials, taken relative to the largest max."""
    top = torch.stack([row_max for _, row_max, _ in blocks]).amax(dim=0)
    shares = [torch.exp(row_max - top) * row_sum for _, row_max, row_sum in blocks]
    total = sum(shares)
    return sum(share * out for share, (out, _, _) in zip(shares, blocks, strict=True)) / total


def _rows(mask: torch.Tensor | None, q_pos: torch.Tensor, seq_len: int) -> torch.Tensor | None:
    """The mask's rows of this rank's queries: all rows given are cut, this rank's rows kept."""
    if mask is None:
        return None
    assert mask.size(-1) == seq_len, f"mask has {mask.size(-1)} keys, the sequence {seq_len}"
    if mask.size(-2) == seq_len and q_pos.numel() != seq_len:
        mask = mask[..., q_pos, :]
    assert mask.size(-2) == q_pos.numel(), f"mask has {mask.size(-2)} rows, this rank {q_pos.numel()}"
    return mask.bool()


def ring_dot_product_attention_class() -> type:
    """`RingDotProductAttention`, built on first use so that importing this module needs no megatron.

    A drop-in for megatron's local `DotProductAttention` in a layer's `ModuleSpec` (same keyword
    constructor, same forward), taking its CP group from `pg_collection.cp`. Not implemented:
    dropout on the attention weights, packed sequences (`packed_seq_params`), attention bias,
    softmax offsets, sliding windows; each is refused rather than ignored."""
    global _RING_CLASS
    if _RING_CLASS is None:
        _RING_CLASS = _define_ring_class()
    return _RING_CLASS


_RING_CLASS: type | None = None


def _define_ring_class() -> type:
    import math

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.utils import divide

    class RingDotProductAttention(MegatronModule):
        def __init__(
            self,
            config,
            layer_number: int,
            attn_mask_type,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            cp_comm_type: str | None = None,
            pg_collection: ProcessGroupCollection | None = None,
        ):
            super().__init__(config=config)
            dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            if dropout:
                raise ValueError(f"ring attention has no attention dropout (got {dropout})")
            if config.softmax_type != "vanilla" or config.window_size is not None:
                raise ValueError("ring attention supports vanilla softmax over the full causal window only")
            if pg_collection is None:
                pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
            self.cp_group = pg_collection.cp
            self.attn_mask_type = attn_mask_type
            self.layer_number = max(1, layer_number)
            projection = config.kv_channels * config.num_attention_heads
            head_dim = divide(projection, config.num_attention_heads)
            # query-key layer scaling divides the scale by the layer number and multiplies the
            # scores back inside the softmax: the same scale, so it is not applied here
            self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            if packed_seq_params is not None or attention_bias is not None:
                raise NotImplementedError("ring attention: no packed sequences, no attention bias")
            return ring_attention(
                query, key, value, attention_mask, cp_group=self.cp_group, softmax_scale=self.softmax_scale
            )

    return RingDotProductAttention


def with_ring_attention(layer_spec: Any) -> Any:
    """A copy of a local GPT layer spec (megatron's `get_gpt_layer_local_spec`) whose core
    attention is `RingDotProductAttention`; everything else is shared with `layer_spec`."""
    import copy

    spec = copy.copy(layer_spec)
    spec.submodules = copy.copy(layer_spec.submodules)
    attention = copy.copy(spec.submodules.self_attention)
    attention.submodules = copy.copy(attention.submodules)
    attention.submodules.core_attention = ring_dot_product_attention_class()
    spec.submodules.self_attention = attention
    return spec
