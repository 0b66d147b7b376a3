"""A CPU device class for the step simulator, fitted to microbenchmarks of this machine.

The microbenchmarks (`benchmarks/simulator_microbench.py`) time rl3d's own components: megatron
forwards and training passes of the actor's and the critic's model at several layer and
micro-batch counts in one process and, in two, at tensor parallelism 2; the torch rollout engine
at several response lengths; the controller's whole generate stage in a one-rank run and with a
separate rollout pool; a matmul at the model's shapes; gloo's all-reduce between two processes.
They write a calibration JSON:

    {"matmul_gflops": .., "copy_gbps": .., "gloo_gbps": .., "gloo_call_cpu_us": ..,
     "gather_cpu_us": .., "gather_rollout_cpu_us": ..,
     "rows": [{"kind": .., "counts": {cost: n}, "flops": F, "seconds": t, "times": [..]}]}

Each row says how many of each fixed cost (`DeviceClass.fixed`, or `step_overhead_s`) the timed
call paid, its FLOPs (on the timed rank), and its seconds (the low percentile of its repeats'
`times`). `fit_fixed` solves, per kind of `KINDS` (the critic's passes are kinds of their own),
seconds - FLOPs / matmul throughput = sum of count x cost by least squares with every cost >=
0; the kinds of `LATER_KINDS` afterwards, from what is left once the costs already fitted are
taken off: the tensor-parallel ones (the actor's and the critic's) also less their rows' layer
all-reduces (`allreduces` of `allreduce_bytes` each, at gloo's cost per call and bandwidth);
the controller's generate stage (`generate_stage`, a whole step's rollout as the loop runs it)
less the engine's and the reward's costs; a separate rollout pool's generate stage as the
trainer sees it (`generate_separate`: the pool's generation and the trainer's wait for its
rows, each row counting the pool's generation seconds the trainer waited through) less the
engine's, the reward's and the controller's costs, leaving the hand-over's. The actor's forward
right after that wait against the same call repeated at once (`forward_after_wait`,
`forward_again`) gives how much slower ranks that waited run (`wake_share`). Nothing is fitted
to the runs the simulator then predicts.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from rl3d.costs.nccl import NcclLatency
from rl3d.planning.devices import DeviceClass, FixedCosts

# the costs each kind of row pays; `step_overhead_s` is the device's per-decode-step cost
KINDS = {
    "forward": ("call_s", "call_layer_s", "micro_s", "layer_s"),
    "train": ("train_call_s", "train_call_layer_s", "train_micro_s", "train_layer_s", "optim_step_s"),
    "generate": ("gen_call_s", "step_overhead_s", "decode_layer_s"),
    "score": ("score_sample_s",),
    # the value models' own: a [hidden, 1] head and a value loss, no log-softmax over the
    # vocabulary, no policy loss; fewer parameters for the optimizer
    "critic_forward": ("critic_call_s", "critic_call_layer_s", "critic_micro_s", "critic_layer_s"),
    "critic_train": ("critic_train_call_s", "critic_train_call_layer_s", "critic_train_micro_s",
                     "critic_train_layer_s", "critic_optim_step_s"),
}  # fmt: skip
LATER_KINDS = {
    "forward_tp": ("tp_micro_s",),
    "train_tp": ("train_tp_micro_s", "train_tp_step_s"),
    "generate_stage": ("control_step_s", "control_sample_s"),
    "critic_forward_tp": ("critic_tp_micro_s",),
    "critic_train_tp": ("critic_train_tp_micro_s",),
    "generate_separate": ("handover_s", "handover_wait_share"),
}
# the actor's forward right after the trainer waited for a separate pool's rows, and the same
# call repeated at once (rows of the same `samples`): the first's excess share is the wake-up
WOKEN, AGAIN = "forward_after_wait", "forward_again"
OPTIONAL_KINDS = ("critic_forward", "critic_train")
# a calibration without the critic's rows charges the value models the actor's costs
CRITIC_FALLBACK = {
    "critic_call_s": "call_s",
    "critic_call_layer_s": "call_layer_s",
    "critic_train_call_s": "train_call_s",
    "critic_train_call_layer_s": "train_call_layer_s",
    "critic_optim_step_s": "optim_step_s",
    "critic_micro_s": "micro_s",
    "critic_layer_s": "layer_s",
    "critic_train_micro_s": "train_micro_s",
    "critic_train_layer_s": "train_layer_s",
    "critic_tp_micro_s": "tp_micro_s",
    "critic_train_tp_micro_s": "train_tp_micro_s",
}
# and one without a separate pool's rows no hand-over
NO_HANDOVER = {"handover_s": 0.0, "handover_wait_share": 0.0}
FACTS = (
    "matmul_gflops",
    "copy_gbps",
    "gloo_gbps",
    "gloo_call_cpu_us",
    "gather_cpu_us",
    "gather_rollout_cpu_us",
)


# Which of a timing's repeats stands for it: noise on a shared machine only adds CPU seconds
# (caches emptied by other processes, a peer held off its core), so a low one; not the least,
# which one lucky repeat decides. The validation reads its runs' stages the same way.
LOW_PERCENTILE = 20


def low_percentile(times: list[float], q: float = LOW_PERCENTILE) -> float:
    """The `q`-th percentile of `times` (linear between the two nearest)."""
    if not times:
        raise ValueError("calibration: a timing without repeats")
    ordered = sorted(times)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


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


def _fit_kind(kind: str, names: tuple[str, ...], rows: list[dict], rest) -> dict[str, float]:
    mine = [r for r in rows if r["kind"] == kind]
    if len(mine) < len(names):
        raise ValueError(f"calibration: {len(mine)} {kind} rows cannot fit {len(names)} costs {names}")
    f64 = torch.float64  # seconds of 1e-4 beside FLOPs of 1e6: float32 loses the costs' digits
    A = torch.tensor([[float(r["counts"].get(n, 0)) for n in names] for r in mine], dtype=f64)
    b = torch.tensor([r["seconds"] - rest(r) for r in mine], dtype=f64)
    return dict(zip(names, nonnegative_lstsq(A, b).tolist()))


def fit_fixed(rows: list[dict], matmul_flops: float, allreduce_s=None) -> dict[str, float]:
    """Every fixed cost of `KINDS` and `LATER_KINDS` from the calibration rows (see the module
    docstring); `allreduce_s(nbytes)` is one layer all-reduce's seconds (for rows that count
    `allreduces`)."""
    if matmul_flops <= 0:
        raise ValueError(f"calibration: matmul throughput must be > 0, got {matmul_flops}")
    known = {n for names in (*KINDS.values(), *LATER_KINDS.values()) for n in names}
    for r in rows:
        unknown = set(r["counts"]) - known
        if r["kind"] not in (*KINDS, *LATER_KINDS, WOKEN, AGAIN) or unknown:
            raise ValueError(f"calibration {r['kind']} row: unknown kind or costs {sorted(unknown)}")
    costs: dict[str, float] = {}
    for kind, names in KINDS.items():
        if kind in OPTIONAL_KINDS and not any(r["kind"] == kind for r in rows):
            continue
        costs |= _fit_kind(kind, names, rows, lambda r: r.get("flops", 0.0) / matmul_flops)
    if allreduce_s is None and any(r.get("allreduces") for r in rows):
        raise ValueError("calibration: tensor-parallel rows need the all-reduce cost")

    def rest(r: dict) -> float:
        paid = sum(n * costs[c] for c, n in r["counts"].items() if c in costs)
        allreduces = r.get("allreduces", 0)
        return (
            r.get("flops", 0.0) / matmul_flops
            + paid
            + (allreduces and allreduces * allreduce_s(r["allreduce_bytes"]))
        )

    for kind, names in LATER_KINDS.items():
        if any(r["kind"] == kind for r in rows):
            costs |= _fit_kind(kind, names, rows, rest)
    for critic, actor in CRITIC_FALLBACK.items():
        costs.setdefault(critic, costs[actor])
    return NO_HANDOVER | costs | {"wake_share": wake_share(rows)}


def wake_share(rows: list[dict]) -> float:
    """How much slower a woken forward runs than the same call repeated at once: the least
    squares share s of woken = (1 + s) x again over the pairs of rows (0 without them; >= 0)."""
    again = {r["samples"]: r["seconds"] for r in rows if r["kind"] == AGAIN}
    pairs = [(r["seconds"], again[r["samples"]]) for r in rows if r["kind"] == WOKEN]
    if not pairs:
        return 0.0
    ratio = sum(w * a for w, a in pairs) / sum(a * a for _, a in pairs)
    return max(0.0, ratio - 1)


def cpu_device(calibration: dict, name: str = "cpu") -> DeviceClass:
    """The CPU device class: FLOPs at the measured matmul throughput (every efficiency 1: the
    measurement already is what a rank achieves), memory reads at the measured copy bandwidth,
    for every collective call gloo's CPU seconds per call and per byte (what a rank spends, the
    quantity the validation compares; a wait for a late peer costs none), and the fitted fixed
    costs. A worker call also pays one object gather of its outputs over the role's ranks (its
    CPU seconds: `gather_cpu_us` of a forward's outputs, `gather_rollout_cpu_us` of a replica's
    rollout rows)."""
    missing = [k for k in (*FACTS, "rows") if k not in calibration]
    if missing:
        raise ValueError(f"calibration JSON lacks {missing}")
    flops, gbps = calibration["matmul_gflops"] * 1e9, calibration["gloo_gbps"]
    call_s = calibration["gloo_call_cpu_us"] * 1e-6
    costs = fit_fixed(calibration["rows"], flops, lambda nbytes: call_s + nbytes / (gbps * 1e9))
    for key in ("call_s", "train_call_s", "critic_call_s", "critic_train_call_s"):  # outputs, metrics
        costs[key] += calibration["gather_cpu_us"] * 1e-6
    costs["gen_gather_s"] = calibration["gather_rollout_cpu_us"] * 1e-6  # a replica's rows, text and all
    step_overhead = costs.pop("step_overhead_s")
    # the simulator charges a 2-rank all-reduce twice a ring pass of the base and one hop
    quarter_us = calibration["gloo_call_cpu_us"] / 4
    return DeviceClass(
        name, peak_tflops=flops / 1e12, hbm_gbps=calibration["copy_gbps"], memory_gb=1e3,
        nvlink_gbps=gbps, node_net_gbps=gbps * 64, pcie_gbps=gbps, gpus_per_node=64, train_mfu=1.0,
        prefill_mfu=1.0, decode_hbm_eff=1.0, step_overhead_s=step_overhead,
        fixed=FixedCosts(**{f.name: costs[f.name] for f in fields(FixedCosts)}),
        nccl=NcclLatency(base_us=quarter_us, nvlink_hop_us=quarter_us, net_overhead_us=0, net_hop_us=0),
    )  # fmt: skip
