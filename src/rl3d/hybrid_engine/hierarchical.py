"""Hierarchical gather: one network fetch per node, then a fan-out inside the node.

HybridFlow's micro-DP all-gather sends every member's shard to every other member, so when
two GPUs of one node need the same piece from another node, that piece crosses the node's
network link twice. This strategy plans, per node, one fetch of each remote piece its GPUs
need (by the needing GPU with the fewest fetched bytes so far, from the piece's holder),
then the fetcher relays it to its node-mates over the intra-node fabric. A piece some GPU of
the node already holds (the same shard of another data-parallel replica) is taken from it,
never over the network. A piece is identified by its bytes: (parameter, training TP rank),
or the parameter alone when it is replicated (norms).

It is registered as its own strategy, `hybridflow_hier`, not as an option of `hybridflow`:
training runs reshard with `hybridflow`, whose plan and numerics stay exactly as they were,
while the benchmark and `rl3d plan` compare the two side by side by name. Both produce the
same generation weights (same pieces, same assembly); only the routing differs.

The nodes come from the caller (`plan_transition(..., nodes=NodeMap)`, `Resharder(nodes=)`);
without them, ranks are grouped `DEFAULT_GPUS_PER_NODE` to a node in rank order.
"""

from __future__ import annotations

from collections import defaultdict

from rl3d.hybrid_engine.hybridflow import HybridFlow, assemble
from rl3d.hybrid_engine.nodes import NodeMap, link_bytes
from rl3d.hybrid_engine.plan import (
    Collective,
    PlanContext,
    RankCost,
    StrategyPlan,
    Transfer,
    piece_key,
    rank_traffic,
)
from rl3d.hybrid_engine.strategy import register_strategy

DEFAULT_GPUS_PER_NODE = 8  # the paper's testbed (DGX A100)


def hierarchize(
    ctx: PlanContext, collectives: list[Collective], nodes: NodeMap
) -> tuple[tuple[Transfer, ...], ...]:
    """Route what `collectives` (all-gathers of training shards) deliver as two point-to-point
    phases: direct or network fetches, then the fetchers' fan-out inside each node.

    Routing works on blocks: the pieces one member sends in one collective, all replicated or
    all sharded, are identified by (their parameter indices, the sender's TP rank or -1). Two
    senders of the same block send the same bytes. A block that mixes replicated and sharded
    parameters, or that its receiver partly holds, is split into one block per piece."""
    t = ctx.train.t
    replicated = [ctx.replicated(i) for i in range(len(ctx.params))]

    def key(index: int, holder: int) -> tuple[int, int]:
        return (index, -1) if replicated[index] else (index, holder % t)  # megatron order: tp fastest

    own: dict[int, set[tuple[int, int]]] = {}
    held_on: dict[tuple[tuple[int, int], int], list[int]] = defaultdict(list)  # (key, node) -> holders
    for r in range(ctx.train.world_size):
        own[r] = {key(i, r) for i in ctx.train_params(r)}
        for k in own[r]:
            held_on[(k, nodes.node_of(r))].append(r)

    Block = tuple[tuple[int, ...], int]
    block_keys: dict[Block, list[tuple[int, int]]] = {}

    def blocks_of(src: int, indices: tuple[int, ...]) -> list[tuple[Block, tuple[int, ...]]]:
        kinds = {replicated[i] for i in indices}
        if len(kinds) == 1:
            out = [((indices, -1 if replicated[indices[0]] else src % t), indices)]
        else:
            out = [(((i,), key(i, src)[1]), (i,)) for i in indices]
        for b, idx in out:
            if b not in block_keys:
                block_keys[b] = [key(i, src) for i in idx]
        return out

    needs: dict[int, dict[Block, tuple[int, tuple[int, ...]]]] = defaultdict(dict)
    for c in collectives:
        assert c.unit == "shard", f"hierarchical gather routes training shards, not {c.unit}"
        for group, contrib in zip(c.groups, c.contributions):
            sent = {src: blocks_of(src, tuple(contrib[src])) for src in group if contrib.get(src)}
            for dst in c.receivers(group):
                mine, wants = own.get(dst, set()), needs[dst]
                for src, blocks in sent.items():
                    if src == dst:
                        continue
                    for b, idx in blocks:
                        if b in wants:
                            continue
                        if mine.isdisjoint(block_keys[b]):
                            wants[b] = (src, idx)
                            continue
                        for i in idx:  # partly held: only the pieces it lacks
                            if key(i, src) not in mine:
                                single = ((i,), key(i, src)[1])
                                block_keys.setdefault(single, [key(i, src)])
                                wants.setdefault(single, (src, (i,)))
    block_bytes: dict[Block, int] = {}
    first: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    relay: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for n, members in enumerate(nodes.nodes):
        wanted: dict[Block, list[int]] = defaultdict(list)
        for m in sorted(members):
            for b in needs.get(m, {}):
                wanted[b].append(m)
        fetched: dict[int, int] = defaultdict(int)
        for b in sorted(wanted):
            needers, keys = wanted[b], block_keys[b]
            local = [h for h in held_on.get((keys[0], n), ()) if own[h].issuperset(keys)]
            if local:  # a node-mate holds it: straight over the intra-node fabric
                for j, dst in enumerate(needers):
                    src = local[j % len(local)]
                    first[(src, dst)] += [(src, i) for i in b[0]]
                continue
            fetcher = min(needers, key=lambda m: (fetched[m], m))
            holder, idx = needs[fetcher][b]
            if b not in block_bytes:
                block_bytes[b] = sum(ctx.piece_bytes("shard", i, holder) for i in idx)
            fetched[fetcher] += block_bytes[b]
            pieces = [(holder, i) for i in idx]
            first[(holder, fetcher)] += pieces
            for dst in needers:
                if dst != fetcher:
                    relay[(fetcher, dst)] += pieces

    def phase(moves) -> tuple[Transfer, ...]:
        return tuple(
            Transfer(src, dst, "shard", tuple(pieces)) for (src, dst), pieces in sorted(moves.items())
        )

    return tuple(p for p in (phase(first), phase(relay)) if p)


def nodes_of(ctx: PlanContext) -> NodeMap:
    if ctx.nodes is not None:
        return ctx.nodes
    return NodeMap.contiguous(ctx.train.world_size, DEFAULT_GPUS_PER_NODE)


@register_strategy
class HybridFlowHier(HybridFlow):  # hybridflow's pieces, routed per node
    name = "hybridflow_hier"
    overlaps_buckets = False  # point-to-point phases, not bucketed all-gathers

    def plan(self, ctx: PlanContext) -> StrategyPlan:
        base = ctx._cache.get(("plan", "hybridflow")) or super().plan(ctx)
        nodes = nodes_of(ctx)
        phases = hierarchize(ctx, base.collectives, nodes)
        pairs = ctx.pair_traffic([], phases)
        recv, send = rank_traffic(pairs)
        ranks = [
            RankCost(r.rank, recv[r.rank], send[r.rank], r.peak_param_bytes, r.redundant_bytes)
            for r in base.ranks
        ]
        links = link_bytes(pairs, nodes).to_json()
        return StrategyPlan(self.name, base.d_g, ranks, [], phases, links)

    def execute(self, plan, engine, train, zero_shards):
        got, buffers = engine.run_phases(plan, train)
        index = engine.index_of

        def received(holder, p):
            return got[piece_key(index[p.name], engine.is_replicated(p), engine.train.coords(holder).tp)]

        return assemble(engine, train, received, buffers)
