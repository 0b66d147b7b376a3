"""A GPU cluster as the transition's cost models see it (no GPU needed).

Defaults: the HybridFlow testbed, 16 nodes x 8 A100-80GB, 600 GB/s NVLink, 200 Gb/s between
nodes. Ranks are numbered node by node: rank // gpus_per_node is the node. Between nodes the
node's network link (`nic_gbps` x `nics_per_node`) is shared by its GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl3d.costs.nccl import NCCL_2_18, NcclLatency


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int = 8
    nvlink_gbps: float = 300.0  # A100: 600 GB/s bidirectional NVLink = 300 GB/s each way
    nic_gbps: float = 25.0  # 200 Gb/s between nodes
    nics_per_node: int = 1  # the paper's "200Gbps" per node (1) or per GPU (8)
    alpha_us: float = 10.0  # latency per ring step or chain hop (the single-collective model)
    pcie_gbps: float = 32.0  # PCIe Gen4 x16 per direction, one link per GPU (CPU -> GPU reloads)
    hbm_gbps: float = 2039.0  # A100-80GB HBM2e (datasheet): copies on the GPU, the optimizer step
    bucket_mb: float = 256.0  # rl3d's hybrid_engine.bucket_mb default (calls per transition)
    nccl: NcclLatency = NCCL_2_18  # per-call latency of each collective (see rl3d.costs.nccl)

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    @property
    def node_gbps(self) -> float:
        """One node's network link, shared by its GPUs."""
        return self.nic_gbps * self.nics_per_node
