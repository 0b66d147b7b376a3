"""A preallocated KV cache: [layers, rows, kv_heads_local, slots, head_dim] for K and for V
(views of buffers laid out [..., head_dim, slots]).

Rows are sequences, slots are token positions in the left-padded batch. The active sequences
always occupy rows [0, n): when some finish, `compact` moves the survivors to the front (one
in-place copy per layer), so every later step computes on n rows only. The buffers are kept
between `generate` calls and grow only when a batch needs more rows or slots.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype, device):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        # one buffer [layers, rows, kv_heads, 2 (K, V), head_dim, slots]; `k` and `v` are its
        # [layers, rows, kv_heads, slots, head_dim] views. A decode step writes a token's K and V
        # with one copy, and its q @ K^T and p @ V read memory as CPU batched GEMMs like best.
        self.kv: torch.Tensor | None = None
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.capacity = (0, 0)  # (rows, slots) of the current buffers, kept across release

    @property
    def allocated(self) -> bool:
        return self.kv is not None

    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def reserve(self, rows: int, slots: int) -> None:
        """Make room for `rows` sequences of `slots` tokens (reallocates only to grow)."""
        have_rows, have_slots = self.capacity if self.allocated else (0, 0)
        if rows <= have_rows and slots <= have_slots:
            return
        rows, slots = max(rows, have_rows), max(slots, have_slots)
        shape = (self.num_layers, rows, self.kv_heads, 2, self.head_dim, slots)
        self.kv = self.k = self.v = None  # drop the old buffer before allocating the new one
        self.kv = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.k = self.kv[:, :, :, 0].transpose(-1, -2)
        self.v = self.kv[:, :, :, 1].transpose(-1, -2)
        self.capacity = (rows, slots)

    def release(self) -> None:
        self.kv = self.k = self.v = None

    def resume(self) -> None:
        """Re-allocate at the capacity the cache had before `release`."""
        rows, slots = self.capacity
        if rows and slots and not self.allocated:
            self.capacity = (0, 0)
            self.reserve(rows, slots)

    def write(self, layer: int, k_BGTd: torch.Tensor, v_BGTd: torch.Tensor, start: int) -> None:
        B, _, T, _ = k_BGTd.shape
        self.k[layer, :B, :, start : start + T] = k_BGTd
        self.v[layer, :B, :, start : start + T] = v_BGTd

    def read(self, layer: int, rows: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first `rows` sequences' K and V over slots [0, slots)."""
        return self.k[layer, :rows, :, :slots], self.v[layer, :rows, :, :slots]

    def step_views(self, rows: int, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a decode step that writes slot `slot` of the first `rows` sequences, views over all
        layers (made once per step, so a layer only indexes them):
        the new token's K and V, [layers, rows, kv_heads, 2, head_dim] (assign to write them);
        K^T, [layers, rows * kv_heads, head_dim, slot + 1];
        V, [layers, rows * kv_heads, slot + 1, head_dim]."""
        kv = self.kv[:, :rows]
        keys = kv[:, :, :, :, :, : slot + 1].flatten(1, 2)
        return kv[..., slot], keys[:, :, 0], keys[:, :, 1].transpose(-1, -2)

    def compact(self, keep: torch.Tensor, slots: int) -> None:
        """Move rows `keep` (ascending row indices) to rows [0, len(keep)), slots [0, slots)."""
        n = keep.numel()
        self.kv[:, :n, ..., :slots] = self.kv[:, keep, ..., :slots]

    def expand(self, rows: int, n: int, slots: int) -> None:
        """Row i -> rows i*n .. i*n+n-1 (n samples share one prompt's prefill)."""
        if n == 1:
            return
        self.kv[:, : rows * n, ..., :slots] = self.kv[:, :rows, ..., :slots].repeat_interleave(n, dim=1)
