"""The step simulator checked by measurement on this machine (CPU, gloo).

1. Calibrate a CPU device class from microbenchmarks of rl3d's components
   (`benchmarks/simulator_microbench.py`, `rl3d.planning.calibration`) `--calibrations` times,
   interleaved with the runs (before, between and after them), so that the calibration sees
   the machine as the runs do; each timing is the low percentile
   (`rl3d.planning.calibration.LOW_PERCENTILE`) of its repeats pooled over the calibrations.
2. Predict every stage of the CPU quickstarts, PPO (actor, critic, reference) and GRPO (actor,
   reference), under three placements (colocated; a separate rollout pool; own pools for the
   critic and the reference) and two layouts (the trained roles at tp=2 or dp=2), run each with
   `rl3d train`, and compare. A run's stages are measured as process CPU seconds: every rank
   writes its own per stage and step (`RL3D_STAGE_TIMES_DIR`), a stage's time is the busiest
   rank's, and the low percentile over the steps after `--warmup` (the last step, which sends
   no weights, left out) is compared: the calibration's estimator. The wall seconds (and the
   load) are listed beside them. A separate pool's `generate` is its rank's generation (the
   trainer's metric `async/rollout_generate_cpu_s`) plus the trainer's own part. A stage above
   5% of the step must be predicted within 25%; the table marks those that are not, and gives
   each prediction's range over the calibrations taken one at a time.

Writes `simulator_validation.csv`, `.md`, `.png` and the pooled calibration JSON into `--out`:

    python benchmarks/simulator_validation.py --out benchmarks/simulator
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

from rl3d.config import load_config
from rl3d.planning.calibration import cpu_device, low_percentile
from rl3d.planning.recipe import run_layout_of, workload_of
from rl3d.planning.simulator import simulate

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "ppo": ROOT / "recipes/quickstart_cpu_ppo.yaml",
    "grpo": ROOT / "recipes/quickstart_cpu_grpo.yaml",
}
CALIBRATION_RECIPE = RECIPES["ppo"]  # the same model and batch shape as GRPO's
OWN_REFERENCE = ["reference.colocate=false", "reference.parallel.tp=1", "reference.parallel.dp=1"]
PLACEMENTS = {
    "colocated": [],
    "rollout_pool": ["rollout.placement=separate", "rollout.pool.tp=1", "rollout.pool.dp=1"],
    "own_pools": OWN_REFERENCE,  # and the critic's, where the recipe has one
}
LAYOUTS = {"tp2": (2, 1), "dp2": (1, 2)}
ENV = dict(os.environ, RL3D_YAML_DIR=str(ROOT / "yaml"))


def microbench(path: Path, repeats: int) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks/simulator_microbench.py"), str(CALIBRATION_RECIPE),
           "--out", str(path), "--repeats", str(repeats)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=1200)
    if proc.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(path.read_text())


THROUGHPUTS = ("matmul_gflops", "copy_gbps", "gloo_gbps")
TIMES = ("gloo_alpha_us", "gloo_call_cpu_us", "gather_cpu_us", "gather_rollout_cpu_us", "gather_us")


def pooled(calibrations: list[dict]) -> dict:
    """One calibration from several: each row's repeats pooled, its seconds their low
    percentile; each fact the low percentile of its values (of a rate's inverse)."""
    out = dict(calibrations[0])
    for key in THROUGHPUTS:
        out[key] = 1 / low_percentile([1 / c[key] for c in calibrations])
    for key in TIMES:
        out[key] = low_percentile([c[key] for c in calibrations])
    out["rows"] = []
    for rows in zip(*(c["rows"] for c in calibrations)):
        times = [t for r in rows for t in r["times"]]
        out["rows"].append(rows[0] | {"times": times, "seconds": low_percentile(times)})
    out["loads"] = [c[k][0] for c in calibrations for k in ("load", "load_after")]
    return out


def _config(recipe: str, placement: str, layout: str, steps: int) -> list[str]:
    tp, dp = LAYOUTS[layout]
    trained = ["actor", "critic"] if recipe == "ppo" else ["actor"]
    par = [f"{role}.parallel.{axis}={n}" for role in trained for axis, n in (("tp", tp), ("dp", dp))]
    extra = list(PLACEMENTS[placement])
    world = tp * dp  # the actor's ranks, then the other pools': the rollout pool's or the reference's
    world += {"colocated": 0, "rollout_pool": 1, "own_pools": 1 + (len(trained) - 1) * tp * dp}[placement]
    if placement == "own_pools" and recipe == "ppo":
        extra.append("critic.colocate=false")  # in the actor's layout
    return [
        *par,
        *extra,
        f"launch.nproc_per_node={world}",
        f"trainer.total_steps={steps}",
        "checkpoint.save_every=0",
    ]


def measure(recipe: Path, overrides: list[str], tmp: Path, warmup: int) -> tuple[dict, dict]:
    """Per stage the low percentile over the kept steps of the busiest rank's CPU seconds (the
    calibration's estimator), and the median of the wall seconds rank 0 logged."""
    run_dir, times = tmp / "run", tmp / "stage_times"
    times.mkdir()
    cmd = [sys.executable, "-m", "rl3d.cli", "train", str(recipe), f"trainer.run_dir={run_dir}", *overrides]
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
    return {k: low_percentile(v) for k, v in cpu.items()}, wall


def predicted_stages(device, cfg) -> tuple[dict[str, float], float]:
    """The simulator's stages under rl3d's timers' names (`generate`: the rollout, the reward,
    the controller's part and a separate pool's hand-over), and its step."""
    est = simulate(workload_of(cfg), run_layout_of(cfg), device)
    stages = dict(est.stages)
    rollout = ("prefill", "decode", "score", "control", "handover")
    return {"generate": sum(stages.pop(k, 0.0) for k in rollout), **stages}, est.step_seconds


def table_rows(
    devices, run: tuple[str, str, str], overrides, cpu: dict, wall: dict, load: float
) -> list[dict]:
    """`devices`: the pooled calibration's class first, then one per calibration (the spread)."""
    cfg = load_config(RECIPES[run[0]], overrides).config
    (predicted, step_s), *alone = [predicted_stages(d, cfg) for d in devices]
    step = sum(cpu.values())
    out = []
    for stage in [*predicted, *(k for k in cpu if k not in predicted)]:
        pred, meas = predicted.get(stage, 0.0), cpu.get(stage, 0.0)
        spread = [a.get(stage, 0.0) for a, _ in alone]
        share = meas / step
        err = pred / meas - 1 if meas else float("inf")
        ok = "yes" if abs(err) <= 0.25 else ("no" if share > 0.05 else "n/a (<5%)")
        out.append(_row(run, stage, pred, spread, meas, wall.get(stage, 0.0), share, ok, load))
    ok = "yes" if abs(step_s / step - 1) <= 0.25 else "no"
    out.append(_row(run, "step", step_s, [s for _, s in alone], step, wall.get("step", 0.0), 1.0, ok, load))
    return out


def _row(run, stage, pred, spread, meas, wall, share, ok, load) -> dict:
    err = f"{pred / meas - 1:+.0%}" if meas else "-"
    recipe, placement, layout = run
    return {"recipe": recipe, "placement": placement, "layout": layout, "stage": stage,
            "predicted_s": f"{pred:.4f}", "by_calibration_s": f"{min(spread):.4f}-{max(spread):.4f}",
            "measured_cpu_s": f"{meas:.4f}", "error": err, "share_of_step": f"{share:.0%}",
            "within_25pct": ok, "wall_s": f"{wall:.4f}", "load_1min": f"{load:.1f}"}  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(dict.fromkeys((r["recipe"], r["placement"], r["layout"]) for r in rows))
    cols = 3
    rows_n = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), sharey=True, squeeze=False)
    for ax, run in zip(axes.flat, runs):
        mine = [r for r in rows if (r["recipe"], r["placement"], r["layout"]) == run and r["stage"] != "step"]
        mine = [r for r in mine if float(r["measured_cpu_s"]) > 0 or float(r["predicted_s"]) > 0]
        x = range(len(mine))
        ax.bar(
            [i - 0.2 for i in x], [float(r["measured_cpu_s"]) for r in mine], 0.4, label="measured (CPU s)"
        )
        ax.bar([i + 0.2 for i in x], [float(r["predicted_s"]) for r in mine], 0.4, label="predicted")
        ax.set_xticks(list(x), [r["stage"] for r in mine], rotation=60, fontsize=7)
        ax.set_title(" ".join(run), fontsize=9)
    for ax in list(axes.flat)[len(runs) :]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("seconds per step")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_all(args, tmp: Path) -> tuple[list[dict], dict]:
    """The runs, with `args.calibrations` calibrations spread evenly before, between and after
    them; returns the calibrations and each run's (overrides, measurement, load)."""
    runs = {
        (recipe, placement, layout): _config(recipe, placement, layout, args.steps)
        for recipe in args.recipes
        for placement in args.placements
        for layout in args.layouts
    }
    gaps = args.calibrations - 1  # calibrate after run i when i + 1 reaches the next gap's share
    due = {round(len(runs) * g / gaps) for g in range(1, gaps)} if gaps > 0 else set()
    calibrations = [microbench(tmp / "calibration0.json", args.repeats)]
    measured = {}
    for i, (run, overrides) in enumerate(runs.items(), 1):
        load = os.getloadavg()[0]
        cpu_wall = measure(RECIPES[run[0]], overrides, Path(tempfile.mkdtemp(dir=tmp)), args.warmup)
        measured[run] = (overrides, cpu_wall, load)
        print(*run, f"load {load:.1f}", file=sys.stderr)
        if i in due:
            calibrations.append(microbench(tmp / f"calibration{len(calibrations)}.json", args.repeats))
    if args.calibrations > 1:
        calibrations.append(microbench(tmp / f"calibration{len(calibrations)}.json", args.repeats))
    return calibrations, measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="of each microbenchmark, per calibration")
    parser.add_argument("--calibrations", type=int, default=3, help="interleaved with the runs (>= 1)")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args(argv)
    if args.calibrations < 1:
        parser.error("--calibrations must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        calibrations, measured = run_all(args, Path(tmp))
    calibration = pooled(calibrations)
    (args.out / "simulator_calibration.json").write_text(json.dumps(calibration, indent=1) + "\n")
    devices = [cpu_device(calibration)] + [cpu_device(pooled([c])) for c in calibrations]
    rows = []
    for run, (overrides, (cpu, wall), load) in measured.items():
        rows += table_rows(devices, run, overrides, cpu, wall, load)
    with open(args.out / "simulator_validation.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / "simulator_validation.png")
    md = summary(argv, calibration, devices, measured, rows, time.perf_counter() - started)
    (args.out / "simulator_validation.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


def summary(argv, calibration: dict, devices, measured: dict, rows: list[dict], seconds: float) -> list[str]:
    device, alone = devices[0], devices[1:]

    def spread(get, scale: float = 1e3, unit: str = " ms") -> str:
        values = [get(d) * scale for d in alone]
        return f"{get(device) * scale:.3g}{unit} ({min(values):.3g}-{max(values):.3g})"

    fixed = {  # seconds in ms, shares (`_share`) in %
        k: spread(lambda d, k=k: getattr(d.fixed, k), *((100, "%") if k.endswith("_share") else ()))
        for k in vars(device.fixed)
    }
    fixed["decode step"] = spread(lambda d: d.step_overhead_s)
    checked = [r for r in rows if r["stage"] != "step" and r["within_25pct"] != "n/a (<5%)"]
    steps = [r for r in rows if r["stage"] == "step"]
    return [
        f"command: `python benchmarks/simulator_validation.py {shlex.join(argv or sys.argv[1:])}` "
        f"({seconds / 60:.1f} min)",
        "load (1 min) at the calibrations' starts and ends: "
        + ", ".join(f"{x:.1f}" for x in calibration["loads"]) + "; at each run: "
        + ", ".join(f"{' '.join(run)} {m[2]:.1f}" for run, m in measured.items()),
        f"stages over 5% of their step within 25%: {sum(r['within_25pct'] == 'yes' for r in checked)} of "
        f"{len(checked)}; steps within 25%: {sum(r['within_25pct'] == 'yes' for r in steps)} of {len(steps)}",
        f"calibration, pooled over {len(alone)} (in brackets: each alone, least-most): matmul "
        f"{calibration['matmul_gflops']:.1f} GFLOP/s, copy {calibration['copy_gbps']:.2f} GB/s, gloo "
        f"all-reduce {calibration['gloo_call_cpu_us']:.0f} us CPU + bytes / "
        f"{calibration['gloo_gbps']:.2f} GB/s, "
        f"object gather {calibration['gather_cpu_us']:.0f} us CPU; "
        + ", ".join(f"{k} {v}" for k, v in fixed.items()),
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "---|" * len(rows[0]),
        *("| " + " | ".join(r.values()) + " |" for r in rows),
    ]  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
