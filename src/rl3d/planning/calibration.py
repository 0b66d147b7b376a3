"""A CPU device class for the step simulator, fitted to microbenchmarks of this machine.

The microbenchmarks (`benchmarks/simulator_microbench.py`) time rl3d's own components in one
process: megatron forwards and training passes of the model at several layer and micro-batch
counts, the torch rollout engine at several response lengths, a matmul at the model's shapes,
gloo's all-reduce between two processes. They write a calibration JSON:

    {"matmul_gflops": .., "copy_gbps": .., "gloo_alpha_us": .., "gloo_gbps": .., "gather_cpu_us": ..,
     "rows": [{"kind": "forward" | "train" | "generate", "counts": {cost: n}, "flops": F, "seconds": t}]}

Each row says how many of each fixed cost (`DeviceClass.fixed`, or `step_overhead_s`) the timed
call paid, its FLOPs, and its seconds. `fit_fixed` solves, per kind, seconds - FLOPs / matmul
throughput = sum of count x cost by least squares with every cost >= 0. Nothing is fitted to the
runs that the simulator then predicts.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch

from rl3d.bench.nccl import NcclLatency
from rl3d.planning.devices import DeviceClass, FixedCosts

# the costs each kind of row pays; `step_overhead_s` is the device's per-decode-step cost
KINDS = {
    "forward": ("call_s", "call_layer_s", "micro_s", "layer_s"),
    "train": ("train_call_s", "train_call_layer_s", "train_micro_s", "train_layer_s", "optim_step_s"),
    "generate": ("gen_call_s", "step_overhead_s", "decode_layer_s"),
}
FACTS = ("matmul_gflops", "copy_gbps", "gloo_alpha_us", "gloo_gbps", "gather_cpu_us")


def nonnegative_lstsq(A: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """argmin |Ax - b| subject to x >= 0: least squares, then the most negative coefficient is
    pinned to 0 and the rest refitted, until none is negative (exact for the few columns here)."""
    free = list(range(A.shape[1]))
    x = torch.zeros(A.shape[1], dtype=torch.float64)
    while free:
        sol = torch.linalg.lstsq(A[:, free].double(), b.double().unsqueeze(1)).solution.squeeze(1)
        if (sol >= 0).all():
            x[free] = sol
            break
        free.pop(int(sol.argmin()))
    return x


def fit_fixed(rows: list[dict], matmul_flops: float) -> dict[str, float]:
    """Every fixed cost of `KINDS` from the calibration rows (see the module docstring)."""
    if matmul_flops <= 0:
        raise ValueError(f"calibration: matmul throughput must be > 0, got {matmul_flops}")
    costs: dict[str, float] = {}
    for kind, names in KINDS.items():
        mine = [r for r in rows if r["kind"] == kind]
        if len(mine) < len(names):
            raise ValueError(f"calibration: {len(mine)} {kind} rows cannot fit {len(names)} costs {names}")
        for r in mine:
            unknown = set(r["counts"]) - set(names)
            if unknown:
                raise ValueError(f"calibration {kind} row: unknown costs {sorted(unknown)}; known: {names}")
        f64 = torch.float64  # seconds of 1e-4 beside FLOPs of 1e6: float32 loses the costs' digits
        A = torch.tensor([[float(r["counts"].get(n, 0)) for n in names] for r in mine], dtype=f64)
        b = torch.tensor([r["seconds"] - r.get("flops", 0.0) / matmul_flops for r in mine], dtype=f64)
        costs |= dict(zip(names, nonnegative_lstsq(A, b).tolist()))
    return costs


def cpu_device(calibration: dict, name: str = "cpu") -> DeviceClass:
    """The CPU device class: FLOPs at the measured matmul throughput (every efficiency 1: the
    measurement already is what a rank achieves), memory reads at the measured copy bandwidth,
    gloo's fitted latency and bandwidth for every link, and the fitted fixed costs. A
    worker call also pays one object gather of its outputs over the role's ranks (its CPU
    seconds, `gather_cpu_us`)."""
    missing = [k for k in (*FACTS, "rows") if k not in calibration]
    if missing:
        raise ValueError(f"calibration JSON lacks {missing}")
    flops = calibration["matmul_gflops"] * 1e9
    costs = fit_fixed(calibration["rows"], flops)
    gather = calibration["gather_cpu_us"] * 1e-6
    for key in ("call_s", "train_call_s", "gen_call_s"):
        costs[key] += gather
    step_overhead = costs.pop("step_overhead_s")
    gbps = calibration["gloo_gbps"]
    half_us = calibration["gloo_alpha_us"] / 2  # a 2-rank ring call: the base and one hop
    return DeviceClass(
        name, peak_tflops=flops / 1e12, hbm_gbps=calibration["copy_gbps"], memory_gb=1e3,
        nvlink_gbps=gbps, node_net_gbps=gbps * 64, pcie_gbps=gbps, gpus_per_node=64, train_mfu=1.0,
        prefill_mfu=1.0, decode_hbm_eff=1.0, step_overhead_s=step_overhead,
        fixed=FixedCosts(**{f.name: costs[f.name] for f in fields(FixedCosts)}),
        nccl=NcclLatency(base_us=half_us, nvlink_hop_us=half_us, net_overhead_us=0, net_hop_us=0),
    )  # fmt: skip


def load_cpu_device(path: str | Path) -> DeviceClass:
    try:
        calibration = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"calibration file {path}: {err}") from None
    return cpu_device(calibration)
