"""`rl3d plan --auto`: search every valid generation layout and estimate what it costs.

For each (t_g, p_g) with t_g | t and p_g | p this reports the transition bytes (hybridflow),
the per-GPU generation memory (weights plus the KV cache a given batch needs) and a latency
estimate, and marks the fastest layout that fits in the GPU's memory.

The latency model is deliberately simple, and its constants are stated (defaults: the
HybridFlow paper's A100 cluster):
- decode is memory-bound: each decode step reads the rank's generation weights and its KV
  cache from HBM once (`hbm_gbps`);
- each layer does two tensor-parallel all-reduces of the step's activations over NVLink
  (`nvlink_gbps` per direction, ring: 2 (t_g-1)/t_g of the bytes) plus a fixed latency
  `alpha_us` per collective;
- a token passes the p_g stages one after another (no pipelining across a decode step);
- the KV cache grows linearly, so a step reads on average half of the final cache;
- the transition is hybridflow's micro-DP all-gather as rings ordered node by node (as NCCL
  builds them): a hop inside a node runs on NVLink, a hop into another node carries what its
  receiver gets over that node's network link (`ib_gbps`), which all `gpus_per_node` GPUs of
  the node share. The transition takes as long as its busiest link (a node's inbound or
  outbound network link, or a GPU's NVLink), plus `alpha_us`. (Giving each GPU the whole node
  link would be 8x too optimistic when every GPU of a node pulls at once.) The norms' small
  all-gather (p_g < p) rides on the micro-DP rings;
- a mixture of experts' weights moved apart from the dense ones are timed by the same links,
  after them, as the executor runs them: the expert all-gather over each EP group's micro-DP
  groups joined (ep > 1) as rings, then each point-to-point phase (experts trained at an
  expert TP size apart from t, generated at t_g > 1) as one hop per message; `alpha_us` each.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from rl3d.hybrid_engine.plan import Transfer, TransitionPlan, plan_transition
from rl3d.models.spec import ModelSpec
from rl3d.parallel import ParallelLayout


@dataclass(frozen=True)
class HardwareModel:
    gpu_mem_gb: float = 80.0
    mem_fraction: float = 0.9  # usable share of GPU memory for weights + KV cache
    hbm_gbps: float = 2039.0  # A100-80GB HBM2e
    nvlink_gbps: float = 300.0  # per direction (600 GB/s bidirectional)
    ib_gbps: float = 25.0  # 200 Gb/s per node, shared by its GPUs
    alpha_us: float = 10.0
    gpus_per_node: int = 8


@dataclass(frozen=True)
class AutoRow:
    t_g: int
    p_g: int
    d_g: int
    transition_bytes: int
    weight_bytes: int
    kv_bytes: int
    fits: bool
    transition_s: float
    generate_s: float

    @property
    def total_s(self) -> float:
        return self.transition_s + self.generate_s


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def search_layouts(
    spec: ModelSpec,
    train: ParallelLayout,
    *,
    batch: int,
    prompt_len: int,
    response_len: int,
    dtype: str = "bfloat16",
    hw: HardwareModel = HardwareModel(),
) -> list[AutoRow]:
    rows = []
    for p_g in _divisors(train.p):
        for t_g in _divisors(train.t):
            plan = plan_transition(spec, train, t_g, p_g, dtype=dtype, strategies=("hybridflow",))
            hf = plan.strategies["hybridflow"]
            nbytes = plan.dtype_bytes
            replicas = plan.gen.d_g * train.d
            seqs = -(-batch // replicas)
            kv_heads = max(spec.num_query_groups // t_g, 1)
            layers = spec.num_layers // p_g
            seq_len = prompt_len + response_len
            kv_bytes = seqs * seq_len * layers * 2 * kv_heads * spec.head_dim * nbytes
            weight_bytes = hf.peak_param_bytes
            fits = weight_bytes + kv_bytes <= hw.gpu_mem_gb * 1e9 * hw.mem_fraction
            act_bytes = seqs * spec.hidden_size * nbytes
            allreduce_s = 0.0
            if t_g > 1:
                allreduce_s = hw.alpha_us * 1e-6 + 2 * (t_g - 1) / t_g * act_bytes / (hw.nvlink_gbps * 1e9)
            kv_read = seqs * (prompt_len + response_len / 2) * layers * 2 * kv_heads * spec.head_dim * nbytes
            stage_s = (weight_bytes + kv_read) / (hw.hbm_gbps * 1e9) + 2 * layers * allreduce_s
            generate_s = response_len * p_g * stage_s
            transition_s = dense_seconds(plan, hw) + expert_seconds(plan, hw)
            rows.append(
                AutoRow(
                    t_g,
                    p_g,
                    plan.gen.d_g,
                    hf.comm_bytes_max,
                    weight_bytes,
                    kv_bytes,
                    fits,
                    transition_s,
                    generate_s,
                )
            )
    return rows


EXPERT_GROUPS = "expert_micro_dp"  # the `Collective.group_kind` of the experts' own all-gather


def dense_seconds(plan: TransitionPlan, hw: HardwareModel) -> float:
    """hybridflow's micro-DP all-gather (every collective but the experts' own) on `hw`."""
    hf = plan.strategies["hybridflow"]
    recv, _ = plan.traffic([c for c in hf.collectives if c.group_kind != EXPERT_GROUPS])
    seconds = link_seconds(plan.gen.micro_dp_groups(), recv, hw)
    return seconds + (hw.alpha_us * 1e-6 if plan.gen.d_g > 1 else 0)


def expert_seconds(plan: TransitionPlan, hw: HardwareModel) -> float:
    """The experts moved apart from the dense weights on `hw`: their all-gather, then each
    point-to-point phase, one after another (0 where experts ride with the dense weights)."""
    hf = plan.strategies["hybridflow"]
    seconds = 0.0
    for c in hf.collectives:
        if c.group_kind == EXPERT_GROUPS and any(len(g) > 1 for g in c.groups):
            recv, _ = plan.traffic([c])
            seconds += link_seconds(c.groups, recv, hw) + hw.alpha_us * 1e-6
    for phase in hf.phases:
        if phase:
            seconds += transfer_seconds(phase, plan, hw) + hw.alpha_us * 1e-6
    return seconds


def link_seconds(groups: list[list[int]], recv: dict[int, int], hw: HardwareModel) -> float:
    """Ring all-gathers over `groups` at once: the busiest link's bytes over its bandwidth."""
    hops = []
    for group in groups:
        ring = sorted(group, key=lambda m: (m // hw.gpus_per_node, m))
        hops += [(a, b, recv.get(b, 0)) for a, b in zip(ring[-1:] + ring[:-1], ring) if len(ring) > 1]
    return busiest_link_seconds(hops, hw)


def transfer_seconds(phase: tuple[Transfer, ...], plan: TransitionPlan, hw: HardwareModel) -> float:
    """One point-to-point phase, its messages at once: each a hop from sender to receiver."""
    pairs = plan.phase_pair_bytes(phase)
    return busiest_link_seconds([(a, b, n) for (a, b), n in pairs.items()], hw)


def busiest_link_seconds(hops: list[tuple[int, int, int]], hw: HardwareModel) -> float:
    """(sender, receiver, bytes) hops at once: a hop inside a node loads both GPUs' NVLink (out
    and in), one between nodes both nodes' network links; the busiest link's bytes over its
    bandwidth."""
    node_in: dict[int, int] = defaultdict(int)
    node_out: dict[int, int] = defaultdict(int)
    nv_in: dict[int, int] = defaultdict(int)
    nv_out: dict[int, int] = defaultdict(int)
    for a, b, nbytes in hops:
        na, nb = a // hw.gpus_per_node, b // hw.gpus_per_node
        if na == nb:
            nv_in[b] += nbytes
            nv_out[a] += nbytes
        else:
            node_in[nb] += nbytes
            node_out[na] += nbytes
    net = [v / (hw.ib_gbps * 1e9) for v in (*node_in.values(), *node_out.values())]
    return max(net + [v / (hw.nvlink_gbps * 1e9) for v in (*nv_in.values(), *nv_out.values())], default=0.0)


def best_row(rows: list[AutoRow]) -> AutoRow | None:
    fitting = [r for r in rows if r.fits]
    return min(fitting, key=lambda r: r.total_s) if fitting else None
