"""The 3D-HybridEngine planner: exact per-rank transition costs, from shapes alone.

Pure Python (no torch.distributed, no tensors), so a 70B model on 128 GPUs plans on a laptop.
For each strategy and rank it reports the bytes received and sent, the peak parameter memory
and the redundant bytes, with per-tensor accounting (see `params.SegmentTable`).

Strategies (HybridFlow, EuroSys'25, Table 2, plus the separate-GPU baseline):
- `hybridflow`: regrouped generation layout; one all-gather inside each micro-DP group of d_g
  ranks builds every rank's generation shard; the rank's own training shard is part of it.
- `hybridflow_v`: all-gather of the whole replica across its t*p ranks into a separate buffer,
  then each rank slices its generation shard (vanilla grouping).
- `ds_chat`: training weights ZeRO-3-partitioned over all t*p*d ranks (each param flattened,
  padded to a multiple of N); an all-gather over all N ranks builds the full model.
- `openrlhf`: rollout on a separate set of GPUs (as many as the trainer has, same generation
  layout); the trainer's rank 0 gathers every full tensor and broadcasts it to every rollout GPU.

Definitions (the fields of the JSON contract):
- comm bytes: bytes a rank receives during the transition.
- peak_param_bytes: the generation weights a rank holds once the transition is done (for
  hybridflow this includes the training shard, reused in place; for hybridflow_v and ds_chat
  the gathered full model; for openrlhf a rollout GPU's shard plus one full tensor in flight).
  The max over ranks is reported; the executor measures the same quantity from storages.
- redundant_bytes: training-weight bytes a rank keeps in storage that is not its generation
  weights: 0 for hybridflow (in place), the whole training shard for hybridflow_v and ds_chat
  (gathered into a separate buffer) and for openrlhf's trainer GPUs (the model lives twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean

from rl3d.hybrid_engine.params import ParamInfo, SegmentTable, model_params, stages_of
from rl3d.models.spec import ModelSpec
from rl3d.parallel import GenerationLayout, ParallelLayout

STRATEGIES = ("hybridflow", "hybridflow_v", "ds_chat", "openrlhf")
DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}


@dataclass(frozen=True)
class RankCost:
    rank: int  # for openrlhf, ranks >= world size are the rollout GPUs
    recv_bytes: int
    send_bytes: int
    peak_param_bytes: int
    redundant_bytes: int


@dataclass(frozen=True)
class Collective:
    op: str  # all_gather | gather | broadcast
    groups: list[list[int]]
    bytes_per_group: int  # size of the buffer the collective builds on each receiving rank


@dataclass(frozen=True)
class StrategyPlan:
    strategy: str
    d_g: int
    ranks: list[RankCost]
    collectives: list[Collective]

    @property
    def comm_bytes_max(self) -> int:
        return max(r.recv_bytes for r in self.ranks)

    @property
    def comm_bytes_mean(self) -> float:
        return mean(r.recv_bytes for r in self.ranks)

    @property
    def peak_param_bytes(self) -> int:
        return max(r.peak_param_bytes for r in self.ranks)

    @property
    def redundant_bytes(self) -> int:
        return max(r.redundant_bytes for r in self.ranks)

    def summary(self) -> dict:
        return {
            "strategy": self.strategy,
            "d_g": self.d_g,
            "comm_bytes_max": self.comm_bytes_max,
            "comm_bytes_mean": self.comm_bytes_mean,
            "send_bytes_max": max(r.send_bytes for r in self.ranks),
            "peak_param_bytes": self.peak_param_bytes,
            "redundant_bytes": self.redundant_bytes,
            "num_ranks": len(self.ranks),
        }


@dataclass
class _Ctx:
    spec: ModelSpec
    gen: GenerationLayout
    dtype_bytes: int
    params: list[ParamInfo]
    table: SegmentTable
    _cache: dict = field(default_factory=dict)

    @property
    def train(self) -> ParallelLayout:
        return self.gen.train

    def holding(self, pp_rank: int, pp_size: int, tp_rank: int, tp_size: int) -> frozenset[int]:
        """Segments held by the (pp_rank, tp_rank) shard of a pp_size x tp_size layout."""
        key = (pp_rank, pp_size, tp_rank, tp_size)
        if key not in self._cache:
            segs: set[int] = set()
            for i, p in enumerate(self.params):
                if pp_rank in stages_of(p, self.spec.num_layers, pp_size):
                    segs.update(self.table.shard(i, tp_rank, tp_size))
            self._cache[key] = frozenset(segs)
        return self._cache[key]

    def train_segs(self, rank: int) -> frozenset[int]:
        c = self.train.coords(rank)
        return self.holding(c.pp, self.train.p, c.tp, self.train.t)

    def gen_segs(self, rank: int) -> frozenset[int]:
        c = self.gen.coords(rank)
        return self.holding(c.pp_g, self.gen.p_g, c.tp_g, self.gen.t_g)

    def nbytes(self, segs) -> int:
        return self.table.nbytes(segs, self.dtype_bytes)


def _gather_costs(ctx: _Ctx, groups: list[list[int]], need_of, in_place: bool) -> list[RankCost]:
    """Each rank of each group receives `need_of(rank) - own` from the group's members.

    A missing segment comes from the holder with the same training TP rank when there is one
    (replicated norms travel along PP only), else from the lowest holding rank.
    """
    recv, send, peak, redundant = {}, {}, {}, {}
    for group in groups:
        owns = {m: ctx.train_segs(m) for m in group}
        tp_of = {m: ctx.train.coords(m).tp for m in group}
        for m in group:
            send.setdefault(m, 0)
        for m in group:
            need = need_of(m)
            missing = need - owns[m]
            for seg in missing:
                holders = [x for x in group if seg in owns[x]]
                assert holders, f"segment {seg} needed by rank {m} is held by no rank of {group}"
                same_tp = [x for x in holders if tp_of[x] == tp_of[m]]
                source = (same_tp or holders)[0]
                send[source] += ctx.table.sizes[seg] * ctx.dtype_bytes
            recv[m] = ctx.nbytes(missing)
            peak[m] = ctx.nbytes(need)
            redundant[m] = ctx.nbytes(owns[m] - need) if in_place else ctx.nbytes(owns[m])
    return [RankCost(r, recv[r], send[r], peak[r], redundant[r]) for r in sorted(recv)]


def _plan_hybridflow(ctx: _Ctx) -> StrategyPlan:
    groups = ctx.gen.micro_dp_groups()
    ranks = _gather_costs(ctx, groups, ctx.gen_segs, in_place=True)
    gen_bytes = max(ctx.nbytes(ctx.gen_segs(g[0])) for g in groups)
    return StrategyPlan("hybridflow", ctx.gen.d_g, ranks, [Collective("all_gather", groups, gen_bytes)])


def _plan_hybridflow_v(ctx: _Ctx) -> StrategyPlan:
    groups = ctx.train.model_parallel_groups()
    held = [i for i, p in enumerate(ctx.params) if stages_of(p, ctx.spec.num_layers, ctx.train.p)]
    full = frozenset(s for i in held for s in ctx.table.full(i))
    ranks = _gather_costs(ctx, groups, lambda _rank: full, in_place=False)
    return StrategyPlan(
        "hybridflow_v", ctx.gen.d_g, ranks, [Collective("all_gather", groups, ctx.nbytes(full))]
    )


def _plan_ds_chat(ctx: _Ctx) -> StrategyPlan:
    n = ctx.train.world_size
    # ZeRO-3 has no pipeline copy of a tied output layer: plan over the unpipelined inventory.
    params = [p for p in ctx.params if stages_of(p, ctx.spec.num_layers, 1)]
    chunk = sum(-(-p.numel // n) for p in params) * ctx.dtype_bytes
    cost = RankCost(0, (n - 1) * chunk, (n - 1) * chunk, n * chunk, chunk)
    ranks = [RankCost(r, cost.recv_bytes, cost.send_bytes, cost.peak_param_bytes, chunk) for r in range(n)]
    return StrategyPlan(
        "ds_chat", ctx.gen.d_g, ranks, [Collective("all_gather", [list(range(n))], n * chunk)]
    )


def _plan_openrlhf(ctx: _Ctx) -> StrategyPlan:
    n = ctx.train.world_size
    unpiped = [i for i, p in enumerate(ctx.params) if stages_of(p, ctx.spec.num_layers, 1)]
    full = frozenset(s for i in unpiped for s in ctx.table.full(i))
    model_bytes = ctx.nbytes(full)
    largest = max(ctx.table.nbytes(ctx.table.full(i), ctx.dtype_bytes) for i in unpiped)
    replica0 = ctx.train.model_parallel_groups()[0]
    trainer = _gather_costs(ctx, [replica0], lambda r: full if r == 0 else frozenset(), in_place=True)
    by_rank = {c.rank: c for c in trainer}
    ranks = []
    for r in range(n):
        own = ctx.nbytes(ctx.train_segs(r))
        c = by_rank.get(r)
        send = (c.send_bytes if c else 0) + (n * model_bytes if r == 0 else 0)
        peak = own + largest if r == 0 else own
        ranks.append(RankCost(r, c.recv_bytes if c else 0, send, peak, own))
    for r in range(n):  # the rollout GPUs: full tensors in, their generation shard kept
        ranks.append(RankCost(n + r, model_bytes, 0, ctx.nbytes(ctx.gen_segs(r)) + largest, 0))
    collectives = [
        Collective("gather", [replica0], model_bytes),
        Collective("broadcast", [[0, *range(n, 2 * n)]], model_bytes),
    ]
    return StrategyPlan("openrlhf", ctx.gen.d_g, ranks, collectives)


_PLANNERS = {
    "hybridflow": _plan_hybridflow,
    "hybridflow_v": _plan_hybridflow_v,
    "ds_chat": _plan_ds_chat,
    "openrlhf": _plan_openrlhf,
}


@dataclass
class TransitionPlan:
    spec: ModelSpec
    gen: GenerationLayout
    dtype_bytes: int
    params: list[ParamInfo]
    strategies: dict[str, StrategyPlan]
    _ctx: _Ctx

    @property
    def train(self) -> ParallelLayout:
        return self.gen.train

    @property
    def model_bytes(self) -> int:
        """M: the training inventory's bytes, one replica (vocab padded, no pipeline copies)."""
        unpiped = [p for p in self.params if stages_of(p, self.spec.num_layers, 1)]
        return sum(p.numel for p in unpiped) * self.dtype_bytes

    def train_shards(self, rank: int) -> list[tuple[str, int, int]]:
        """(param name, tp rank, tp size) of every training shard `rank` holds."""
        c = self.train.coords(rank)
        return [
            (p.name, c.tp, self.train.t)
            for p in self.params
            if c.pp in stages_of(p, self.spec.num_layers, self.train.p)
        ]

    def gen_shards(self, rank: int) -> list[tuple[str, int, int]]:
        """(param name, generation tp rank, t_g) of every generation shard `rank` needs."""
        c = self.gen.coords(rank)
        return [
            (p.name, c.tp_g, self.gen.t_g)
            for p in self.params
            if c.pp_g in stages_of(p, self.spec.num_layers, self.gen.p_g)
        ]

    def rank_bytes(self, rank: int) -> tuple[int, int]:
        """(training shard bytes, generation shard bytes) of a rank."""
        return self._ctx.nbytes(self._ctx.train_segs(rank)), self._ctx.nbytes(self._ctx.gen_segs(rank))

    def to_json(self) -> dict:
        return {
            "model": self.spec.name,
            "dtype_bytes": self.dtype_bytes,
            "train": {"p": self.train.p, "t": self.train.t, "d": self.train.d},
            "gen": {"p_g": self.gen.p_g, "t_g": self.gen.t_g, "d_g": self.gen.d_g, "d": self.train.d},
            "world_size": self.train.world_size,
            "d_g": self.gen.d_g,
            "model_bytes": self.model_bytes,
            "strategies": {name: s.summary() for name, s in self.strategies.items()},
        }


def plan_transition(
    spec: ModelSpec,
    train: ParallelLayout,
    t_g: int,
    p_g: int = 1,
    *,
    dtype: str = "bfloat16",
    strategies: tuple[str, ...] = STRATEGIES,
    params: list[ParamInfo] | None = None,
) -> TransitionPlan:
    """Plan the train -> generate transition. Raises ValueError on an impossible layout."""
    gen = GenerationLayout.from_training(train, t_g, p_g)
    if spec.num_layers % train.p:
        raise ValueError(f"pipeline size p={train.p} must divide the {spec.num_layers} layers of {spec.name}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    unknown = [s for s in strategies if s not in _PLANNERS]
    if unknown:
        raise ValueError(f"unknown strategy {unknown[0]!r}; known: {', '.join(STRATEGIES)}")
    params = params if params is not None else model_params(spec, train_tp=train.t)
    ctx = _Ctx(spec, gen, DTYPE_BYTES[dtype], params, SegmentTable(params, train.t))
    plans = {name: _PLANNERS[name](ctx) for name in strategies}
    return TransitionPlan(spec, gen, ctx.dtype_bytes, params, plans, ctx)
