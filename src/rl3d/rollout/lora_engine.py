"""The torch engine's LoRA state: the base weights stay loaded, only the adapters change.

Two ways to use the adapters (the engine's `lora_mode`, `LORA_MODES`; merge is the default: its
decode runs exactly the base's ops, and it decoded fastest in benchmarks/lora_engine.py, see
docs/lora.md; apply holds no copy of any weight):
- "apply": every targeted projection adds (x a^T) b^T beside its base matmul; the base pieces
  are untouched and no weight is copied. Loading adapters is only slicing the factors.
- "merge": the engine holds its own buffer per targeted parameter piece and fills it with
  W_base + b @ a at each load (one `addmm` per piece), so the forward runs the plain base code.
  The buffer is rebuilt from the unchanged base every time rather than unmerging the previous
  delta in place: a repeated merge/unmerge drifts away from the base in bf16, the rebuild
  cannot, and it is one pass over the weights instead of two. The base may be the trainer's own
  tensors (colocated), which must stay bit for bit unchanged, so they are never written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rl3d.models.params import FC1_WEIGHT, FC2_WEIGHT, PROJ_WEIGHT, QKV_WEIGHT, layer_param_name
from rl3d.ops.layouts import ShardKind, merge_tp_shards, shard_for_tp
from rl3d.rollout.lora import AdapterConfig, LowRank, megatron_low_rank
from rl3d.rollout.model import ShardedWeights

LORA_MODES = ("apply", "merge")


class ColumnLora(NamedTuple):
    """A column-parallel parameter's adapter on this rank: a^T [in, k] whole, b^T per piece."""

    a_t: torch.Tensor
    b_t: list[torch.Tensor]


class RowLora(NamedTuple):
    """A row-parallel parameter's adapter on this rank: a^T per piece [in_j, k], b^T [k, out] whole."""

    a_t: list[torch.Tensor]
    b_t: torch.Tensor


def _add_mm(out: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and out.dim() == 2:
        return torch.addmm(out, x, w_t)
    return out + torch.matmul(x, w_t).view_as(out)


@dataclass
class LayerLora:
    """One decoder layer's adapters as the forward applies them (None: module not adapted).
    The forward calls these at each targeted projection; every t_g and piece count runs them."""

    qkv: ColumnLora | None = None
    proj: RowLora | None = None
    fc1: ColumnLora | None = None
    fc2: RowLora | None = None

    def add_qkv(self, h: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.qkv is None:
            return outs
        ha = torch.matmul(h, self.qkv.a_t)
        return [_add_mm(o, ha, b_t) for o, b_t in zip(outs, self.qkv.b_t)]

    def add_proj(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.proj is None:
            return out
        low, col = None, 0
        for a_t in self.proj.a_t:
            low = self.fc2_down_into(low, x[..., col : col + a_t.shape[0]], a_t)
            col += a_t.shape[0]
        return _add_mm(out, low, self.proj.b_t)

    def fc1_down(self, h: torch.Tensor) -> torch.Tensor | None:
        return None if self.fc1 is None else torch.matmul(h, self.fc1.a_t)

    def add_fc1(self, ha: torch.Tensor | None, out: torch.Tensor, piece: int) -> torch.Tensor:
        return out if ha is None else _add_mm(out, ha, self.fc1.b_t[piece])

    def fc2_down(self, low: torch.Tensor | None, act: torch.Tensor, piece: int) -> torch.Tensor | None:
        return None if self.fc2 is None else self.fc2_down_into(low, act, self.fc2.a_t[piece])

    def add_fc2(self, low: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        return out if low is None else _add_mm(out, low, self.fc2.b_t)

    @staticmethod
    def fc2_down_into(low: torch.Tensor | None, x: torch.Tensor, a_t: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, a_t) if low is None else _add_mm(low, x, a_t)


def layer_loras(base: ShardedWeights, factors: Mapping[str, LowRank]) -> list[LayerLora]:
    """Per decoder layer, the adapters sliced like the base's pieces on this rank (views)."""
    spec, dtype = base.spec, base.dtype
    out = []
    for i in range(spec.num_layers):
        parts = {}
        for field_name, suffix in (
            ("qkv", QKV_WEIGHT),
            ("proj", PROJ_WEIGHT),
            ("fc1", FC1_WEIGHT),
            ("fc2", FC2_WEIGHT),
        ):
            name = layer_param_name(i, suffix)
            lr = factors.get(name)
            if lr is None:
                continue
            n = len(base.pieces[name])
            pieces = [lr.piece(base.tp_size, base.tp_rank, n, j) for j in range(n)]
            if lr.kind is ShardKind.ROW:
                parts[field_name] = RowLora([a.to(dtype).t() for a, _ in pieces], lr.b.to(dtype).t())
            else:
                parts[field_name] = ColumnLora(lr.a.to(dtype).t(), [b.to(dtype).t() for _, b in pieces])
        out.append(LayerLora(**parts))
    return out


def generation_shards(weights: Any) -> dict[str, torch.Tensor]:
    """Name -> this rank's generation-TP shard, from `GenerationWeights` (pieces joined: the
    adapter factors are plain row- or column-split tensors, whose consecutive shards concatenate)."""
    kinds = {name: p.kind for name, p in weights.params.items()}
    out = {name: merge_tp_shards(list(pieces), kinds[name]) for name, pieces in weights.pieces.items()}
    for name, full in weights.full.items():
        out[name] = shard_for_tp(full, kinds[name], weights.gen_tp, weights.gen_tp_rank)
    return out


class EngineLora:
    """The adapters of one engine: `weights(base)` is what the forward should run."""

    def __init__(self, mode: str = "merge"):
        if mode not in LORA_MODES:
            raise ValueError(f"LoRA mode must be one of {LORA_MODES}, got {mode!r}")
        self.mode = mode
        self.factors: dict[str, LowRank] | None = None
        self._merged: ShardedWeights | None = None  # merge: the engine's own weights over `_merged_base`
        self._merged_base: ShardedWeights | None = None

    @property
    def active(self) -> bool:
        return self.factors is not None

    @property
    def copy_bytes(self) -> int:
        """Bytes of the weight buffers the merge mode holds (0 for apply)."""
        if self._merged is None:
            return 0
        base = self._merged_base.pieces
        return sum(p.nbytes for n, ps in self._merged.pieces.items() for p in ps if ps is not base[n])

    def load(self, spec: Any, tensors: Any, config: Any) -> None:
        """`tensors`: PEFT's whole factors, or the `GenerationWeights` the adapter transition
        (`rl3d.hybrid_engine.lora_plan`) gave this rank: its generation-TP shard of each factor."""
        targets = set(AdapterConfig.from_peft(config).target_modules)
        if spec.is_moe and targets & {"gate_proj", "up_proj", "down_proj"}:
            raise ValueError(
                f"LoRA on a mixture of experts ({spec.name}): adapters on the experts' "
                f"gate_proj/up_proj/down_proj are not supported; target the attention projections"
            )
        if isinstance(tensors, Mapping):
            self.factors = megatron_low_rank(spec, tensors, config)
        else:
            shard = (tensors.gen_tp_rank, tensors.gen_tp)
            self.factors = megatron_low_rank(spec, generation_shards(tensors), config, shard)

    def clear(self) -> None:
        self.factors = None
        self.release()

    def release(self) -> None:
        """Drop the merge buffers (the adapters stay; the next `weights` rebuilds them)."""
        self._merged = self._merged_base = None

    def weights(self, base: ShardedWeights) -> ShardedWeights:
        if self.factors is None:
            return base
        if self.mode == "apply":
            w = ShardedWeights(base.spec, base.tp_size, base.tp_rank, base.pieces)
            w.lora = layer_loras(base, self.factors)
            return w.checked()
        return self._merge(base)

    @torch.no_grad()
    def _merge(self, base: ShardedWeights) -> ShardedWeights:
        merged = self._merged
        if (
            merged is None
            or self._merged_base is not base
            or any(merged.pieces[n] is base.pieces[n] for n in self.factors)
        ):
            pieces = dict(base.pieces)
            for name in self.factors:
                pieces[name] = [torch.empty_like(p) for p in base.pieces[name]]
            merged = ShardedWeights(base.spec, base.tp_size, base.tp_rank, pieces)
            self._merged, self._merged_base = merged, base
        for name, lr in self.factors.items():
            n = len(base.pieces[name])
            for j, (w, out) in enumerate(zip(base.pieces[name], merged.pieces[name])):
                a, b = lr.piece(base.tp_size, base.tp_rank, n, j)
                torch.addmm(w, b.to(w.dtype), a.to(w.dtype), out=out)
        for name in set(merged.pieces) - set(self.factors):  # a module no longer adapted: the base
            merged.pieces[name] = base.pieces[name]
        return merged.checked()
