"""Device classes for the step simulator: what one accelerator and its links can do.

Every constant is either a published figure (the source beside it) or an assumption, named as
one: the achieved fractions of peak (`train_mfu`, `prefill_mfu`, `decode_hbm_eff`) cannot be
read off a datasheet, and the simulator's results lean on them most. A CPU class is built from
microbenchmarks instead (`benchmarks/simulator_validation.py` measures matmul throughput and
gloo's bandwidth and latency on the machine and passes them in).

Sources:
- A100-SXM4-80GB: NVIDIA A100 Tensor Core GPU datasheet (BF16 dense 312 TFLOPS, HBM2e
  2039 GB/s, 80 GB of which CUDA reports 79.1-79.6 GiB, NVLink 600 GB/s total = 300 GB/s each
  way); the HybridFlow testbed's network (EuroSys'25, section 8.1): 200 Gb/s between
  machines, taken per node (25 GB/s).
- H100-SXM5-80GB: NVIDIA H100 datasheet (BF16 dense 989 TFLOPS, HBM3 3.35 TB/s, 80 GB, NVLink
  900 GB/s total); DGX H100 datasheet: 8 x 400 Gb/s ConnectX-7 per node (400 GB/s).
- H200-SXM-141GB: NVIDIA H200 datasheet (BF16 dense 989 TFLOPS, HBM3e 4.8 TB/s, 141 GB, NVLink
  900 GB/s total); DGX H200: 8 x 400 Gb/s per node.
- PCIe: Gen4 x16 about 32 GB/s each way (A100), Gen5 x16 about 64 GB/s (H100, H200).
- Collective latency per call: NCCL 2.18.1's own ring model (`rl3d.costs.nccl`).
- `train_mfu` 0.45 on A100: Megatron-LM on A100 reaches 44-52% of peak for GPT models of
  1.7B-1T parameters (Narayanan et al., SC'21, Table 1). On H100/H200 0.40 is an assumption
  (peak FLOPs grew 3.2x, memory bandwidth 1.6-2.4x, so a lower share is reached).
- `prefill_mfu` 0.5 and `decode_hbm_eff` 0.7: assumptions (a long prefill is one large
  matmul per layer; a decode step streams the weights and the KV cache once at a share of the
  datasheet's bandwidth), the same on every class.
- `step_overhead_s`: fixed cost per decode step (scheduler, sampling, kernel launches under
  CUDA graphs), an assumption of 2 ms.
- `fixed`: the framework's fixed costs per call, micro-batch, layer and optimizer step. Zero on
  the GPU classes, whose large kernels hide them; what dominates a tiny model on a CPU, where
  `rl3d.planning.calibration` fits them to microbenchmarks of rl3d's own components.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rl3d.costs.cluster import Cluster
from rl3d.costs.nccl import NCCL_2_18, NcclLatency


@dataclass(frozen=True)
class FixedCosts:
    """Seconds a pass costs on one rank besides its FLOPs and bytes (Python, dispatch, kernel
    launches), each per the unit its name says. Forward-only passes (log-probs, values) and
    training passes (forward + backward) have their own; generation pays `gen_call_s` per call
    and per decode step (the prefill is one) the device's `step_overhead_s` plus
    `decode_layer_s` per layer."""

    call_s: float = 0.0  # a forward stage's worker call: batch split, output gather
    call_layer_s: float = 0.0  # per layer of a forward call (module walks: mode switches, hooks)
    micro_s: float = 0.0  # a forward micro-batch outside the layers: embedding, output layer, log-probs
    layer_s: float = 0.0  # one layer of a forward micro-batch
    train_call_s: float = 0.0  # an update stage's worker call
    train_call_layer_s: float = 0.0  # per layer of an update call
    train_micro_s: float = 0.0  # forward + backward of a micro-batch outside the layers
    train_layer_s: float = 0.0  # forward + backward of one layer of a micro-batch
    optim_step_s: float = 0.0  # an optimizer step: gradient norm, clipping, Adam, zeroing
    # the value models' (critic, cost_critic) in place of the nine above: a [hidden, 1] value
    # head and a value loss, no log-softmax over the vocabulary nor policy loss
    critic_call_s: float = 0.0
    critic_call_layer_s: float = 0.0
    critic_train_call_s: float = 0.0
    critic_train_call_layer_s: float = 0.0
    critic_optim_step_s: float = 0.0
    critic_micro_s: float = 0.0
    critic_layer_s: float = 0.0
    critic_train_micro_s: float = 0.0
    critic_train_layer_s: float = 0.0
    # the value models' in place of `tp_micro_s` and `train_tp_micro_s` (no vocabulary-parallel
    # log-softmax; the [hidden, 1] head's output gathered instead)
    critic_tp_micro_s: float = 0.0
    critic_train_tp_micro_s: float = 0.0
    # per micro-batch of a forward (or forward + backward) on a tensor-parallel layout (t > 1):
    # what tensor parallelism costs besides the layers' all-reduces the latency model charges
    # (the embedding's and the log-probs' reductions, megatron's bookkeeping)
    tp_micro_s: float = 0.0
    train_tp_micro_s: float = 0.0
    train_tp_step_s: float = 0.0  # per optimizer step on a tensor-parallel layout (norms over ranks)
    gen_call_s: float = 0.0  # a generation call on a replica: sampling set-up, log-probs, output
    gen_gather_s: float = 0.0  # a colocated replica's rows gathered to every controller, once per call
    score_sample_s: float = 0.0  # the rule reward of one sample (detokenize, score) on the controller
    # the controller's side of a step's rollout besides the engine and the reward: sampling the
    # prompts, dealing them out, collecting and joining the rows, resuming the engine's cache
    control_step_s: float = 0.0  # per step
    control_sample_s: float = 0.0  # per sample
    # a separate rollout pool's rows reach the trainer through the store instead of a gather:
    # per step (the store reads, the unpickling, the checks) and per second of the pool's
    # generation, through which the trainer waits (its store polls, every 2 ms)
    handover_s: float = 0.0
    handover_wait_share: float = 0.0
    # a stage whose ranks sat waiting through the stage before (another pool's, or a separate
    # pool's generation) runs cold, this share slower: caches refilled, on a virtual machine
    # the halted vCPU resumed
    wake_share: float = 0.0
    decode_layer_s: float = 0.0  # one layer of a decode step

    def __post_init__(self) -> None:
        for key, value in vars(self).items():
            if value < 0:
                raise ValueError(f"fixed cost {key} must be >= 0, got {value}")


GIB = 1 << 30
REPORTED_80GB = 79.1 * GIB / 1e9
REPORTED_141GB = 139.0 * GIB / 1e9


@dataclass(frozen=True)
class DeviceClass:
    name: str
    peak_tflops: float  # dense BF16 matmul throughput
    hbm_gbps: float  # device memory bandwidth
    memory_gb: float
    nvlink_gbps: float  # one device to its node-mates, each way
    node_net_gbps: float  # one node's network, each way, shared by its devices
    pcie_gbps: float
    gpus_per_node: int = 8
    train_mfu: float = 0.45
    prefill_mfu: float = 0.5
    decode_hbm_eff: float = 0.7
    step_overhead_s: float = 2e-3
    fixed: FixedCosts = FixedCosts()
    nccl: NcclLatency = NCCL_2_18

    def __post_init__(self) -> None:
        for key in ("peak_tflops", "hbm_gbps", "memory_gb", "nvlink_gbps", "node_net_gbps", "pcie_gbps"):
            if getattr(self, key) <= 0:
                raise ValueError(f"device {self.name}: {key} must be > 0, got {getattr(self, key)}")
        for key in ("train_mfu", "prefill_mfu", "decode_hbm_eff"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"device {self.name}: {key} must be in (0, 1], got {getattr(self, key)}")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    @property
    def flops(self) -> float:
        return self.peak_tflops * 1e12

    def link_gbps(self, group_size: int, nodes: int) -> float:
        """Each way, per device, in a collective whose groups all run at once: NVLink inside a
        node; across nodes the node's network shared by the node's devices."""
        if nodes <= 1 or group_size <= 1:
            return self.nvlink_gbps
        return min(self.nvlink_gbps, self.node_net_gbps / self.gpus_per_node)

    def cluster(self) -> Cluster:
        """The transition cost model's cluster (`rl3d.costs.cluster`) for this class."""
        return Cluster(
            gpus_per_node=self.gpus_per_node,
            nvlink_gbps=self.nvlink_gbps,
            nic_gbps=self.node_net_gbps,
            nics_per_node=1,
            pcie_gbps=self.pcie_gbps,
            hbm_gbps=self.hbm_gbps,
            nccl=self.nccl,
        )


# memory: what `torch.cuda.mem_get_info` reports as the total, the low end of what cards of the
# class report (an "80 GB" A100 or H100: 79.1-79.6 GiB; a "141 GB" H200: about 139 GiB), in GB
A100 = DeviceClass("a100", 312.0, 2039.0, REPORTED_80GB, 300.0, 25.0, 32.0)
H100 = DeviceClass("h100", 989.0, 3350.0, REPORTED_80GB, 450.0, 400.0, 64.0, train_mfu=0.40)
H200 = DeviceClass("h200", 989.0, 4800.0, REPORTED_141GB, 450.0, 400.0, 64.0, train_mfu=0.40)
DEVICES = {d.name: d for d in (A100, H100, H200)}


def get_device(name: str, gpus_per_node: int | None = None) -> DeviceClass:
    if name not in DEVICES:
        raise ValueError(f"unknown device class {name!r}; known: {', '.join(DEVICES)}")
    device = DEVICES[name]
    if gpus_per_node is None:
        return device
    if gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    return replace(device, gpus_per_node=gpus_per_node)
