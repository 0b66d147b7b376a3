"""An alpha-beta model of the transition's collectives on a GPU cluster (no GPU needed).

Assumptions, all stated and all parameters of `rl3d.costs.cluster.Cluster` (its defaults: the
HybridFlow testbed; ranks numbered node by node):
- an all-gather over n ranks is a ring, ordered node by node (as NCCL builds its rings), that
  takes (n-1) steps: time = (n-1) * alpha + (bytes a rank receives) / (ring bandwidth);
- a ring's bandwidth is its slowest hop: NVLink (`nvlink_gbps` per GPU and direction) inside a
  node; between nodes the node's network bandwidth (`nic_gbps` x `nics_per_node`), shared by
  every ring hop that leaves that node at the same time (all groups of one step run at once);
- a broadcast is a pipelined chain with the same rule, so it costs alpha per hop plus the
  bytes over its slowest hop;
- OpenRLHF's path is a gather of every tensor to trainer rank 0 (its inbound NVLink for peers in
  its node, its node's network for the others, in parallel) followed by a broadcast of the
  whole model to rollout GPUs on other nodes; the two phases run one after the other, as a
  per-tensor gather-then-broadcast loop does;
- compute (packing, layout conversion) is not modelled: the measured mode reports it.

This charges each strategy as one ideal collective (`strategy_seconds`), the reference the
earlier benchmark used. The modelled benchmark now costs the calls each system really makes
(`rl3d.costs.mechanisms`, NCCL's per-call latencies from `rl3d.costs.nccl`) on the same `Cluster`.
"""

from __future__ import annotations

from collections import Counter

from rl3d.costs.cluster import Cluster
from rl3d.hybrid_engine.plan import TransitionPlan


def _ring_hops(group: list[int], cluster: Cluster) -> list[tuple[int, int]]:
    ring = sorted(group, key=lambda r: (cluster.node(r), r))
    return [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))] if len(ring) > 1 else []


def concurrent_ring_seconds(groups: list[list[int]], recv_bytes: dict[int, int], cluster: Cluster) -> float:
    """Time of all-gathers running at once over `groups`; `recv_bytes[rank]` is what each receives."""
    hops = {tuple(g): _ring_hops(g, cluster) for g in groups}
    leaving = Counter(
        cluster.node(a) for hs in hops.values() for a, b in hs if cluster.node(a) != cluster.node(b)
    )
    worst = 0.0
    for group, hs in hops.items():
        if not hs:
            continue
        bandwidths = [
            cluster.nvlink_gbps
            if cluster.node(a) == cluster.node(b)
            else cluster.nic_gbps * cluster.nics_per_node / leaving[cluster.node(a)]
            for a, b in hs
        ]
        ring_gbps = min(bandwidths)
        nbytes = max(recv_bytes.get(r, 0) for r in group)
        seconds = (len(group) - 1) * cluster.alpha_us * 1e-6 + nbytes / (ring_gbps * 1e9)
        worst = max(worst, seconds)
    return worst


def strategy_seconds(plan: TransitionPlan, strategy: str, cluster: Cluster) -> float:
    """Modelled transition time of one strategy, from the planner's exact per-rank bytes."""
    s = plan.strategies[strategy]
    recv = {r.rank: r.recv_bytes for r in s.ranks}
    if strategy == "openrlhf":
        n = plan.train.world_size
        replica = plan.train.model_parallel_groups()[0]
        rank0_node = cluster.node(0)
        inbound_intra = sum(
            r.send_bytes
            for r in s.ranks
            if r.rank in replica and r.rank != 0 and cluster.node(r.rank) == rank0_node
        )
        inbound_inter = sum(
            r.send_bytes
            for r in s.ranks
            if r.rank in replica and r.rank != 0 and cluster.node(r.rank) != rank0_node
        )
        gather = len(replica) * cluster.alpha_us * 1e-6 + max(
            inbound_intra / (cluster.nvlink_gbps * 1e9),
            inbound_inter / (cluster.nic_gbps * cluster.nics_per_node * 1e9),
        )
        model_bytes = recv[n]  # every rollout GPU receives the whole model
        # a chain through the n rollout GPUs; its slowest hop crosses nodes
        broadcast = n * cluster.alpha_us * 1e-6 + model_bytes / (
            cluster.nic_gbps * cluster.nics_per_node * 1e9
        )
        return gather + broadcast
    # Every byte is charged to the main ring (the first collective); the norms' own small
    # collective (when PP folds into micro-DP, or hybridflow_v's pipeline) rides along.
    return concurrent_ring_seconds(s.collectives[0].groups, recv, cluster)


def fit_alpha_beta(samples: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares of seconds = steps * alpha + bytes / bandwidth over (steps, bytes, seconds).

    Returns (alpha seconds, bandwidth bytes/s, R^2)."""
    import numpy as np

    steps = np.array([s for s, _, _ in samples], dtype=float)
    nbytes = np.array([b for _, b, _ in samples], dtype=float)
    seconds = np.array([t for _, _, t in samples], dtype=float)
    design = np.stack([steps, nbytes], axis=1)
    (alpha, inv_bw), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    predicted = design @ np.array([alpha, inv_bw])
    total = float(((seconds - seconds.mean()) ** 2).sum())
    r2 = 1.0 - float(((seconds - predicted) ** 2).sum()) / total if total > 0 else 1.0
    bandwidth = 1.0 / inv_bw if inv_bw > 0 else float("inf")
    return float(max(alpha, 0.0)), float(bandwidth), r2
