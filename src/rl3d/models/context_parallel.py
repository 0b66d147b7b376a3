"""A micro-batch under context parallelism: each CP rank's part of the sequence, and the model's
outputs gathered back into whole sequences.

Every CP rank of a replica holds the same micro-batch. Before the forward each keeps its part
of the sequence the way megatron splits it (`get_batch_on_this_cp_rank`: `2 * cp` chunks, rank
`r` holding chunks `r` and `2 * cp - 1 - r`, which balances causal attention's work), its queries'
rows of the `[B, 1, T, T]` mask with the keys in global order (what ring attention reads). The
last stage's output (logits, values) comes back whole with `gather_positions`, so that every
reader of it (log-probs, entropies, values, their losses and token counts) runs unchanged and
identically on every CP rank.

Gradients: the gather's backward keeps this rank's positions of the incoming gradient (every CP
rank computes the same loss over the whole sequence, and each back-propagates its own
positions), so a parameter's gradient on a CP rank is its positions' share and the shares sum
to the whole. megatron's schedule multiplies each loss by the CP size and its DDP averages
gradients over the `cp * d` ranks of the data-and-context group (`MegatronGroups.dp_cp_group`):
the result is the CP 1 gradient averaged over the `d` data replicas.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rl3d.models.ring_attention import cp_positions


def split_inputs(
    input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, mask_B1TT: torch.Tensor, *, cp: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This CP rank's tokens, positions and mask rows (keys whole) of a padded micro-batch."""
    pos = cp_positions(input_ids_BT.shape[1], cp, rank, device=input_ids_BT.device)
    return input_ids_BT[:, pos], position_ids_BT[:, pos], mask_B1TT[:, :, pos]


class _GatherPositions(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local_BL: torch.Tensor, group: Any, cp: int, rank: int) -> torch.Tensor:
        local = local_BL.contiguous()
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local, group=group)
        T = local.shape[1] * cp
        whole = local.new_empty((local.shape[0], T, *local.shape[2:]))
        for r, part in enumerate(parts):
            whole[:, cp_positions(T, cp, r, device=local.device)] = part
        ctx.pos = cp_positions(T, cp, rank, device=local.device)
        return whole

    @staticmethod
    def backward(ctx: Any, grad_BT: torch.Tensor):
        return grad_BT[:, ctx.pos].contiguous(), None, None, None


def gather_positions(local_BL: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, T/cp, ...] of this CP rank's positions -> [B, T, ...] in sequence order, the same on
    every rank of `group`; the backward keeps this rank's positions of the gradient."""
    cp = dist.get_world_size(group)
    return _GatherPositions.apply(local_BL, group, cp, dist.get_rank(group))
