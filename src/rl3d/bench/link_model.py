"""The measured transition's time on a shaped inter-node link, from the plan alone.

`rl3d.bench.measured` runs each strategy with rl3d's executor on gloo. This model predicts
that run for any rank -> node map (`NodeMap` over every rank of the run: training ranks and
openrlhf's rollout ranks n..2n-1, wherever the launcher put them), a link rate and a
per-call latency, in three steps:

1. The executor's calls (`executor_calls`), as the executor issues them, one after another:
   - an all-gather of training shards (hybridflow, hybridflow_v): bucketed
     (`plan.bucket_bounds`, `bucket_mb`); per bucket one ring all-gather when every
     member's bucket has the same size, else one broadcast per sender that has bytes
     (`CountedComm.all_gather_v`). The groups of one collective run at once: their k-th calls
     are charged as one call.
   - an all-gather of ZeRO-3 chunks (ds_chat): one ring all-gather per parameter.
   - a gather (openrlhf's first step): one send to the group's first rank per parameter and
     member that holds a piece of it.
   - a broadcast of full tensors (openrlhf's second step): one broadcast per bucket.
   - a point-to-point phase (hybridflow_hier): every transfer of the phase at once.
2. gloo's algorithm under each call (the wire): an all-gather is a ring in group-rank order
   (ranks sorted), every member sending its successor the n-1 chunks it does not own; a
   broadcast is gloo's binomial tree (`gloo/broadcast.cc`: in round i every virtual rank
   v < 2^i sends to v + 2^i, the root being virtual rank 0); a send is one transfer.
3. Time: per round of a call, the busiest egress (a node's link: bytes leaving the node /
   `link_gbit`, or / `two_way_gbit` when given and the link also carries bytes in; inside a
   node: the bytes one rank sends to node-mates / `local_gbit`), plus `alpha_s` per latency
   step of the call (ring n-1, tree its rounds, send 1; `local_alpha_s` for a call whose
   ranks share one node). Calls add up. With `burst_bytes` (tbf's bucket) a node link banks
   tokens while idle (before the transition, during a call's latency, while its peers finish
   a round) and sends that many bytes at once: latency and transfer then overlap.

Not modelled: packing and layout copies (CPU time, reported by the measured benchmark), TCP
and tbf behaviour: the nominal model takes the link at its rate both ways; the benchmark also
predicts with the rates a one-way stream and a two-way exchange got from the link in the
same run (`link_gbit`, `two_way_gbit` measured), next to the nominal prediction.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from rl3d.hybrid_engine.nodes import NodeMap
from rl3d.hybrid_engine.plan import Collective, TransitionPlan, bucket_bounds


@dataclass(frozen=True)
class LinkSetup:
    """Where every rank runs and what the links do."""

    nodes: NodeMap  # every rank of the run, rollout ranks included
    link_gbit: float  # each node's network link, per direction (the tbf rate)
    local_gbit: float = 20.0  # one rank's sends to node-mates (loopback)
    alpha_s: float = 0.0  # latency per step of a call across nodes (a ring step, a tree round, a send)
    local_alpha_s: float | None = None  # the same for a call inside one node; None: alpha_s
    # per direction while the node's link carries bytes both ways in the same round (a ring
    # across nodes); None: `link_gbit` (the nominal model). Measured: `rl3d.bench.link_probe`.
    two_way_gbit: float | None = None
    # tbf's bucket (bytes): a node link idle for t seconds banks min(burst, rate x t) bytes that
    # then leave at once (between calls, while a call waits on its latency); 0: no bucket
    burst_bytes: int = 0


@dataclass(frozen=True)
class Call:
    """One call of the executor: `rounds` of wire transfers {(src, dst): bytes}, run one after
    another, and the latency steps it costs."""

    name: str
    rounds: tuple[dict[tuple[int, int], int], ...]
    steps: int
    ranks: frozenset[int] = field(default_factory=frozenset)  # who takes part (a counted call each)


def ring(group, chunks: dict[int, int], name: str = "all_gather") -> Call:
    """gloo's ring all-gather: member i sends member i+1 the n-1 chunks it does not own."""
    order = sorted(group)
    n = len(order)
    if n < 2:
        return Call(name, (), 0, frozenset(order))
    hop = (n - 1) * chunks[order[0]]
    wire = {(order[i], order[(i + 1) % n]): hop for i in range(n)} if hop else {}
    return Call(name, (wire,), n - 1, frozenset(order))


def tree(group, root: int, nbytes: int, name: str = "broadcast") -> Call:
    """gloo's binomial-tree broadcast over `group` (group ranks in sorted order) from `root`."""
    order = sorted(group)
    size, start = len(order), order.index(root)
    rounds, i = [], 0
    while (1 << i) < size:
        step = {}
        for v in range(1 << i):
            peer = v + (1 << i)
            if peer < size and nbytes:
                step[(order[(v + start) % size], order[(peer + start) % size])] = nbytes
        rounds.append(step)
        i += 1
    return Call(name, tuple(rounds), len(rounds), frozenset(order))


def send(src: int, dst: int, nbytes: int, name: str = "send") -> Call:
    return Call(name, ({(src, dst): nbytes},), 1, frozenset((src, dst)))


def _merge(per_group: list[list[Call]]) -> list[Call]:
    """The groups of one collective run at once: their k-th calls become one call."""
    merged = []
    for k in range(max((len(c) for c in per_group), default=0)):
        calls = [c[k] for c in per_group if k < len(c)]
        depth = max(len(c.rounds) for c in calls)
        rounds = []
        for j in range(depth):
            step: dict[tuple[int, int], int] = {}
            for c in calls:
                step.update(c.rounds[j] if j < len(c.rounds) else {})
            rounds.append(step)
        ranks = frozenset().union(*(c.ranks for c in calls))
        merged.append(Call(calls[0].name, tuple(rounds), max(c.steps for c in calls), ranks))
    return merged


def _bucketed_all_gather(ctx, c: Collective, limit: int) -> list[Call]:
    per_group = []
    for group, contrib in zip(c.groups, c.contributions):
        sizes = {m: [ctx.piece_bytes(c.unit, i, m) for i in contrib.get(m, ())] for m in group}
        cuts = {m: bucket_bounds(sizes[m], limit) for m in group}
        calls = []
        for k in range(max(len(v) for v in cuts.values())):
            bucket = {m: sum(sizes[m][slice(*cuts[m][k])]) if k < len(cuts[m]) else 0 for m in group}
            if len(set(bucket.values())) == 1 and bucket[group[0]] > 0:
                calls.append(ring(group, bucket, f"{c.group_kind}_all_gather"))
            else:  # CountedComm.all_gather_v: one broadcast per sender with bytes
                calls += [tree(group, m, b, f"{c.group_kind}_broadcast_v") for m, b in bucket.items() if b]
        per_group.append(calls)
    return _merge(per_group)


def _collective_calls(ctx, c: Collective, limit: int) -> list[Call]:
    if c.op == "all_gather" and c.unit == "shard":
        return _bucketed_all_gather(ctx, c, limit)
    if c.op == "all_gather":  # ZeRO-3: one all-gather per parameter, every member the same list
        per_group = []
        for group, contrib in zip(c.groups, c.contributions):
            name = f"{c.group_kind}_all_gather"
            chunks = [{m: ctx.piece_bytes(c.unit, i, m) for m in group} for i in contrib[group[0]]]
            per_group.append([ring(group, chunk, name) for chunk in chunks])
        return _merge(per_group)
    if c.op == "gather":  # one send per parameter and member, to the group's first rank
        per_group = []
        for group, contrib in zip(c.groups, c.contributions):
            root, held = group[0], {m: frozenset(contrib.get(m, ())) for m in group[1:]}
            order = sorted({i for idx in held.values() for i in idx})
            per_group.append(
                [
                    send(m, root, ctx.piece_bytes(c.unit, i, m), f"{c.group_kind}_send")
                    for i in order
                    for m in group[1:]
                    if i in held[m]
                ]
            )
        return _merge(per_group)
    per_group = []  # broadcast from the group's first rank, bucket by bucket
    for group, contrib in zip(c.groups, c.contributions):
        root = group[0]
        sizes = [ctx.piece_bytes(c.unit, i, root) for i in contrib[root]]
        name = f"{c.group_kind}_broadcast"
        buckets = bucket_bounds(sizes, limit)
        per_group.append([tree(group, root, sum(sizes[lo:hi]), name) for lo, hi in buckets])
    return _merge(per_group)


def executor_calls(plan: TransitionPlan, strategy: str, *, bucket_mb: float) -> list[Call]:
    """The calls rl3d's executor makes for `strategy`, in order, with gloo's wire transfers."""
    s, ctx = plan.strategies[strategy], plan._ctx
    limit = int(bucket_mb * 2**20) // ctx.dtype_bytes * ctx.dtype_bytes
    calls = [call for c in s.collectives for call in _collective_calls(ctx, c, limit)]
    for phase in s.phases:  # `CountedComm.exchange`: every transfer of the phase at once
        pairs = ctx.pair_traffic([], (phase,))
        ranks = frozenset(r for pair in pairs for r in pair)
        calls.append(Call("exchange", (pairs,), 1, ranks))
    return calls


def call_seconds(
    call: Call, setup: LinkSetup, tokens: dict[int, float] | None = None
) -> tuple[float, dict[int, int]]:
    """(seconds, bytes each node sent over its link) of one call. `tokens`: each node's tbf
    bucket before the call (with `setup.burst_bytes`), updated in place."""
    link, local = setup.link_gbit * 1e9 / 8, setup.local_gbit * 1e9 / 8
    two_way = (setup.two_way_gbit or setup.link_gbit) * 1e9 / 8
    inside = len({setup.nodes.node_of(r) for r in call.ranks}) == 1 and setup.local_alpha_s is not None
    seconds = call.steps * (setup.local_alpha_s if inside else setup.alpha_s)
    bucket = tokens if setup.burst_bytes and tokens is not None else None

    def idle(node: int, seconds_idle: float) -> None:
        if bucket is not None:
            bucket[node] = min(setup.burst_bytes, bucket.get(node, setup.burst_bytes) + link * seconds_idle)

    for node in range(setup.nodes.num_nodes):
        idle(node, seconds)  # the call's latency: no bytes on the link yet
    sent: dict[int, int] = defaultdict(int)
    for step in call.rounds:
        egress: dict[int, int] = defaultdict(int)
        ingress: dict[int, int] = defaultdict(int)
        mates: dict[int, int] = defaultdict(int)
        for (src, dst), nbytes in step.items():
            a, b = setup.nodes.node_of(src), setup.nodes.node_of(dst)
            if a != b:
                egress[a] += nbytes
                ingress[b] += nbytes
            else:
                mates[src] += nbytes
        busy = {}
        for node, nbytes in egress.items():
            sent[node] += nbytes
            banked = bucket.get(node, setup.burst_bytes) if bucket is not None else 0.0
            busy[node] = max(0.0, nbytes - banked) / (two_way if ingress.get(node) else link)
            if bucket is not None:
                bucket[node] = max(0.0, banked - nbytes)
        span = max(max(busy.values(), default=0.0), max(mates.values(), default=0) / local)
        for node in range(setup.nodes.num_nodes):
            idle(node, span - busy.get(node, 0.0))
        seconds += span
    return seconds, dict(sent)


def model_strategy(plan: TransitionPlan, strategy: str, setup: LinkSetup, *, bucket_mb: float) -> dict:
    """The predicted time of one strategy's transition, its terms, and the bytes on each link:
    `wire_sent` (what gloo's algorithms put on each node's link) next to `planned_links` (the
    plan's logical sender -> receiver bytes over the nodes, what the executor counts)."""
    calls = executor_calls(plan, strategy, bucket_mb=bucket_mb)
    missing = sorted({r for c in calls for r in c.ranks} - set(setup.nodes._node_of))
    if missing:
        raise ValueError(f"ranks {missing} of {strategy} are on no node of {setup.nodes.to_json()}")
    seconds, latency, wire = 0.0, 0.0, defaultdict(int)
    per_rank: dict[int, int] = defaultdict(int)
    tokens: dict[int, float] = {}  # full buckets: the link was idle before the transition
    for call in calls:
        t, sent = call_seconds(call, setup, tokens)
        seconds += t
        latency += call_seconds(Call(call.name, (), call.steps, call.ranks), setup)[0]
        for node, nbytes in sent.items():
            wire[node] += nbytes
        for r in call.ranks:
            per_rank[r] += 1
    planned = plan.link_bytes(strategy, setup.nodes)
    return {
        "seconds": seconds,
        "latency_seconds": latency,
        "transfer_seconds": seconds - latency,
        "calls_max": max(per_rank.values(), default=0),
        "wire_sent": {str(k): wire.get(k, 0) for k in range(setup.nodes.num_nodes)},
        "wire_sent_max": max(wire.values(), default=0),
        "planned_links": planned.to_json(),
        "planned_node_out_max": max(planned.inter_out.values(), default=0),
    }
