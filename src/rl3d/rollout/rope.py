"""Rotary position embedding for the torch rollout engine: HF's default RoPE, as a table of
every position's cos and sin computed once, and its application to queries and keys.

Partial RoPE (GLM-4.5: `rotary_dim` = half the head width) turns the first `rotary_dim` channels
of each head, rotate-half style within them, and passes the rest through: the tables hold cos 1
and sin 0 there, so the same multiply-add leaves those channels exactly as they are."""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions_BT: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, rotary_dim: int | None = None
):
    R = rotary_dim or head_dim
    exponents = torch.arange(0, R, 2, dtype=torch.int64, device=positions_BT.device).float() / R
    inv_freq = 1.0 / (theta**exponents)  # as HF's default RoPE init computes it
    freqs = positions_BT.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # [B, 1, T, R] broadcast over heads
    cos, sin = emb.cos(), emb.sin()
    if R < head_dim:  # the channels RoPE passes through: cos 1, sin 0
        pad = (0, head_dim - R)
        cos, sin = torch.nn.functional.pad(cos, pad, value=1.0), torch.nn.functional.pad(sin, pad)
    return cos.to(dtype), sin.to(dtype)


def swap_halves_index(head_dim: int, rotary_dim: int | None = None, device=None) -> torch.Tensor:
    """Channel indices of one head that swap the halves of its first `rotary_dim` channels
    ([x2, x1, rest]); the channels past them stay (their sin is 0)."""
    R = rotary_dim or head_dim
    index = torch.arange(head_dim, device=device)
    index[:R] = index[:R].roll(R // 2)
    return index


class RopeTable:
    """cos and sin of every position in [0, num_positions), computed once, so that a forward
    only gathers its rows (elementwise, so each value equals `rope_cos_sin`'s for that position).
    The sin half that multiplies the rotated first half is stored negated: `rotate_half(x) * sin`
    == `swap_halves(x) * sin_signed` exactly, with one gather instead of three ops."""

    def __init__(
        self,
        num_positions: int,
        head_dim: int,
        theta: float,
        dtype: torch.dtype,
        device,
        rotary_dim: int | None = None,
    ):
        pos = torch.arange(num_positions, device=device).unsqueeze(0)
        cos, sin = rope_cos_sin(pos, head_dim, theta, dtype, rotary_dim)
        half = (rotary_dim or head_dim) // 2
        self.cos_PD = cos[0, 0]
        self.sin_PD = torch.cat([-sin[0, 0, :, :half], sin[0, 0, :, half:]], dim=-1)
        self.swap_D = swap_halves_index(head_dim, rotary_dim, cos.device)
        self.num_positions, self.dtype, self.device = num_positions, dtype, cos.device

        # decode: per position [cos; signed sin] for one KV group's rows of the fused qkv output
        # (heads_per_group queries, the key, the value): the value row gets cos 1, sin 0, so
        # RoPE applies to the whole qkv output at once and leaves the value unchanged
        self._decode: dict[int, torch.Tensor] = {}
        self._swap: dict[int, torch.Tensor] = {}

    def swap_index(self, width: int) -> torch.Tensor:
        """Column indices that swap the halves of every head_dim block of a [.., width] row:
        `x.index_select(-1, it)` is [x2, x1] per head, in one op."""
        index = self._swap.get(width)
        if index is None:
            D = self.cos_PD.shape[-1]
            col = torch.arange(width, device=self.device)
            self._swap[width] = index = col - col % D + self.swap_D[col % D]
        return index

    def decode_table(self, heads_per_group: int) -> torch.Tensor:
        """[positions, 2, heads_per_group + 2, head_dim]: cos, signed sin per row of a group."""
        table = self._decode.get(heads_per_group)
        if table is None:
            P, D = self.cos_PD.shape
            table = torch.zeros(P, 2, heads_per_group + 2, D, dtype=self.dtype, device=self.device)
            table[:, 0, : heads_per_group + 1] = self.cos_PD[:, None]
            table[:, 0, heads_per_group + 1] = 1
            table[:, 1, : heads_per_group + 1] = self.sin_PD[:, None]
            self._decode[heads_per_group] = table
        return table

    def gather(self, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin at `positions_BT`: [B, T, 1, 1, D], broadcast over (groups, heads)."""
        return self.cos_PD[positions_BT][:, :, None, None], self.sin_PD[positions_BT][:, :, None, None]


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, rotary_dim: int | None = None
) -> torch.Tensor:
    swap = swap_halves_index(x.shape[-1], rotary_dim, x.device)
    swapped = x.index_select(-1, swap)  # [x2, x1] (a gather: ~3x faster than flip on strided x)
    return x * cos + swapped * sin_signed
