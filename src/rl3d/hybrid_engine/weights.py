"""The generation weights a transition produces, and the training shards it starts from.

`GenerationWeights` holds, per parameter of the rank's generation shard, its *pieces*: the r
training-TP shards that make up the generation-TP shard, in TP order (or one piece when the
strategy already holds the generation shard whole). A piece is either the rank's own training
tensor (same storage: reused in place) or a view into a generation buffer the transition
allocated. `materialize` turns pieces into the engine's layout through `rl3d.ops`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from rl3d.hybrid_engine.params import ParamInfo
from rl3d.models.spec import ModelSpec
from rl3d.ops.layouts import ShardKind, merge_tp_shards, shard_for_tp


def full_model(params: list[ParamInfo], *, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random full (t=1) Megatron tensors, the same on every rank for a seed (tests, benchmarks)."""
    gen = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(p.shape, generator=gen, dtype=torch.float32).to(dtype) for p in params}


class SeededFullModel(Mapping):
    """`full_model` made on demand, one tensor at a time: each parameter from its own seeded
    generator, so a rank that only cuts its shards never holds the whole model (the measured
    benchmark at large shapes). Values differ from `full_model`'s for the same seed."""

    def __init__(self, params: list[ParamInfo], *, seed: int, dtype: torch.dtype):
        self.params = {p.name: (i, p) for i, p in enumerate(params)}
        self.seed, self.dtype = seed, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        index, p = self.params[name]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randn(p.shape, generator=gen, dtype=torch.float32).to(self.dtype)

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def training_shards(
    full: Mapping[str, torch.Tensor],
    plan_params: list[ParamInfo],
    *,
    pp_rank: int,
    pp: int,
    tp_rank: int,
    tp: int,
    num_layers: int,
) -> dict[str, torch.Tensor]:
    """The (pp_rank, tp_rank) training shard of a full model, as independent contiguous tensors."""
    from rl3d.hybrid_engine.params import stages_of

    return {
        p.name: shard_for_tp(full[p.name], p.kind, tp, tp_rank).clone()
        for p in plan_params
        if pp_rank in stages_of(p, num_layers, pp)
    }


def zero_shards(full: Mapping[str, torch.Tensor], params: list[ParamInfo], *, rank: int, world: int):
    """ZeRO-3's partition of a full model (ds_chat's training weights): each parameter flattened,
    zero-padded to a multiple of `world`, and chunk `rank` of it."""
    out = {}
    for p in params:
        chunk = -(-p.numel // world)
        tensor = full[p.name]  # once: a SeededFullModel makes it on each access
        flat = torch.zeros(chunk * world, dtype=tensor.dtype)
        flat[: p.numel] = tensor.reshape(-1)
        out[p.name] = flat[rank * chunk : (rank + 1) * chunk].clone()
    return out


@dataclass
class GenerationWeights:
    spec: ModelSpec
    params: dict[str, ParamInfo]
    train_tp: int
    gen_tp: int
    gen_tp_rank: int
    pieces: dict[str, list[torch.Tensor]]  # the r training-TP shards of the generation shard
    full: dict[str, torch.Tensor] = field(default_factory=dict)  # or the whole (t=1) tensor
    buffers: list[torch.Tensor] = field(default_factory=list)  # storage this transition allocated
    released: bool = False
    expert_train_tp: int | None = None  # an expert's training shards, where not train_tp (etp)

    def names(self) -> list[str]:
        return [*self.pieces, *self.full]

    def tensors(self) -> list[torch.Tensor]:
        return [t for pieces in self.pieces.values() for t in pieces] + list(self.full.values())

    def storage_bytes(self, exclude=()) -> int:
        """Bytes of distinct storages the generation weights live in (buffers + reused shards),
        leaving out the storages of the tensors in `exclude` (the training shards: what is left
        is what the transition allocated)."""
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        tensors = [*self.tensors(), *self.buffers]
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(nbytes for ptr, nbytes in seen.items() if ptr not in skip)

    def materialize(self, name: str, target: str = "megatron", *, backend: str | None = None):
        """The generation shard of `name` in the Megatron generation layout (one tensor) or in
        HF layout (a tuple: (q, k, v), (gate, up) or (weight,), vocab padding removed)."""
        if self.released:
            raise RuntimeError("generation weights were released after rollout")
        p = self.params[name]
        if name in self.full:
            pieces = [shard_for_tp(self.full[name], p.kind, self.gen_tp, self.gen_tp_rank)]
        else:
            pieces = self.pieces[name]
        if len(pieces) == 1 and target == "megatron":
            return pieces[0]
        from rl3d.ops import ParamLayout, gather_to_layout

        layout = ParamLayout(
            kind=p.kind,
            num_heads=p.heads[0] if p.heads else 0,
            num_query_groups=p.heads[1] if p.heads else 0,
            vocab_size=self.spec.vocab_size if p.kind is ShardKind.VOCAB else 0,
        )
        if len(pieces) == 1:  # one piece = the generation shard already: treat as t = t_g
            return gather_to_layout(
                pieces,
                layout,
                train_tp=self.gen_tp,
                gen_tp=self.gen_tp,
                gen_rank=self.gen_tp_rank,
                target=target,
                backend=backend,
            )
        return gather_to_layout(
            pieces,
            layout,
            train_tp=self.expert_train_tp if p.expert is not None and self.expert_train_tp else self.train_tp,
            gen_tp=self.gen_tp,
            gen_rank=self.gen_tp_rank,
            target=target,
            backend=backend,
        )

    def reference_materialize(self, name: str) -> torch.Tensor:
        """The Megatron generation shard by the plain torch reference (for verification)."""
        kind = self.params[name].kind
        if name in self.full:
            return shard_for_tp(self.full[name], kind, self.gen_tp, self.gen_tp_rank)
        pieces = self.pieces[name]
        return pieces[0] if len(pieces) == 1 else merge_tp_shards(pieces, kind)

    def release(self) -> None:
        """After rollout: drop the generation buffers. They are never copied back (the training
        weights stay the source of truth) and never kept: the next training step changes the
        weights, so a kept copy would be stale, and on the GPU the caching allocator already
        hands the freed blocks to the next reshard without a new device allocation. (An
        `offload_cpu` mode once copied them to host memory; nothing read those copies.)"""
        self.buffers = []
        self.pieces, self.full = {}, {}
        self.released = True
