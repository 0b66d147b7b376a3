"""The step simulator checked by measurement on this machine (CPU, gloo).

1. Calibrate a CPU device class from microbenchmarks of rl3d's components
   (`benchmarks/simulator_microbench.py`, `rl3d.planning.calibration`), once before the runs and
   once after; each timing keeps the least of both.
2. Predict every stage of the PPO CPU quickstart under three placements (colocated; a separate
   rollout pool; own critic and reference pools) and two layouts (actor and critic tp=2 or
   dp=2), run each with `rl3d train`, and compare. A run's stages are measured as process CPU
   seconds: every rank writes its own per stage and step (`RL3D_STAGE_TIMES_DIR`), a stage's
   time is the busiest rank's, and its least value over the steps after `--warmup` (the last
   step, which sends no weights, left out) is compared: the same estimator as the
   calibration's, least of the repeats. CPU seconds are the ranks' own work, which the
   other processes of a busy machine barely change; the wall seconds (and the load) are listed
   beside them. A separate pool's `generate` is its rank's generation (the trainer's metric
   `async/rollout_generate_cpu_s`) plus the trainer's own part. A stage above 5% of the step
   must be predicted within 25%; the table marks those that are not.

Writes `simulator_validation.csv`, `.md`, `.png` and the calibration JSON into `--out`:

    python benchmarks/simulator_validation.py --out benchmarks/simulator  # 4.5 min at load 3-6, 9 at 7-15
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
from pathlib import Path

from rl3d.config import load_config
from rl3d.planning.calibration import cpu_device
from rl3d.planning.recipe import placement_of, workload_of
from rl3d.planning.simulator import simulate

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/quickstart_cpu_ppo.yaml"
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
ENV = dict(os.environ, RL3D_YAML_DIR=str(ROOT / "yaml"))


def microbench(path: Path, repeats: int) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks/simulator_microbench.py"), str(RECIPE), "--out", str(path),
           "--repeats", str(repeats)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=1200)
    if proc.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(path.read_text())


def least_of(first: dict, second: dict) -> dict:
    """Both calibrations' rows and facts, each timing the least of the two (throughputs the most)."""
    out = dict(first)
    for key in ("matmul_gflops", "copy_gbps", "gloo_gbps"):
        out[key] = max(first[key], second[key])
    for key in ("gloo_alpha_us", "gloo_call_cpu_us", "gather_cpu_us", "gather_rollout_cpu_us", "gather_us"):
        out[key] = min(first[key], second[key])
    out["rows"] = [
        a | {"seconds": min(a["seconds"], b["seconds"])} for a, b in zip(first["rows"], second["rows"])
    ]
    out["loads"] = [first["load"], first["load_after"], second["load"], second["load_after"]]
    return out


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


def measure(overrides: list[str], tmp: Path, warmup: int) -> tuple[dict, dict]:
    """Per stage the least over the kept steps of the busiest rank's CPU seconds (as the
    calibration keeps the least of its repeats), and the median of the wall seconds rank 0
    logged."""
    run_dir, times = tmp / "run", tmp / "stage_times"
    times.mkdir()
    cmd = [sys.executable, "-m", "rl3d.cli", "train", str(RECIPE), f"trainer.run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV | {"RL3D_STAGE_TIMES_DIR": str(times)},
                          timeout=1800)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    metrics = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    kept = range(warmup + 1, len(metrics))  # steps are 1-based; the last sends no weights
    ranks = [
        [json.loads(line) for line in f.read_text().splitlines()] for f in sorted(times.glob("rank*.jsonl"))
    ]
    cpu: dict[str, list[float]] = {}
    for step in kept:
        rows = [r for rank in ranks for r in rank if r["step"] == step]
        for stage in rows[0]["cpu"]:
            cpu.setdefault(stage, []).append(max(r["cpu"].get(stage, 0.0) for r in rows))
        if "async/rollout_generate_cpu_s" in metrics[step - 1]:
            cpu["generate"][-1] += metrics[step - 1]["async/rollout_generate_cpu_s"]
    wall = {
        k[5:]: statistics.median(m[k] for m in metrics[warmup:-1])
        for k in metrics[0]
        if k.startswith("time/")
    }
    return {k: min(v) for k, v in cpu.items()}, wall


def table_rows(
    device, placement: str, layout: str, steps: int, cpu: dict, wall: dict, load: float
) -> list[dict]:
    cfg = load_config(RECIPE, _config(placement, layout, steps)).config
    est = simulate(workload_of(cfg), placement_of(cfg), device)
    predicted = dict(est.stages)
    predicted["generate"] = predicted.pop("prefill") + predicted.pop("decode") + predicted.pop("score", 0.0)
    step = sum(cpu.values())
    out = []
    for stage in [*predicted, *(k for k in cpu if k not in predicted)]:
        pred, meas = predicted.get(stage, 0.0), cpu.get(stage, 0.0)
        share = meas / step
        err = pred / meas - 1 if meas else float("inf")
        ok = "yes" if abs(err) <= 0.25 else ("no" if share > 0.05 else "n/a (<5%)")
        out.append(_row(placement, layout, stage, pred, meas, wall.get(stage, 0.0), share, ok, load))
    err = est.step_seconds / step - 1
    out.append(_row(placement, layout, "step", est.step_seconds, step, wall.get("step", 0.0), 1.0,
                    "yes" if abs(err) <= 0.25 else "no", load))  # fmt: skip
    return out


def _row(placement, layout, stage, pred, meas, wall, share, ok, load) -> dict:
    err = f"{pred / meas - 1:+.0%}" if meas else "-"
    return {"placement": placement, "layout": layout, "stage": stage, "predicted_s": f"{pred:.4f}",
            "measured_cpu_s": f"{meas:.4f}", "error": err, "share_of_step": f"{share:.0%}",
            "within_25pct": ok, "wall_s": f"{wall:.4f}", "load_1min": f"{load:.1f}"}  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted({(r["placement"], r["layout"]) for r in rows}, key=lambda x: list(PLACEMENTS).index(x[0]))
    cols = min(3, len(runs))
    rows_n = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), sharey=True, squeeze=False)
    for ax, (placement, layout) in zip(axes.flat, runs):
        mine = [
            r for r in rows if (r["placement"], r["layout"]) == (placement, layout) and r["stage"] != "step"
        ]
        mine = [r for r in mine if float(r["measured_cpu_s"]) > 0 or float(r["predicted_s"]) > 0]
        x = range(len(mine))
        ax.bar(
            [i - 0.2 for i in x], [float(r["measured_cpu_s"]) for r in mine], 0.4, label="measured (CPU s)"
        )
        ax.bar([i + 0.2 for i in x], [float(r["predicted_s"]) for r in mine], 0.4, label="predicted")
        ax.set_xticks(list(x), [r["stage"] for r in mine], rotation=60, fontsize=7)
        ax.set_title(f"{placement} {layout}", fontsize=9)
    axes[0][0].set_ylabel("seconds per step")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="of each microbenchmark, per calibration")
    parser.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        before = microbench(Path(tmp) / "before.json", args.repeats)
        runs = {}
        for placement in args.placements:
            for layout in args.layouts:
                runs[placement, layout] = _config(placement, layout, args.steps)
        # the runs sit between the two calibrations; each device class needs both, so the
        # predictions are made afterwards from the runs' measurements kept here
        measured = {}
        for key, overrides in runs.items():
            load = os.getloadavg()[0]
            measured[key] = (measure(overrides, Path(tempfile.mkdtemp(dir=tmp)), args.warmup), load)
            print(*key, f"load {load:.1f}", file=sys.stderr)
        after = microbench(Path(tmp) / "after.json", args.repeats)
    calibration = least_of(before, after)
    (args.out / "simulator_calibration.json").write_text(json.dumps(calibration, indent=1) + "\n")
    device = cpu_device(calibration)
    rows = []
    for (placement, layout), ((cpu, wall), load) in measured.items():
        rows += table_rows(device, placement, layout, args.steps, cpu, wall, load)
    with open(args.out / "simulator_validation.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / "simulator_validation.png")
    fixed = {k: f"{v * 1e3:.3g} ms" for k, v in vars(device.fixed).items()}
    md = [
        f"command: `python benchmarks/simulator_validation.py {shlex.join(argv or sys.argv[1:])}`",
        "load (1 min) at the calibrations and each run: "
        + ", ".join(f"{x[0]:.1f}" for x in calibration["loads"]) + "; "
        + ", ".join(f"{p} {lay} {m[1]:.1f}" for (p, lay), m in measured.items()),
        f"calibration: matmul {calibration['matmul_gflops']:.1f} GFLOP/s, "
        f"copy {calibration['copy_gbps']:.2f} GB/s, "
        f"gloo all-reduce {calibration['gloo_call_cpu_us']:.0f} us CPU "
        f"+ bytes / {calibration['gloo_gbps']:.2f} GB/s, "
        f"object gather {calibration['gather_cpu_us']:.0f} us CPU, "
        f"decode step {device.step_overhead_s * 1e3:.3g} ms; "
        + ", ".join(f"{k} {v}" for k, v in fixed.items()),
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "---|" * len(rows[0]),
        *("| " + " | ".join(r.values()) + " |" for r in rows),
    ]  # fmt: skip
    (args.out / "simulator_validation.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
