"""A transition whose destination ranks are another pool's: the weight sync of a separate
rollout pool, planned in the hybrid engine's own types (pure Python, shapes only).

The in-place transition moves shards between ranks that hold both layouts; here the generation
layout lives on other ranks. The plan's ranks are the actor pool's `0 .. n-1` (training layout
p-t-d, n = p*t*d) followed by the rollout pool's `n .. n + t_g*d_g - 1` (pool rank j is plan
rank n + j; generation TP rank `j % t_g` of engine `j // t_g`). Every rollout rank receives, from
data-parallel replica 0 of the training layout, exactly the training TP shards its
generation-TP shard is made of:
- t_g <= t (r = t/t_g): generation TP rank `a` gets training TP shards a*r .. a*r+r-1 of every
  parameter and merges them (consecutive shards make the coarser one, fused SwiGLU too);
- t_g > t (k = t_g/t): rank `a` gets training shard a // k and cuts piece a % k of it;
- replicated parameters (norms) come once, from training TP rank 0;
- a parameter comes from the first pipeline stage holding it (a tied output layer is skipped:
  the engine uses the embedding);
- with expert parallelism an expert comes from the data-parallel rank of replica 0's EP group
  that trains it (dp = its EP rank).
So each rollout rank receives M / t_g bytes (M: the model's bytes), the lower bound for a
layout that holds M / t_g; every engine (d_g of them) gets its own copy.

Each (training rank, rollout rank) route is cut into buckets of at most `bucket_bytes`
(`bucket_bounds`: a piece larger than a bucket is a bucket of its own). The plan is a
`StrategyPlan` named `pool` with no collective and one point-to-point phase per bucket index:
phase k holds bucket k of every route, one `Transfer` (one message, tag k) each, whose pieces
are `(holder, parameter index)` as in the hierarchical gather. The executor (`rl3d.hybrid_engine.
p2p`) runs it and counts exactly these bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl3d.hybrid_engine.params import ParamInfo, model_params, shard_shape, stages_of
from rl3d.hybrid_engine.plan import RankCost, StrategyPlan, Transfer, bucket_bounds
from rl3d.models.params import expert_owner
from rl3d.models.spec import ModelSpec
from rl3d.parallel.layout import ParallelLayout
from rl3d.parallel.sharding import ShardKind
from rl3d.utils.dtypes import DTYPE_BYTES

if TYPE_CHECKING:  # the executor imports torch; planning a pool transition does not
    from rl3d.hybrid_engine.stats import TransitionStats

POOL = "pool"  # the strategy name of a transition to another pool


@dataclass(frozen=True)
class PoolTransition:
    spec: ModelSpec
    train: ParallelLayout
    gen_tp: int
    gen_dp: int
    dtype_bytes: int
    params: tuple[ParamInfo, ...]  # what a Transfer's parameter indices index
    plan: StrategyPlan
    # each sync sends only the changed elements of each bucket (rl3d.weight_sync.delta); the
    # plan's bytes are then what a full send moves, the most a sync sends
    delta: bool = False

    @property
    def num_train(self) -> int:
        return self.train.world_size

    def rank_of(self, pool_rank: int) -> int:
        """The plan rank of rollout pool rank `pool_rank` (training ranks are their own)."""
        return self.num_train + pool_rank

    def bytes_to(self, pool_rank: int) -> int:
        return self.plan.ranks[self.rank_of(pool_rank)].recv_bytes

    @property
    def total_bytes(self) -> int:
        return sum(r.recv_bytes for r in self.plan.ranks)

    @property
    def num_sends(self) -> int:
        return sum(len(phase) for phase in self.plan.phases)

    def transfers(self, rank: int) -> list[Transfer]:
        """The transfers plan rank `rank` sends or receives, phase by phase."""
        return [t for phase in self.plan.phases for t in phase if rank in (t.src, t.dst)]

    def describe(self) -> str:
        t = self.train
        return (
            f"weight sync {t.p}-{t.t}-{t.d} -> rollout t_g={self.gen_tp} x {self.gen_dp}: "
            f"{self.total_bytes} bytes in {self.num_sends} sends "
            f"({self.bytes_to(0)} bytes per rollout rank)" + (", as deltas" if self.delta else "")
        )


def train_shards_for(gen_tp_rank: int, t: int, gen_tp: int) -> list[int]:
    """The training TP shards a generation-TP rank's shard is made of."""
    if gen_tp <= t:
        r = t // gen_tp
        return list(range(gen_tp_rank * r, (gen_tp_rank + 1) * r))
    return [gen_tp_rank // (gen_tp // t)]


def plan_pool_transition(
    spec: ModelSpec,
    train: ParallelLayout,
    *,
    gen_tp: int,
    gen_dp: int,
    dtype: str,
    bucket_bytes: int,
    delta: bool = False,
) -> PoolTransition:
    """Plan the move of the actor's training shards to a rollout pool of `gen_dp` engines of
    `gen_tp` ranks each. ValueError on layouts that do not nest or an unknown dtype."""
    t = train.t
    if train.etp is not None:
        raise ValueError(
            f"actor.parallel.etp={train.etp}: a separate rollout pool takes experts trained at "
            f"etp = tp ({t}) only; use rollout.placement: colocated"
        )
    if t % gen_tp and gen_tp % t:
        raise ValueError(f"rollout t_g={gen_tp} must divide or be a multiple of the training tp={t}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    dtype_bytes = DTYPE_BYTES[dtype]
    params = tuple(model_params(spec, train_tp=t))
    numel = [math.prod(shard_shape(p, t)) for p in params]
    bucket_elems = max(1, bucket_bytes // dtype_bytes)
    routes: list[tuple[int, int, list[int]]] = []  # (src, dst, parameter indices)
    for j in range(gen_tp * gen_dp):
        wanted = train_shards_for(j % gen_tp, t, gen_tp)
        by_src: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            if p.tied_copy:
                continue
            stage = stages_of(p, spec.num_layers, train.p)[0]
            # data-parallel rank 0, or for an expert the EP rank that holds it (dp = ep rank)
            dp = 0 if p.expert is None else expert_owner(spec, p.expert, train.ep)[0]
            for tp in [0] if p.kind is ShardKind.REPLICATED else wanted:
                by_src.setdefault(train.rank_of(pp=stage, dp=dp, tp=tp), []).append(i)
        routes += [(src, train.world_size + j, by_src[src]) for src in sorted(by_src)]
    phases: list[list[Transfer]] = []
    recv = [0] * (train.world_size + gen_tp * gen_dp)
    send = list(recv)
    for src, dst, indices in routes:
        for k, (lo, hi) in enumerate(bucket_bounds([numel[i] for i in indices], bucket_elems)):
            if k == len(phases):
                phases.append([])
            phases[k].append(Transfer(src, dst, "shard", tuple((src, i) for i in indices[lo:hi])))
            nbytes = sum(numel[i] for i in indices[lo:hi]) * dtype_bytes
            recv[dst] += nbytes
            send[src] += nbytes
    # a rollout rank holds what it received (its generation shards); training ranks add nothing
    ranks = [RankCost(r, recv[r], send[r], recv[r], 0) for r in range(len(recv))]
    plan = StrategyPlan(POOL, gen_dp, ranks, [], tuple(tuple(phase) for phase in phases))
    return PoolTransition(spec, train, gen_tp, gen_dp, dtype_bytes, params, plan, delta)


def publish_metrics(plan: PoolTransition, stats: TransitionStats | None) -> dict[str, float]:
    """A publish to a rollout pool in the `reshard/*` family every transition reports in:
    `reshard/bytes` the plan's total (what the pool's ranks receive; each training rank's sent
    bytes were checked against the plan, `check_sent`), `reshard/seconds` the send's time.
    Zeros when nothing was sent (`stats` None: no step or validation left to use the policy,
    or a critic/reference rank, which sends nothing).

    Sent as deltas (`stats.delta`), `reshard/bytes` is what went over the wire, counted by the
    training ranks whose stats these are (all of them on Ray; this rank's own share with the
    spmd backend), and so are `reshard/delta_bytes` (the same), `reshard/full_bytes` (what their
    full buckets hold: the plan's) and `reshard/changed_fraction` (of their elements)."""
    if stats is None:
        out = {"reshard/bytes": 0.0, "reshard/seconds": 0.0}
        return out | ({"reshard/delta_bytes": 0.0, "reshard/full_bytes": 0.0} if plan.delta else {})
    if stats.delta is None:
        return {"reshard/bytes": float(plan.total_bytes), "reshard/seconds": stats.seconds}
    d = stats.delta
    return {
        "reshard/bytes": float(d.wire_bytes),
        "reshard/seconds": stats.seconds,
        "reshard/delta_bytes": float(d.wire_bytes),
        "reshard/full_bytes": float(d.full_bytes),
        "reshard/changed_fraction": d.changed / d.numel if d.numel else 0.0,
        "reshard/full_sends": float(d.kinds.get("full", 0)),
    }


def check_sent(plan: PoolTransition, train_ranks: list[int], stats: list[TransitionStats]) -> TransitionStats:
    """The training ranks' send stats, each checked against what the plan has it send: one
    TransitionStats for them all (bytes summed, the slowest rank's seconds, calls summed)."""
    from rl3d.hybrid_engine.stats import TransitionStats

    for rank, got in zip(train_ranks, stats, strict=True):
        want = plan.plan.ranks[rank].send_bytes
        sent = got.send_bytes if got.delta is None else got.delta.full_bytes  # a delta's full buckets
        if sent != want:
            raise RuntimeError(f"weight sync: training rank {rank} sent {sent} bytes, the plan has {want}")
    deltas = [s.delta for s in stats if s.delta is not None]
    return TransitionStats(
        POOL,
        recv_bytes=sum(s.recv_bytes for s in stats),
        send_bytes=sum(s.send_bytes for s in stats),
        peak_param_bytes=0,
        seconds=max((s.seconds for s in stats), default=0.0),
        verified=False,
        calls=sum(s.calls for s in stats),
        delta=sum(deltas[1:], deltas[0]) if deltas else None,
    )
