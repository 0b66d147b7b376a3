"""HybridFlow's regrouped transition (EuroSys'25, section 5.3): the strategy training runs use.

Each micro-DP group of d_g ranks already holds, between its members, the generation shard
every member needs, so one all-gather inside the group builds it, and each rank's own
training shard is a piece of it in place (no copy, no redundant memory). Replicated norms
travel only when PP folds into micro-DP (s > 1), and then only among the members with the
same training TP rank (each stage's norms come from one holder).
"""

from __future__ import annotations

from rl3d.hybrid_engine.params import stages_of
from rl3d.hybrid_engine.plan import Collective, PlanContext, RankCost, StrategyPlan, shard_contributions
from rl3d.hybrid_engine.strategy import Strategy, register_strategy
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

    def plan(self, ctx: PlanContext) -> StrategyPlan:
        # identity (d_g = 1): every micro-DP group is one rank, which already holds its
        # generation shard, so there is no collective at all (not even a one-rank all-gather)
        groups = ctx.gen.micro_dp_groups() if not ctx.gen.is_identity else []

        wanted: dict[tuple[int, bool], frozenset[int]] = {}

        def needed(replicated: bool):
            def of(group: list[int]) -> frozenset[int]:
                # a micro-DP group shares one generation stage: its first rank speaks for all
                key = (ctx.gen.coords(group[0]).pp_g, replicated)
                if key not in wanted:
                    wanted[key] = frozenset(
                        i for i in ctx.gen_params(group[0]) if ctx.replicated(i) == replicated
                    )
                return wanted[key]

            return of

        collectives = []
        if groups:
            collectives.append(
                Collective(
                    "all_gather", "micro_dp", "shard", groups, shard_contributions(ctx, groups, needed(False))
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
                    shard_contributions(ctx, norm_groups, needed(True)),
                )
            )
        recv, send = ctx.traffic(collectives)
        ranks = []
        for r in range(ctx.train.world_size):
            own, need = ctx.train_segs(r), ctx.gen_segs(r)
            ranks.append(RankCost(r, recv[r], send[r], ctx.nbytes(need), ctx.nbytes(own - need)))
        plan = StrategyPlan(self.name, ctx.gen.d_g, ranks, collectives)
        ctx._cache[("plan", self.name)] = plan  # hybridflow_hier routes this same plan per node
        return plan

    def execute(self, plan, engine, train, zero_shards):
        views, buffers = engine.gather_all(plan, train, copy_own=False)
        return assemble(engine, train, lambda h, p: views[(h, p.name)], buffers)


def assemble(engine, train: dict, received, buffers: list):
    """This rank's generation weights from its own training shards (in place) and the pieces
    `received(holder, param)` it got from the other members of its micro-DP group."""
    gen, me = engine.gen, engine.rank
    c = gen.coords(me)
    my_tp = engine.train.coords(me).tp
    pieces = {}
    for p in engine.stage_params(c.pp_g, gen.p_g):
        stage = stages_of(p, engine.spec.num_layers, engine.train.p)[0]
        tps = [my_tp] if p.kind is ShardKind.REPLICATED else range(c.tp_g * gen.r, (c.tp_g + 1) * gen.r)
        holders = [engine.train.rank_of(pp=stage, dp=c.dp, tp=i) for i in tps]
        pieces[p.name] = [train[p.name] if h == me else received(h, p) for h in holders]
    return engine.weights(pieces, {}, buffers, c.tp_g)
