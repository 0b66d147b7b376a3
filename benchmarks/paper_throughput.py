"""The HybridFlow paper's end-to-end comparison, simulated: PPO, ReMax and Safe-RLHF at 7B, 13B,
34B and 70B on 16-128 A100s, rl3d's chosen layout against DeepSpeed-Chat, OpenRLHF and
NeMo-Aligner as modelled in `rl3d.planning.systems`.

Writes into `--out`: `paper_throughput.csv` (one row per point and system: step seconds,
tokens/s, the layout, the slowest stage), `paper_throughput_ratios.csv` (rl3d's throughput over
each baseline's per point), and `paper_throughput.png` (the ratios per model, one panel per
algorithm, the paper's 1.53x-20.57x range shaded). No GPU needed.

    python benchmarks/paper_throughput.py --out docs/assets    # ~5-10 min on 2 loaded cores
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from rl3d.planning.devices import get_device
from rl3d.planning.systems import PAPER_GPUS, PAPER_MODELS, PAPER_RANGE, PAPER_ROLES, SYSTEMS, compare


def _rows(algorithms, models, gpus, device):
    for algo in algorithms:
        for model in models:
            for n in gpus:
                yield algo, model, n, compare(algo, model, n, device)


def plot(ratio_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algorithms = sorted({r["algorithm"] for r in ratio_rows})
    fig, axes = plt.subplots(1, len(algorithms), figsize=(5 * len(algorithms), 4), squeeze=False)
    for ax, algo in zip(axes[0], algorithms):
        rows = [r for r in ratio_rows if r["algorithm"] == algo]
        labels = [f"{r['model'].removeprefix('llama2-')}/{r['gpus']}" for r in rows]
        for k, base in enumerate(b for b in SYSTEMS if b != "rl3d"):
            values = [float(r[base]) if r[base] else 0.0 for r in rows]
            ax.bar([i + 0.27 * (k - 1) for i in range(len(rows))], values, width=0.27, label=base)
        ax.axhspan(*PAPER_RANGE, color="grey", alpha=0.15, label="paper's range")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
        ax.set_title(f"{algo}: rl3d throughput / baseline (simulated)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--device", default="a100")
    parser.add_argument("--algorithms", nargs="+", default=list(PAPER_ROLES), choices=list(PAPER_ROLES))
    parser.add_argument("--models", nargs="+", default=list(PAPER_MODELS))
    parser.add_argument("--gpus", nargs="+", type=int, default=list(PAPER_GPUS))
    args = parser.parse_args(argv)
    device = get_device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    points, ratio_rows = [], []
    for algo, model, n, result in _rows(args.algorithms, args.models, args.gpus, device):
        for name, r in result["systems"].items():
            points.append({
                "algorithm": algo, "model": model, "gpus": n, "system": name,
                "step_seconds": f"{r['step_seconds']:.2f}" if r else "",
                "tokens_per_s": f"{result['tokens'] / r['step_seconds']:.0f}" if r else "",
                "bottleneck": max(r["stages"], key=r["stages"].get) if r else "does not fit",
                "layout": r["layout"] if r else "",
            })  # fmt: skip
        ratios = result["ratios"]
        ratio_rows.append(
            {"algorithm": algo, "model": model, "gpus": n}
            | {b: f"{ratios[b]:.2f}" if b in ratios else "" for b in SYSTEMS if b != "rl3d"}
        )
        print(algo, model, n, {b: round(v, 2) for b, v in ratios.items()}, file=sys.stderr)
    for name, rows in (("paper_throughput.csv", points), ("paper_throughput_ratios.csv", ratio_rows)):
        with open(args.out / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    plot(ratio_rows, args.out / "paper_throughput.png")
    print(f"wrote {args.out}/paper_throughput*.csv and .png in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
