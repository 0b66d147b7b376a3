"""The transition baselines HybridFlow is compared against (EuroSys'25, Table 2).

No training run may use them (the recipe check refuses them), so the package does not import
this module: importing it registers them in the same strategy registry, as `rl3d.bench` and the
cost models of the 2024 systems (`rl3d.costs.mechanisms`) do, so `rl3d plan`, `rl3d bench`, the
step simulator and the `Resharder` plan and execute them like `hybridflow`, and their counted
bytes equal their planned bytes by the same construction.

- `hybridflow_v`: all-gather of the whole replica across its t*p ranks into a separate buffer,
  then each rank slices its generation shard (vanilla grouping, no regrouping).
- `ds_chat`: training weights ZeRO-3-partitioned over all t*p*d ranks (each parameter
  flattened, padded to a multiple of N); one all-gather per parameter over all N ranks
  builds the full model, as DeepSpeed's ZeRO-3 does.
- `openrlhf`: rollout on a separate set of GPUs (as many as the trainer has, same generation
  layout); trainer rank 0 receives every shard it lacks point to point, then broadcasts full
  tensors, bucket by bucket, to every rollout GPU (world ranks train_world ..).

Peak memory: hybridflow_v and ds_chat hold the gathered full model; an openrlhf rollout GPU
holds its shard plus one full tensor in flight. Redundant memory: the whole training shard
for hybridflow_v and ds_chat (gathered into a separate buffer) and for openrlhf's trainer
GPUs (the model lives twice).
"""

from __future__ import annotations

from rl3d.hybrid_engine.params import stages_of
from rl3d.hybrid_engine.plan import Collective, PlanContext, RankCost, StrategyPlan, shard_contributions
from rl3d.hybrid_engine.strategy import Strategy, register_strategy
from rl3d.parallel.sharding import ShardKind


def _vanilla_gen_coords(engine, rank: int) -> tuple[int, int]:
    """(gen tp, gen pp) under the vanilla grouping the baselines use: a replica's ranks in
    megatron order (tp fastest, then micro-DP, then pp) with no regrouping."""
    gen, train = engine.gen, engine.train
    c = train.coords(rank)
    q = c.tp + train.t * c.pp
    return q % gen.t_g, q // (gen.t_g * gen.d_g)


def _unpiped(ctx: PlanContext) -> tuple[int, ...]:
    """What a rollout engine loads: the parameters without megatron's pipeline copies."""
    return ctx.stage_params(0, 1)


@register_strategy
class HybridFlowV(Strategy):
    name = "hybridflow_v"

    def plan(self, ctx: PlanContext) -> StrategyPlan:
        sharded = frozenset(i for i in range(len(ctx.params)) if not ctx.replicated(i))
        groups = ctx.train.model_parallel_groups()
        collectives = [
            Collective(
                "all_gather",
                "model_parallel",
                "shard",
                groups,
                shard_contributions(ctx, groups, lambda g: sharded),
            )
        ]
        if ctx.train.p > 1:  # the norms of the other stages, from the holder with the same TP rank
            norms = frozenset(i for i in range(len(ctx.params)) if ctx.replicated(i))
            pipes = ctx.train.pp_groups()
            collectives.append(
                Collective(
                    "all_gather", "pipeline", "shard", pipes, shard_contributions(ctx, pipes, lambda g: norms)
                )
            )
        held = [i for i, p in enumerate(ctx.params) if stages_of(p, ctx.spec.num_layers, ctx.train.p)]
        full = ctx.nbytes(frozenset(s for i in held for s in ctx.table.full(i)))
        recv, send = ctx.traffic(collectives)
        ranks = [
            RankCost(r, recv[r], send[r], full, ctx.nbytes(ctx.train_segs(r)))
            for r in range(ctx.train.world_size)
        ]
        return StrategyPlan(self.name, ctx.gen.d_g, ranks, collectives)

    def execute(self, plan, engine, train, zero_shards):
        import torch

        views, buffers = engine.gather_all(plan, train, copy_own=True)
        if engine.train.p == 1:  # one stage: the norms are the rank's own, copied into the separate buffer
            norms = [p for p in engine.params if p.kind is ShardKind.REPLICATED]
            norm_buf = torch.cat([train[p.name].reshape(-1) for p in norms])
            cursor = 0
            for p in norms:
                views[(engine.rank, p.name)] = norm_buf[cursor : cursor + p.numel].view(p.shape)
                cursor += p.numel
            buffers.append(norm_buf)
        a, c_pp = _vanilla_gen_coords(engine, engine.rank)
        c = engine.train.coords(engine.rank)
        pieces = {}
        for p in engine.stage_params(c_pp, engine.gen.p_g):
            stage = stages_of(p, engine.spec.num_layers, engine.train.p)[0]
            r = engine.gen.r
            tps = [c.tp] if p.kind is ShardKind.REPLICATED else range(a * r, (a + 1) * r)
            pieces[p.name] = [views[(engine.train.rank_of(pp=stage, dp=c.dp, tp=i), p.name)] for i in tps]
        return engine.weights(pieces, {}, buffers, a)


@register_strategy
class DSChat(Strategy):
    name = "ds_chat"
    needs_zero_shards = True

    def plan(self, ctx: PlanContext) -> StrategyPlan:
        n = ctx.train.world_size
        world = list(range(n))
        # ZeRO-3 has no pipeline copy of a tied output layer: it partitions the unpipelined inventory.
        collectives = [
            Collective("all_gather", "world", "zero_chunk", [world], [dict.fromkeys(world, _unpiped(ctx))])
        ]
        chunk = sum(ctx.piece_bytes("zero_chunk", i, 0) for i in _unpiped(ctx))
        recv, send = ctx.traffic(collectives)
        ranks = [RankCost(r, recv[r], send[r], n * chunk, chunk) for r in world]
        return StrategyPlan(self.name, ctx.gen.d_g, ranks, collectives)

    def execute(self, plan, engine, train, zero_shards):
        import torch

        (collective,) = plan.collectives
        ranks, contrib = collective.group_of(engine.rank)
        group = getattr(engine.groups, collective.group_kind)
        full, buffers = {}, []
        for i in contrib[engine.rank]:  # ZeRO-3 gathers parameter by parameter
            p = engine.params[i]
            chunk = engine.piece_numel("zero_chunk", p)
            buf = torch.empty(len(ranks) * chunk, dtype=engine.dtype, device=engine.device)
            chunks = {m: buf[k * chunk : (k + 1) * chunk] for k, m in enumerate(ranks)}
            chunks[engine.rank].copy_(zero_shards[p.name])
            engine.comm.all_gather_v(group, chunks)
            full[p.name] = buf[: p.numel].view(p.shape)
            buffers.append(buf)
        a, c_pp = _vanilla_gen_coords(engine, engine.rank)
        needed = {p.name for p in engine.stage_params(c_pp, engine.gen.p_g)}
        return engine.weights({}, {k: v for k, v in full.items() if k in needed}, buffers, a)


@register_strategy
class OpenRLHF(Strategy):
    name = "openrlhf"
    uses_rollout_ranks = True

    def plan(self, ctx: PlanContext) -> StrategyPlan:
        n = ctx.train.world_size
        unpiped = _unpiped(ctx)
        wanted = frozenset(unpiped)
        replica0 = ctx.train.model_parallel_groups()[0]
        gather = shard_contributions(ctx, [replica0], lambda g: wanted)[0]
        # rank 0 keeps its own shards; each other stage's norms come from its TP rank 0
        gather = {
            m: () if m == 0 else tuple(i for i in idx if not ctx.replicated(i) or ctx.train.coords(m).tp == 0)
            for m, idx in gather.items()
        }
        rollout = [0, *range(n, 2 * n)]
        collectives = [
            Collective("gather", "model_parallel", "shard", [replica0], [gather]),
            Collective("broadcast", "rollout_broadcast", "full", [rollout], [{0: unpiped}]),
        ]
        recv, send = ctx.traffic(collectives)
        largest = max(ctx.piece_bytes("full", i, 0) for i in unpiped)
        ranks = []
        for r in range(n):
            own = ctx.nbytes(ctx.train_segs(r))
            ranks.append(RankCost(r, recv[r], send[r], own + largest if r == 0 else own, own))
        for r in range(n):  # the rollout GPUs: full tensors in, their generation shard kept
            ranks.append(RankCost(n + r, recv[n + r], send[n + r], ctx.nbytes(ctx.gen_segs(r)) + largest, 0))
        return StrategyPlan(self.name, ctx.gen.d_g, ranks, collectives)

    def execute(self, plan, engine, train, zero_shards):
        import torch

        from rl3d.hybrid_engine.params import shard_shape
        from rl3d.hybrid_engine.plan import bucket_bounds
        from rl3d.ops import pack_bucket
        from rl3d.ops.layouts import merge_tp_shards, shard_for_tp

        gather, broadcast = plan.collectives
        n, me, dtype, device = engine.train.world_size, engine.rank, engine.dtype, engine.device
        unpiped = broadcast.contributions[0][0]
        gathered: dict[str, list[torch.Tensor]] = {}
        found = gather.group_of(me)
        if found is not None:  # trainer replica 0: every shard rank 0 lacks goes to it point to point
            ranks, contrib = found
            group = getattr(engine.groups, gather.group_kind)
            sources = {m: frozenset(contrib[m]) for m in ranks[1:]}
            for i in unpiped:
                p = engine.params[i]
                shards = [train[p.name]] if me == ranks[0] and p.name in train else []
                for m in ranks[1:]:
                    if i not in sources[m]:
                        continue
                    if me == m:
                        engine.comm.send(group, train[p.name].contiguous(), dst=ranks[0])
                    elif me == ranks[0]:
                        buf = torch.empty(shard_shape(p, engine.train.t), dtype=dtype, device=device)
                        engine.comm.recv(group, buf, src=m)
                        shards.append(buf)
                gathered[p.name] = shards
        if me != 0 and me < n:
            return None  # the other trainer ranks hold no generation weights
        # Rank 0 broadcasts full tensors, bucket by bucket; each rollout rank keeps its shard.
        group = getattr(engine.groups, broadcast.group_kind)
        c = engine.gen.coords(me - n if me >= n else 0)
        keep = {p.name for p in engine.stage_params(c.pp_g, engine.gen.p_g)}
        params = [engine.params[i] for i in unpiped]
        numels = [p.numel for p in params]
        element = torch.empty((), dtype=dtype).element_size()
        pieces = {}
        for lo, hi in bucket_bounds(numels, engine.bucket_bytes // element):
            bucket = torch.empty(sum(numels[lo:hi]), dtype=dtype, device=device)
            if me == 0:
                fulls = [merge_tp_shards(gathered[p.name], p.kind) for p in params[lo:hi]]
                pack_bucket(fulls, out=bucket, backend=engine.kernel_backend)
            engine.comm.broadcast(group, bucket, src=0)
            if me >= n:
                cursor = 0
                for p in params[lo:hi]:
                    if p.name in keep:
                        full = bucket[cursor : cursor + p.numel].view(p.shape)
                        pieces[p.name] = [shard_for_tp(full, p.kind, engine.gen.t_g, c.tp_g).clone()]
                    cursor += p.numel
        if me == 0:
            return None
        return engine.weights(
            pieces, {}, [t for v in pieces.values() for t in v], c.tp_g, gen_tp_as_train=True
        )
