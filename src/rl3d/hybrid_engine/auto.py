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
  link would be 8x too optimistic when every GPU of a node pulls at once.)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from rl3d.hybrid_engine.plan import plan_transition
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
            recv = {r.rank: r.recv_bytes for r in hf.ranks}
            transition_s = link_seconds(plan.gen.micro_dp_groups(), recv, hw)
            transition_s += hw.alpha_us * 1e-6 if plan.gen.d_g > 1 else 0
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


def link_seconds(groups: list[list[int]], recv: dict[int, int], hw: HardwareModel) -> float:
    """Ring all-gathers over `groups` at once: the busiest link's bytes over its bandwidth."""
    node_in: dict[int, int] = defaultdict(int)
    node_out: dict[int, int] = defaultdict(int)
    nvlink: dict[int, int] = defaultdict(int)
    for group in groups:
        ring = sorted(group, key=lambda m: (m // hw.gpus_per_node, m))
        for a, b in zip(ring[-1:] + ring[:-1], ring) if len(ring) > 1 else ():
            na, nb = a // hw.gpus_per_node, b // hw.gpus_per_node
            if na == nb:
                nvlink[b] += recv.get(b, 0)
            else:
                node_in[nb] += recv.get(b, 0)
                node_out[na] += recv.get(b, 0)
    net = [v / (hw.ib_gbps * 1e9) for v in (*node_in.values(), *node_out.values())]
    return max(net + [v / (hw.nvlink_gbps * 1e9) for v in nvlink.values()], default=0.0)


def best_row(rows: list[AutoRow]) -> AutoRow | None:
    fitting = [r for r in rows if r.fits]
    return min(fitting, key=lambda r: r.total_s) if fitting else None
