"""Each system's transition as the sequence of calls it really makes, costed on a cluster.

A strategy is a list of `Phase`s run one after another (none of the 2024 systems overlaps
them). A phase is a set of ring all-gathers or broadcast chains that run at once over
disjoint groups, issued `calls` times in a row (per parameter, per bucket or per stage), or a
local copy (CPU -> GPU over PCIe, or a copy in HBM). Its time is

    calls x NCCL's per-call latency (`rl3d.costs.nccl`)  +  the busiest link's bytes / its bandwidth

where a link is a node's network link (in or out; `Cluster.nic_gbps x nics_per_node`, shared by
all 8 GPUs of the node) or a GPU's NVLink (in or out). Rings and chains are ordered node by
node, as NCCL builds them, so a ring hop that enters a node carries what its receiver gets.

The mechanisms (sources in /work/shared/TRANSITION_FACTS.md):
- hybridflow (rl3d): the planner's micro-DP all-gather, bucketed (`Cluster.bucket_mb`, the
  executor's default), then its other collectives (a mixture of experts' all-gather over the
  EP group's micro-DP groups, the norms' when p_g < p) and its point-to-point phases (experts
  trained at an expert TP size apart from t, generated at t_g > 1: one message per sender and
  receiver, all of a phase at once, one call's latency); generation buffers are allocated
  empty, nothing is reloaded.
- hybridflow_v: the planner's all-gather over each replica's t*p ranks, bucketed.
- ds_chat (DeepSpeed v0.14.0 hybrid engine): one ZeRO-3 all-gather per HF parameter over all
  N ranks, in groups of 8 layers, then a re-slice (HBM copy) into the inference TP shard; peak
  = the inference shard kept + one 8-layer group gathered whole + the ZeRO-3 partition.
- openrlhf (v0.2.5, `_broadcast_to_vllm`): per HF parameter, a ZeRO-3 all-gather over the N
  actor ranks, a broadcast from rank 0 to every vLLM GPU (N of them on their own nodes,
  each receives the full tensor), then vLLM's `load_weights` slice + copy (HBM).
- verl_2024 (verl 30911f1, the paper's HybridFlow; p_g = 1 only, as vLLM 0.3 ran): reload of
  the other stages' parameter buffers CPU -> GPU (`load_params_to_cuda`, PCIe), p sequential
  broadcasts in the PP group (one per stage), one all-gather per TP-sharded parameter in the
  micro-DP group along TP (when t_g < t) plus `torch.cat` (HBM copy).
Software costs per call (Python loops, Ray calls, `gc.collect`) are not in this model.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from rl3d.costs.cluster import Cluster
from rl3d.hybrid_engine import baselines as _baselines  # noqa: F401  registers the baselines read here
from rl3d.hybrid_engine.plan import Collective, PlanContext, TransitionPlan, rank_traffic

DS_CHAT_LAYER_GROUP = 8  # DeepSpeed hybrid engine `tp_gather_partition_size` default


@dataclass
class Phase:
    name: str
    kind: str  # ring | chain | p2p | pcie | hbm
    groups: list[list[int]] = field(default_factory=list)  # chain: first member is the root
    recv: dict[int, int] = field(default_factory=dict)  # bytes each member receives in the phase
    calls: int = 1
    local_bytes: int = 0  # pcie / hbm: bytes each GPU moves
    pairs: dict[tuple[int, int], int] = field(default_factory=dict)  # p2p: {(sender, receiver): bytes}


@dataclass
class Mechanism:
    phases: list[Phase]
    peak_param_bytes: int


def _hops(group: list[int], kind: str, cluster: Cluster) -> list[tuple[int, int]]:
    if len(group) < 2:
        return []
    ring = sorted(group, key=lambda r: (cluster.node(r), r))
    if kind == "ring":
        return [(ring[i - 1], ring[i]) for i in range(len(ring))]
    k = ring.index(group[0])
    chain = ring[k:] + ring[:k]
    return [(chain[i - 1], chain[i]) for i in range(1, len(chain))]


def phase_cost(phase: Phase, cluster: Cluster) -> dict:
    """{seconds, latency_seconds, node_in: {node: bytes}, recv_max} of one phase."""
    if phase.kind in ("pcie", "hbm"):
        gbps = cluster.pcie_gbps if phase.kind == "pcie" else cluster.hbm_gbps
        seconds = phase.local_bytes / (gbps * 1e9)
        return {"seconds": seconds, "latency_seconds": 0.0, "node_in": {}, "recv_max": 0}
    node_in: dict[int, int] = defaultdict(int)
    node_out: dict[int, int] = defaultdict(int)
    nv_in: dict[int, int] = defaultdict(int)
    nv_out: dict[int, int] = defaultdict(int)
    latency = 0.0
    hops = [(a, b, phase.recv.get(b, 0)) for g in phase.groups for a, b in _hops(g, phase.kind, cluster)]
    for (a, b), nbytes in phase.pairs.items():
        hops.append((a, b, nbytes))
        latency = max(latency, cluster.nccl.ring_seconds(2, len({cluster.node(a), cluster.node(b)})))
    for a, b, nbytes in hops:
        if cluster.node(a) == cluster.node(b):
            nv_out[a] += nbytes
            nv_in[b] += nbytes
        else:
            node_out[cluster.node(a)] += nbytes
            node_in[cluster.node(b)] += nbytes
    for group in phase.groups:
        nodes = len({cluster.node(r) for r in group})
        latency = max(latency, cluster.nccl.ring_seconds(len(group), nodes))
    net = cluster.node_gbps * 1e9
    loads = [v / net for v in (*node_in.values(), *node_out.values())]
    loads += [v / (cluster.nvlink_gbps * 1e9) for v in (*nv_in.values(), *nv_out.values())]
    lat = phase.calls * latency
    return {
        "seconds": max(loads, default=0.0) + lat,
        "latency_seconds": lat,
        "node_in": dict(node_in),
        "recv_max": max(phase.recv.values(), default=0),
    }


def mechanism_cost(mech: Mechanism, cluster: Cluster) -> dict:
    """The strategy's contract fields (seconds, bytes_max, node_bytes_max, calls, peak) + terms."""
    costs = [phase_cost(p, cluster) for p in mech.phases]
    recv: dict[int, int] = defaultdict(int)
    node_in: dict[int, int] = defaultdict(int)
    for phase, cost in zip(mech.phases, costs):
        for r, b in phase.recv.items():
            recv[r] += b
        for n, b in cost["node_in"].items():
            node_in[n] += b
    return {
        "seconds": sum(c["seconds"] for c in costs),
        "bytes_max": max(recv.values(), default=0),
        "node_bytes_max": max(node_in.values(), default=0),
        "calls": sum(p.calls for p in mech.phases if p.kind in ("ring", "chain", "p2p")),
        "peak_param_bytes": mech.peak_param_bytes,
        "terms": {p.name: round(c["seconds"], 6) for p, c in zip(mech.phases, costs)},
        "latency_seconds": sum(c["latency_seconds"] for c in costs),
    }


# -- the mechanisms -------------------------------------------------------------------------


def bucket_rounds(sizes: list[int], bucket_bytes: int) -> int:
    """How many buckets the executor cuts a member's pieces into (`plan.bucket_bounds`)."""
    rounds, size, first = 0, 0, True
    for n in sizes:
        if first or size + n > bucket_bytes:
            rounds, size, first = rounds + 1, 0, False
        size += n
    return rounds


def _planned_phases(
    ctx: PlanContext, collectives: list[Collective], name: str, cluster: Cluster
) -> list[Phase]:
    bucket = int(cluster.bucket_mb * 2**20)
    phases = []
    for k, c in enumerate(collectives):
        recv, _ = ctx.traffic([c])
        rounds = max(
            bucket_rounds([ctx.piece_bytes(c.unit, i, m) for i in contrib.get(m, ())], bucket)
            for contrib in c.contributions
            for m in contrib
        )
        label = name if k == 0 else f"{name}_{c.group_kind}"
        phases.append(Phase(label, "ring", c.groups, dict(recv), max(rounds, 1)))
    return phases


def hf_param_count(ctx: PlanContext) -> int:
    """HF tensors (q, k, v, o, gate, up, down, 2 norms per layer; embed, norm, lm_head)."""
    spec = ctx.spec
    per_layer = 9 + (3 if spec.qkv_bias else 0)
    return spec.num_layers * per_layer + 2 + (0 if spec.tied_embeddings else 1)


def _unpiped(ctx: PlanContext) -> tuple[int, ...]:
    return ctx.stage_params(0, 1)


def _gen_bytes_max(ctx: PlanContext) -> int:
    return max(ctx.nbytes(ctx.gen_segs(r)) for r in range(ctx.train.world_size))


def _zero3_phase(ctx: PlanContext, plan: TransitionPlan, name: str) -> Phase:
    s = plan.strategies["ds_chat"]
    n = ctx.train.world_size
    return Phase(name, "ring", [list(range(n))], {r.rank: r.recv_bytes for r in s.ranks}, hf_param_count(ctx))


def hybridflow(ctx, plan, cluster) -> Mechanism:
    s = plan.strategies["hybridflow"]
    phases = _planned_phases(ctx, s.collectives, "micro_dp_all_gather", cluster)
    for k, transfers in enumerate(s.phases):
        pairs = ctx.pair_traffic([], (transfers,))
        recv, _ = rank_traffic(pairs)
        phases.append(Phase(f"point_to_point_{k}", "p2p", recv=dict(recv), pairs=pairs))
    return Mechanism(phases, s.peak_param_bytes)


def hybridflow_v(ctx, plan, cluster) -> Mechanism:
    s = plan.strategies["hybridflow_v"]
    return Mechanism(_planned_phases(ctx, s.collectives, "replica_all_gather", cluster), s.peak_param_bytes)


def ds_chat(ctx, plan, cluster) -> Mechanism:
    gen = _gen_bytes_max(ctx)
    layer = sum(p.numel for p in ctx.params if p.layer == 0) * ctx.dtype_bytes
    group = min(DS_CHAT_LAYER_GROUP, ctx.spec.num_layers) * layer
    chunk = sum(ctx.piece_bytes("zero_chunk", i, 0) for i in _unpiped(ctx))
    phases = [
        _zero3_phase(ctx, plan, "zero3_all_gather_per_param"),
        Phase("reslice_to_inference_tp", "hbm", local_bytes=2 * gen),
    ]
    return Mechanism(phases, gen + group + chunk)


def openrlhf(ctx, plan, cluster) -> Mechanism:
    n = ctx.train.world_size
    model = sum(ctx.piece_bytes("full", i, 0) for i in _unpiped(ctx))
    rollout = [0, *range(n, 2 * n)]
    phases = [
        _zero3_phase(ctx, plan, "zero3_all_gather_per_param"),
        Phase(
            "broadcast_to_vllm_per_param",
            "chain",
            [rollout],
            dict.fromkeys(rollout[1:], model),
            hf_param_count(ctx),
        ),
        Phase("vllm_load_weights", "hbm", local_bytes=2 * _gen_bytes_max(ctx)),
    ]
    return Mechanism(phases, plan.strategies["openrlhf"].peak_param_bytes)


def verl_2024(ctx, plan, cluster) -> Mechanism | None:
    train, gen = ctx.train, ctx.gen
    if gen.p_g != 1:
        return None  # verl's 2024 code gathered every stage (vLLM 0.3 had no pipeline)
    t, p, r = train.t, train.p, gen.r
    stage_bytes = {(k, i): ctx.nbytes(ctx.holding(k, p, i, t)) for k in range(p) for i in range(t)}
    own_tp = [train.coords(m).tp for m in range(train.world_size)]
    all_stages = max(sum(stage_bytes[(k, i)] for k in range(p)) for i in range(t))
    reload = all_stages - min(stage_bytes.values())
    phases = [Phase("reload_cpu_to_gpu", "pcie", local_bytes=reload if p > 1 else 0)]
    for k in range(p if p > 1 else 0):  # one broadcast per stage, rooted at its holder in each PP group
        groups = [sorted(g, key=lambda m: m != g[k]) for g in train.pp_groups()]
        recv = {m: stage_bytes[(k, own_tp[m])] for g in groups for m in g[1:]}
        phases.append(Phase(f"pp_broadcast_stage{k}", "chain", groups, recv, 1))
    peak = all_stages
    if r > 1:
        sharded = [i for i in _unpiped(ctx) if not ctx.replicated(i)]
        # training rank i < t has TP rank i: its pieces stand for every rank's with that TP rank
        shard = {i: sum(ctx.piece_bytes("shard", j, i) for j in sharded) for i in range(t)}
        groups = [[g[0] + a * r + b for b in range(r)] for g in train.tp_groups() for a in range(gen.t_g)]
        recv = {m: sum(shard[own_tp[x]] for x in g if x != m) for g in groups for m in g}
        gen_bytes = _gen_bytes_max(ctx)
        phases.append(Phase("tp_all_gather_per_param", "ring", groups, recv, len(sharded)))
        phases.append(Phase("torch_cat", "hbm", local_bytes=2 * gen_bytes))
        peak += gen_bytes
    return Mechanism(phases, peak)


MECHANISMS = {
    "hybridflow": hybridflow,
    "hybridflow_v": hybridflow_v,
    "ds_chat": ds_chat,
    "openrlhf": openrlhf,
    "verl_2024": verl_2024,
}


def lower_bound(ctx: PlanContext, cluster: Cluster) -> dict:
    """The bytes each node must receive (generation weights its GPUs need that none of its GPUs
    holds) over the node's link, and each GPU's bytes from node peers over its NVLink."""
    by_node: dict[int, list[int]] = defaultdict(list)
    for r in range(ctx.train.world_size):
        by_node[cluster.node(r)].append(r)
    node_bytes, gpu_bytes, need_bytes = 0, 0, 0
    for members in by_node.values():
        held = frozenset().union(*(ctx.train_segs(r) for r in members))
        need = frozenset().union(*(ctx.gen_segs(r) for r in members))
        node_bytes = max(node_bytes, ctx.nbytes(need - held))
        for r in members:
            missing = ctx.gen_segs(r) - ctx.train_segs(r)
            gpu_bytes = max(gpu_bytes, ctx.nbytes(missing & held))
            need_bytes = max(need_bytes, ctx.nbytes(missing))
    node_s = node_bytes / (cluster.node_gbps * 1e9)
    gpu_s = gpu_bytes / (cluster.nvlink_gbps * 1e9)
    return {
        "seconds": max(node_s, gpu_s),
        "node_bytes": node_bytes,
        "node_seconds": node_s,
        "gpu_seconds": gpu_s,
        "gpu_need_bytes": need_bytes,  # the most a GPU lacks of its generation shard
    }
