"""NCCL's own latency model for one ring collective, with the constants NCCL ships.

Source: NCCL 2.18.1 (the paper's version, HybridFlow §8.1), `src/graph/tuning.cc`,
`ncclTopoTuneModel`: AllGather and Broadcast run the Ring algorithm only; with the Simple
protocol (what large transfers use) a call costs

    latency = baseLat[Ring][Simple] + (nsteps - nInterSteps) * intraLat + nInterSteps * interLat

with baseLat[Ring][Simple] = 8.4 us, intraLat = hwLat[NVLINK][Ring][Simple] = 3.4 us, raised to
the network overhead `getNetOverhead() * 3` (2 us on AMD hosts such as the DGX A100's EPYC,
times 3 for Simple: 6 us) once the group spans nodes, and interLat = hwLat[NET][Ring][Simple]
= 14 us. An all-gather over n ranks on N nodes has nsteps = n - 1 and nInterSteps = N - 1;
128 ranks on 16 nodes cost about 0.9 ms, 64 ranks on 8 nodes about 0.44 ms.

For Broadcast NCCL charges nsteps = n and nInterSteps = N per call when the ring's channels
differ; we charge it like the all-gather's chain of n - 1 hops (the two differ by one hop).
Nothing here is fitted to any measurement, the paper's or ours.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NcclLatency:
    base_us: float = 8.4  # baseLat[Ring][Simple]
    nvlink_hop_us: float = 3.4  # hwLat[NVLINK][Ring][Simple]
    net_overhead_us: float = 6.0  # getNetOverhead() = 2 us (AMD host) x 3 for Simple
    net_hop_us: float = 14.0  # hwLat[NET][Ring][Simple]

    def ring_seconds(self, num_ranks: int, num_nodes: int) -> float:
        """One ring all-gather (or broadcast chain) over `num_ranks` ranks on `num_nodes` nodes."""
        if num_ranks <= 1:
            return 0.0
        steps, inter = num_ranks - 1, num_nodes - 1
        intra = self.nvlink_hop_us if num_nodes == 1 else max(self.nvlink_hop_us, self.net_overhead_us)
        return (self.base_us + (steps - inter) * intra + inter * self.net_hop_us) * 1e-6


NCCL_2_18 = NcclLatency()
