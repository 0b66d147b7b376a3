"""The learned-reward chain over several seeds: per seed, train the reward model
(`recipes/quickstart_cpu_rm.yaml`, trainer.seed=S), then PPO against it
(`recipes/quickstart_cpu_ppo_rm.yaml`, trainer.seed=S, reward.model.path = that run), one run at
a time. The policy is scored by the model only; the hidden rule it was labelled with
(parity_repeat) is logged as `reward/rule_mean`.

Writes into `--out`: `rm_sweep.csv` (per seed: the model's held-out pair accuracy and margin,
the rule's mean over PPO's first and last 20 steps and their difference, PPO's training time
(sum of `time/step`) and wall time), `rm_sweep.md` (the same with min / mean / max) and
`rm_sweep.png` (every seed's rule curve).

    python benchmarks/rm_sweep.py --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 20
COLUMNS = (
    "seed",
    "val_accuracy",
    "val_margin",
    "rule_first20",
    "rule_last20",
    "rise",
    "ppo_train_s",
    "ppo_wall_s",
)


def _train(recipe: str, run_dir: Path, *overrides: str) -> float:
    cmd = [sys.executable, "-m", "rl3d.cli", "train", str(ROOT / recipe), f"trainer.run_dir={run_dir}"]
    start = time.monotonic()
    proc = subprocess.run([*cmd, *overrides, "--overwrite"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{recipe} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.monotonic() - start


def run_seed(seed: int, out: Path) -> tuple[dict, list[float]]:
    rm_dir, ppo_dir = out / f"rm_seed{seed}", out / f"ppo_rm_seed{seed}"
    _train("recipes/quickstart_cpu_rm.yaml", rm_dir, f"trainer.seed={seed}")
    rm = json.loads((rm_dir / "rm_summary.json").read_text())
    wall = _train(
        "recipes/quickstart_cpu_ppo_rm.yaml", ppo_dir, f"trainer.seed={seed}", f"reward.model.path={rm_dir}"
    )
    rows = [json.loads(line) for line in (ppo_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in {r["step"]: r for r in rows}.values()]
    rule = [r["reward/rule_mean"] for r in steps]
    first, last = statistics.mean(rule[:WINDOW]), statistics.mean(rule[-WINDOW:])
    row = {
        "seed": seed,
        "val_accuracy": rm["val/accuracy"],
        "val_margin": rm["val/margin"],
        "rule_first20": first,
        "rule_last20": last,
        "rise": last - first,
        "ppo_train_s": sum(r["time/step"] for r in steps),
        "ppo_wall_s": wall,
    }
    return row, rule


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/rm")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results, curves = [], {}
    for seed in args.seeds:
        row, curves[seed] = run_seed(seed, args.out / "runs")
        results.append(row)
        print(
            " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
            flush=True,
        )
    with open(args.out / "rm_sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(results)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += [
        "| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS) + " |"
        for r in results
    ]
    for name, fn in (("min", min), ("mean", statistics.mean), ("max", max)):
        lines.append(
            f"| {name} | " + " | ".join(f"{fn(r[c] for r in results):.3f}" for c in COLUMNS[1:]) + " |"
        )
    (args.out / "rm_sweep.md").write_text(
        "`python benchmarks/rm_sweep.py --seeds "
        + " ".join(map(str, args.seeds))
        + "`\n\n"
        + "\n".join(lines)
        + "\n"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for seed, rule in curves.items():
        ax.plot(range(1, len(rule) + 1), rule, label=f"seed {seed}")
    ax.set_xlabel("PPO step")
    ax.set_ylabel("hidden rule (reward/rule_mean)")
    ax.set_title("PPO against a learned reward model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "rm_sweep.png", dpi=100)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
