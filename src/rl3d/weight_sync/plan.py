"""Plan a weight sync from the training layout to a separate rollout pool (pure, no torch).

The colocated planner (`rl3d.hybrid_engine.plan`) moves shards between ranks that hold both
layouts; here the two layouts live on disjoint ranks, so the plan is point to point: every
rollout rank receives, from the data-parallel replica 0 of the training layout, exactly the
training TP shards its generation-TP shard is made of, and nothing else.

Training layout p-t-d, rollout pool t_g x d_g (generation TP rank `a` of each engine):
- t_g <= t (r = t/t_g): rank `a` gets training TP shards a*r .. a*r+r-1 of every parameter and
  merges them (`merge_tp_shards`: consecutive shards make the coarser one, fused SwiGLU too);
- t_g > t (k = t_g/t): rank `a` gets training shard a // k and cuts piece a % k of it;
- replicated parameters (norms) come once, from training TP rank 0;
- a parameter comes from the first pipeline stage holding it (a tied output layer is skipped:
  the engine uses the embedding).
So each rollout rank receives M / t_g bytes (M: the model's bytes), the lower bound for a
layout that holds M / t_g; every engine (d_g of them) gets its own copy.

A route (training rank -> rollout rank) is cut into buckets of at most `bucket_bytes` (a
piece larger than a bucket is a bucket of its own), one send each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rl3d.models.params import model_params, stages_of
from rl3d.models.spec import ModelSpec
from rl3d.parallel.layout import ParallelLayout
from rl3d.parallel.sharding import ShardKind


@dataclass(frozen=True)
class Piece:
    name: str  # global parameter name
    kind: ShardKind
    train_tp: int  # which training TP shard (0 for replicated parameters)
    shape: tuple[int, ...]  # the training shard's shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Route:
    src: int  # training pool rank (data-parallel replica 0)
    dst: int  # rollout pool rank
    pieces: tuple[Piece, ...]
    buckets: tuple[tuple[int, int], ...]  # [lo, hi) piece ranges, one send each

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


@dataclass(frozen=True)
class SyncPlan:
    train: ParallelLayout
    gen_tp: int
    gen_dp: int
    bytes_per_element: int
    routes: tuple[Route, ...]

    def routes_from(self, src: int) -> list[Route]:
        return [r for r in self.routes if r.src == src]

    def routes_to(self, dst: int) -> list[Route]:
        return [r for r in self.routes if r.dst == dst]

    def bytes_to(self, dst: int) -> int:
        return sum(r.numel for r in self.routes_to(dst)) * self.bytes_per_element

    @property
    def total_bytes(self) -> int:
        return sum(r.numel for r in self.routes) * self.bytes_per_element

    @property
    def num_sends(self) -> int:
        return sum(len(r.buckets) for r in self.routes)

    def describe(self) -> str:
        t = self.train
        return (
            f"weight sync {t.p}-{t.t}-{t.d} -> rollout t_g={self.gen_tp} x {self.gen_dp}: "
            f"{self.total_bytes} bytes in {self.num_sends} sends "
            f"({self.bytes_to(0)} bytes per rollout rank)"
        )


def train_shards_for(gen_tp_rank: int, t: int, gen_tp: int) -> list[int]:
    """The training TP shards a generation-TP rank's shard is made of."""
    if gen_tp <= t:
        r = t // gen_tp
        return list(range(gen_tp_rank * r, (gen_tp_rank + 1) * r))
    return [gen_tp_rank // (gen_tp // t)]


def _buckets(pieces: list[Piece], bucket_elems: int) -> tuple[tuple[int, int], ...]:
    out, lo, size = [], 0, 0
    for i, piece in enumerate(pieces):
        if size and size + piece.numel > bucket_elems:
            out.append((lo, i))
            lo, size = i, 0
        size += piece.numel
    if lo < len(pieces):
        out.append((lo, len(pieces)))
    return tuple(out)


def plan_weight_sync(
    spec: ModelSpec,
    train: ParallelLayout,
    *,
    gen_tp: int,
    gen_dp: int,
    bytes_per_element: int,
    bucket_bytes: int,
) -> SyncPlan:
    t = train.t
    if t % gen_tp and gen_tp % t:
        raise ValueError(f"rollout t_g={gen_tp} must divide or be a multiple of the training tp={t}")
    params = [p for p in model_params(spec, train_tp=t) if not p.tied_copy]
    bucket_elems = max(1, bucket_bytes // bytes_per_element)
    routes = []
    for dst in range(gen_tp * gen_dp):
        a = dst % gen_tp  # rollout pool layout 1-t_g-d_g: rank = tp + t_g * dp
        wanted = train_shards_for(a, t, gen_tp)
        by_src: dict[int, list[Piece]] = {}
        for p in params:
            stage = stages_of(p, spec.num_layers, train.p)[0]
            shards = [0] if p.kind is ShardKind.REPLICATED else wanted
            for i in shards:
                shape = p.shape if p.kind is ShardKind.REPLICATED else _shard_shape(p.shape, p.kind, t)
                src = i + t * train.d * stage  # tp + t*(dp + d*pp) at dp = 0
                by_src.setdefault(src, []).append(Piece(p.name, p.kind, i, shape))
        for src in sorted(by_src):
            pieces = by_src[src]
            routes.append(Route(src, dst, tuple(pieces), _buckets(pieces, bucket_elems)))
    return SyncPlan(train, gen_tp, gen_dp, bytes_per_element, tuple(routes))


def _shard_shape(shape: tuple[int, ...], kind: ShardKind, t: int) -> tuple[int, ...]:
    if t == 1:
        return shape
    dim = kind.tp_dim
    return tuple(s // t if i == dim else s for i, s in enumerate(shape))
