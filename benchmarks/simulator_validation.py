"""The step simulator checked by measurement on this machine (CPU, gloo).

1. Calibrate a CPU device class once from microbenchmarks: matmul throughput at the tiny
   model's shapes (one thread per rank, as the quickstart's ranks run), memory copy bandwidth,
   the fixed cost of one small op, and gloo's all-reduce latency and bandwidth between two
   processes (least squares of time = alpha + bytes / bandwidth, `rl3d.bench.cost_model`).
2. Predict every stage of the PPO CPU quickstart under three placements (colocated; a separate
   rollout pool; own critic and reference pools) and two layouts (actor tp=2 or dp=2), run
   each with `rl3d train`, and compare: median `time/<stage>` over the steps after `--warmup`
   against the prediction (`generate` = prefill + decode). A stage above 5% of the step must be
   predicted within 25%; the table marks those that are not.

Writes `simulator_validation.csv` and `.md` (calibration, table, command, load) into `--out`.
Needs a quiet machine for numbers worth keeping:

    python benchmarks/simulator_validation.py --out benchmarks/simulator   # ~10 min on 2 idle cores
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rl3d.bench.cost_model import fit_alpha_beta
from rl3d.bench.nccl import NcclLatency
from rl3d.config import load_config
from rl3d.planning.devices import DeviceClass
from rl3d.planning.recipe import placement_of, workload_of
from rl3d.planning.simulator import simulate

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/quickstart_cpu_ppo.yaml"
OPS_PER_LAYER = 24  # torch ops one decoder layer's forward issues (norms, projections, rope, attention, MLP)
PLACEMENTS = {
    "colocated": [],
    "rollout_pool": ["rollout.placement=separate", "rollout.pool.tp=1", "rollout.pool.dp=1"],
    "own_critic_ref": [
        "critic.colocate=false",
        "reference.colocate=false",
        "reference.parallel.tp=1",
        "reference.parallel.dp=1",
    ],  # fmt: skip
}
LAYOUTS = {"tp2": (2, 1), "dp2": (1, 2)}


def _timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _gloo_worker(rank: int, port: int, sizes: list[int], out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    rows = []
    for n in sizes:
        t = torch.zeros(n // 4)
        seconds = _timed(lambda t=t: dist.all_reduce(t), 5)
        rows.append((1, n, seconds))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def calibrate(hidden: int, ffn: int, tokens: int) -> tuple[DeviceClass, dict]:
    torch.set_num_threads(1)
    a, b = torch.randn(tokens, hidden), torch.randn(hidden, ffn)
    matmul_s = _timed(lambda: a @ b, 200)
    flops = 2 * tokens * hidden * ffn / matmul_s
    big = torch.randn(16 * 2**20 // 4)
    copy_s = _timed(lambda: big.clone(), 20)
    tiny = torch.randn(1, hidden)
    op_s = _timed(lambda: tiny * 2.0, 2000)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [
        ctx.Process(target=_gloo_worker, args=(r, port, [2**k for k in range(10, 25, 2)], queue))
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    samples = queue.get(timeout=300)
    for p in procs:
        p.join()
    # a 2-rank ring all-reduce sends (and receives) half the bytes twice: bytes on the wire = n
    alpha, bandwidth, r2 = fit_alpha_beta(samples)
    gbps = bandwidth / 1e9
    half_us = alpha * 1e6 / 2  # a 2-rank call: the base and one hop
    device = DeviceClass(
        "cpu", peak_tflops=flops / 1e12, hbm_gbps=2 * len(big) * 4 / copy_s / 1e9, memory_gb=1e3,
        nvlink_gbps=gbps, node_net_gbps=gbps * 64, pcie_gbps=gbps, gpus_per_node=64, train_mfu=1.0,
        prefill_mfu=1.0, decode_hbm_eff=1.0, step_overhead_s=0.0, layer_overhead_s=OPS_PER_LAYER * op_s,
        nccl=NcclLatency(base_us=half_us, nvlink_hop_us=half_us, net_overhead_us=0, net_hop_us=0),
    )  # fmt: skip
    facts = {"matmul_gflops": flops / 1e9, "copy_gbps": device.hbm_gbps, "op_us": op_s * 1e6,
             "gloo_alpha_us": alpha * 1e6, "gloo_gbps": gbps, "gloo_fit_r2": r2}  # fmt: skip
    return device, facts


def _config(placement: str, layout: str, steps: int) -> list[str]:
    tp, dp = LAYOUTS[layout]
    par = [
        f"actor.parallel.tp={tp}",
        f"actor.parallel.dp={dp}",
        f"critic.parallel.tp={tp}",
        f"critic.parallel.dp={dp}",
    ]
    extra = PLACEMENTS[placement]
    # the actor's ranks, plus the critic's own pool (its layout is the actor's here) and the
    # reference's or the rollout pool's one rank
    world = tp * dp + {"colocated": 0, "rollout_pool": 1, "own_critic_ref": tp * dp + 1}[placement]
    return [
        *par,
        *extra,
        f"launch.nproc_per_node={world}",
        f"trainer.total_steps={steps}",
        "checkpoint.save_every=0",
    ]


def measure(overrides: list[str], run_dir: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "rl3d.cli", "train", str(RECIPE), f"trainer.run_dir={run_dir}", *overrides]
    env = dict(os.environ, RL3D_YAML_DIR=str(ROOT / "yaml"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def compare(device: DeviceClass, placement: str, layout: str, steps: int, warmup: int) -> list[dict]:
    overrides = _config(placement, layout, steps)
    cfg = load_config(RECIPE, overrides).config
    est = simulate(workload_of(cfg), placement_of(cfg), device)
    predicted = dict(est.stages)
    predicted["generate"] = predicted.pop("prefill") + predicted.pop("decode")
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(overrides, Path(tmp) / "run")[warmup:]
    step = statistics.median(r["time/step"] for r in rows)
    out = []
    for stage, pred in predicted.items():
        key = f"time/{stage}"
        if not any(key in r for r in rows):
            continue
        meas = statistics.median(r.get(key, 0.0) for r in rows)
        share = meas / step if step else 0.0
        err = pred / meas - 1 if meas else float("inf")
        out.append({
            "placement": placement, "layout": layout, "stage": stage, "predicted_s": f"{pred:.4f}",
            "measured_s": f"{meas:.4f}", "error": f"{err:+.0%}", "share_of_step": f"{share:.0%}",
            "within_25pct": "yes" if abs(err) <= 0.25 else ("no" if share > 0.05 else "n/a (<5%)"),
        })  # fmt: skip
    err = est.step_seconds / step - 1
    out.append({
        "placement": placement, "layout": layout, "stage": "step", "predicted_s": f"{est.step_seconds:.4f}",
        "measured_s": f"{step:.4f}", "error": f"{err:+.0%}", "share_of_step": "100%",
        "within_25pct": "yes" if abs(err) <= 0.25 else "no",
    })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args(argv)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    w = workload_of(load_config(RECIPE).config)
    tokens = w.samples * w.seq_len // 2  # a micro-batch's rows on one rank, at most
    device, facts = calibrate(w.actor.hidden_size, w.actor.ffn_hidden_size, tokens)
    rows = []
    for placement in args.placements:
        for layout in args.layouts:
            rows += compare(device, placement, layout, args.steps, args.warmup)
            print(placement, layout, [(r["stage"], r["error"]) for r in rows[-8:]], file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "simulator_validation.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    md = [
        f"command: `python benchmarks/simulator_validation.py {shlex.join(argv or sys.argv[1:])}`",
        f"load (1/5/15 min) before {' '.join(load_before)}, after {' '.join(load_after)}",
        "calibration: " + ", ".join(f"{k} {v:.4g}" for k, v in facts.items()),
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "---|" * len(rows[0]),
        *("| " + " | ".join(r.values()) + " |" for r in rows),
    ]
    (args.out / "simulator_validation.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
