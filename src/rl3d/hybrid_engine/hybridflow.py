"""HybridFlow's regrouped transition (EuroSys'25, section 5.3): the strategy training runs use.

Each micro-DP group of d_g ranks already holds, between its members, the generation shard
every member needs, so one all-gather inside the group builds it, and each rank's own
training shard is a piece of it in place (no copy, no redundant memory). Replicated norms
travel only when PP folds into micro-DP (s > 1), and then only among the members with the
same training TP rank (each stage's norms come from one holder).

With expert parallelism (ep > 1, the experts of a layer split over ep data-parallel ranks) a
micro-DP group holds only its EP rank's experts, while every generation rank needs all
experts of its stage. The micro-DP groups of one EP group's ep ranks, joined, hold each
expert's generation shard exactly once between them (member (k, b, e): EP rank k's experts,
training TP shard b, stage e), so a second all-gather over those ep * d_g ranks gives every
member exactly the expert shards it lacks, each once, from the rank that trains them.

With the experts split over an expert TP size apart from TP (`etp`, megatron's second grid of
each stage: etp fastest, then ep, then expert DP), generation at t_g = 1 needs every expert
whole: the expert group is the ranks of one expert-DP index and generation stage, one holder
of each (EP rank, expert TP rank, stage) shard, and the same all-gather completes every expert.
At t_g > 1 a generation shard of an expert is a part of a training shard (etp < t_g), several of
them (etp > t_g), or neither, which no all-gather of whole shards builds without moving bytes
nobody keeps. So each expert is cut into lcm(etp, t_g) parts (`plan.slice_parts`) and every
generation rank receives the parts of its shard it does not train, point to point, each once,
from the holder with its own expert-DP index (spreading the sends over the expert-DP copies).
"""

from __future__ import annotations

from rl3d.hybrid_engine.params import stages_of
from rl3d.hybrid_engine.plan import (
    Collective,
    PlanContext,
    RankCost,
    StrategyPlan,
    Transfer,
    expert_parts,
    shard_contributions,
    slice_parts,
)
from rl3d.hybrid_engine.strategy import Strategy, register_strategy
from rl3d.models.params import expert_owner
from rl3d.parallel.sharding import ShardKind


def _same_tp_subgroups(ctx: PlanContext, groups: list[list[int]]) -> list[list[int]]:
    """Each group split by training TP rank (`HybridGroups.pp_micro`)."""
    out = []
    for group in groups:
        by_tp: dict[int, list[int]] = {}
        for r in group:
            by_tp.setdefault(ctx.train.coords(r).tp, []).append(r)
        out += list(by_tp.values())
    return out


@register_strategy
class HybridFlow(Strategy):
    name = "hybridflow"
    overlaps_buckets = True
    supports_ep = True

    def plan(self, ctx: PlanContext) -> StrategyPlan:
        # identity (d_g = 1): every micro-DP group is one rank, which already holds its
        # generation shard, so there is no collective at all (not even a one-rank all-gather)
        groups = ctx.gen.micro_dp_groups() if not ctx.gen.is_identity else []
        # expert parallelism: a rank holds only its EP rank's experts, so experts are a class of
        # their own, gathered over the EP group's micro-DP groups joined (with ep = 1 they ride
        # with the other sharded weights)
        expert_class = ctx.train.ep > 1

        def class_of(i: int) -> str:
            if ctx.replicated(i):
                return "replicated"
            return "expert" if expert_class and ctx.expert_rank(i) is not None else "sharded"

        wanted: dict[tuple[int, str], frozenset[int]] = {}

        def needed(kind: str):
            def of(group: list[int]) -> frozenset[int]:
                # a (micro-DP or expert) group shares one generation stage: its first rank speaks
                key = (ctx.gen.coords(group[0]).pp_g, kind)
                if key not in wanted:
                    wanted[key] = frozenset(i for i in ctx.gen_params(group[0]) if class_of(i) == kind)
                return wanted[key]

            return of

        collectives = []
        if groups:
            collectives.append(
                Collective(
                    "all_gather",
                    "micro_dp",
                    "shard",
                    groups,
                    shard_contributions(ctx, groups, needed("sharded")),
                )
            )
        phases: tuple[tuple[Transfer, ...], ...] = ()
        if ctx.train.etp is not None and ctx.gen.t_g > 1:
            phases = (_expert_slices(ctx),)
        elif expert_class:
            expert_groups = ctx.gen.expert_micro_dp_groups()
            collectives.append(
                Collective(
                    "all_gather",
                    "expert_micro_dp",
                    "shard",
                    expert_groups,
                    shard_contributions(ctx, expert_groups, needed("expert")),
                )
            )
        if ctx.gen.s > 1:
            norm_groups = _same_tp_subgroups(ctx, groups)
            collectives.append(
                Collective(
                    "all_gather",
                    "pp_micro",
                    "shard",
                    norm_groups,
                    shard_contributions(ctx, norm_groups, needed("replicated")),
                )
            )
        recv, send = ctx.traffic(collectives, phases)
        ranks = []
        for r in range(ctx.train.world_size):
            own, need = ctx.train_segs(r), ctx.gen_segs(r)
            ranks.append(RankCost(r, recv[r], send[r], ctx.nbytes(need), ctx.nbytes(own - need)))
        plan = StrategyPlan(self.name, ctx.gen.d_g, ranks, collectives, phases)
        ctx._cache[("plan", self.name)] = plan  # hybridflow_hier routes this same plan per node
        return plan

    def execute(self, plan, engine, train, zero_shards):
        views, buffers = engine.gather_all(plan, train, copy_own=False)
        parts, part_buffers = engine.run_phases(plan, train) if plan.phases else ({}, [])
        with engine.phase("assemble"):
            return assemble(engine, train, lambda h, p: views[(h, p.name)], buffers + part_buffers, parts)


def _expert_slices(ctx: PlanContext) -> tuple[Transfer, ...]:
    """One message per (holder, generation rank): the parts of the holder's expert shards that
    the rank generates with and does not train itself."""
    train, t_g = ctx.train, ctx.gen.t_g
    experts: dict[int, list[tuple[int, int, int]]] = {}  # generation stage -> (index, EP rank, stage)
    for c in range(ctx.gen.p_g):
        experts[c] = [
            (i, ctx.expert_rank(i), stages_of(ctx.params[i], ctx.spec.num_layers, train.p)[0])
            for i in ctx.stage_params(c, ctx.gen.p_g)
            if ctx.params[i].expert is not None
        ]
    pieces: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for dst in range(train.world_size):
        me, g = train.coords(dst), ctx.gen.coords(dst)
        sources = [j for j in range(train.expert_t) if slice_parts(train, t_g, j, g.tp_g)]
        for i, owner, stage in experts[g.pp_g]:
            trains_it = owner == me.ep and stage == me.pp
            for j in sources:
                if not (trains_it and j == me.etp):
                    holder = train.expert_rank_of(pp=stage, edp=me.edp, ep=owner, etp=j)
                    pieces.setdefault((holder, dst), []).append((holder, i))
    return tuple(Transfer(src, dst, "slice", tuple(p)) for (src, dst), p in sorted(pieces.items()))


def assemble(engine, train: dict, received, buffers: list, parts: dict | None = None):
    """This rank's generation weights from its own training shards (in place) and the pieces
    `received(holder, param)` it got from the other members of its micro-DP group (an expert's
    from the member of its EP group that holds the expert), or an expert's `parts` (by
    (param index, part), see `plan.slice_parts`) received point to point."""
    gen, me = engine.gen, engine.rank
    c = gen.coords(me)
    mine = engine.train.coords(me)
    pieces = {}
    for p in engine.stage_params(c.pp_g, gen.p_g):
        stage = stages_of(p, engine.spec.num_layers, engine.train.p)[0]
        tps = [mine.tp] if p.kind is ShardKind.REPLICATED else range(c.tp_g * gen.r, (c.tp_g + 1) * gen.r)
        dp = c.dp
        if p.expert is not None and engine.train.etp is not None and gen.t_g > 1:
            pieces[p.name] = _expert_parts(engine, train, p, parts or {})
            continue
        if p.expert is not None and engine.train.etp is not None:  # t_g = 1: every etp shard
            owner = expert_owner(engine.spec, p.expert, engine.train.ep)[0]
            holders = [
                engine.train.expert_rank_of(pp=stage, edp=mine.edp, ep=owner, etp=j)
                for j in range(engine.train.expert_t)
            ]
            pieces[p.name] = [train[p.name] if h == me else received(h, p) for h in holders]
            continue
        if p.expert is not None:  # the data-parallel rank of this EP group that holds the expert
            dp += expert_owner(engine.spec, p.expert, engine.train.ep)[0] - mine.ep
        holders = [engine.train.rank_of(pp=stage, dp=dp, tp=i) for i in tps]
        pieces[p.name] = [train[p.name] if h == me else received(h, p) for h in holders]
    return engine.weights(pieces, {}, buffers, c.tp_g)


def _expert_parts(engine, train: dict, p, parts: dict) -> list:
    """The parts of expert parameter `p`'s generation shard, in order: cut from this rank's own
    training shard where it trains them, else the received ones."""
    from rl3d.ops.layouts import shard_for_tp  # the planner stays free of torch

    layout, t_g = engine.train, engine.gen.t_g
    n, me, tp_g = expert_parts(layout, t_g), layout.coords(engine.rank), engine.gen.coords(engine.rank).tp_g
    own = slice_parts(layout, t_g, me.etp, tp_g) if p.name in train else range(0)
    per = n // layout.expert_t  # parts of one training shard
    index = engine.index_of[p.name]
    return [
        shard_for_tp(train[p.name], p.kind, per, q - me.etp * per) if q in own else parts[(index, q)]
        for q in range(tp_g * n // t_g, (tp_g + 1) * n // t_g)
    ]
