"""Routing replay measured: a bf16 rollout engine against the fp32 trainer on a tiny MoE.

    python benchmarks/moe_routing_replay.py --seeds 1 2 3 --steps 3 [--max-new-tokens 8] [--out DIR]

Per `algorithm.routing_replay` mode (none, rollout, old) and seed: `rl3d train` of the demo
recipe (`recipes/quickstart_cpu_grpo.yaml`) on `tiny-qwen3-moe` (8 experts, top 2, random
weights from the seed) at DP 2, `model.dtype=float32`, `rollout.dtype=bfloat16`, the old
log-prob forward always run (`actor.recompute_old_logp=always`). Per step it reads:

- `rollout/logp_diff_max` / `_mean`: |engine log-prob - trainer old log-prob| over the
  response tokens;
- `moe/routing_mismatch` (rollout mode): the decisions (real token x layer) where the trainer's
  own router chose another expert set than the engine recorded, at the old-log-prob forward,
  which the replay overrides;
- `moe/routing_mismatch_update`: the same for the update's forwards against the record they
  replay (the engine's, or the old forward's own).

Writes `--out`/routing_replay.csv (every step), routing_replay.md (the table in docs/moe.md)
and routing_replay.png (logp_diff_max per step).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
from pathlib import Path

from demo_sweep import train_run

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/quickstart_cpu_grpo.yaml"
MODES = ("none", "rollout", "old")
KEYS = (
    "rollout/logp_diff_max",
    "rollout/logp_diff_mean",
    "moe/routing_mismatch",
    "moe/routing_mismatch_update",
)
COMMON = [
    "model.name=tiny-qwen3-moe",
    "model.dtype=float32",
    "rollout.dtype=bfloat16",
    "actor.parallel={tp: 1, pp: 1, dp: 2}",
    "actor.recompute_old_logp=always",
]


def spread(values: list[float], fmt: str) -> str:
    """mean (min-max) of the seeds' values."""
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def table(rows: list[dict], step: int | None) -> list[str]:
    """One line per mode: the seeds' values at `step` (None: each seed's mean over its steps)."""
    out = []
    for mode in MODES:
        per_seed: dict[str, list[float]] = {k: [] for k in KEYS}
        for seed in sorted({r["seed"] for r in rows}):
            mine = [r for r in rows if r["mode"] == mode and r["seed"] == seed]
            mine = [r for r in mine if step is None or r["step"] == step]
            for key in KEYS:
                vals = [r[key] for r in mine if r[key] != ""]
                if vals:
                    per_seed[key].append(statistics.fmean(vals))
        cells = [
            spread(per_seed["rollout/logp_diff_max"], ".2e"),
            spread(per_seed["rollout/logp_diff_mean"], ".2e"),
            spread([100 * v for v in per_seed["moe/routing_mismatch"]], ".2f") + "%"
            if per_seed["moe/routing_mismatch"]
            else "-",
            spread([100 * v for v in per_seed["moe/routing_mismatch_update"]], ".1f") + "%"
            if per_seed["moe/routing_mismatch_update"]
            else "-",
        ]
        out.append(f"| {mode} | " + " | ".join(cells) + " |")
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for color, mode in zip(("tab:red", "tab:blue", "tab:green"), MODES):
        for seed in sorted({r["seed"] for r in rows}):
            mine = sorted(
                (r["step"], r["rollout/logp_diff_max"])
                for r in rows
                if (r["mode"], r["seed"]) == (mode, seed)
            )
            label = f"routing_replay={mode}" if seed == rows[0]["seed"] else None
            ax.plot(*zip(*mine), marker="o", color=color, alpha=0.7, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("rollout/logp_diff_max")
    ax.set_yscale("log")
    ax.set_title("bf16 engine vs fp32 trainer, tiny-qwen3-moe")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=8, help="rollout.max_new_tokens")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/moe")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rl3d-replay-"))
    rows = []
    for seed in args.seeds:
        for mode in MODES:
            overrides = [*COMMON, f"algorithm.routing_replay={mode}", f"trainer.seed={seed}"]
            overrides.append(f"rollout.max_new_tokens={args.max_new_tokens}")
            steps, wall = train_run(
                RECIPE, work / f"{mode}-{seed}", [*overrides, f"trainer.total_steps={args.steps}"]
            )
            for r in steps:
                rows.append(
                    {"mode": mode, "seed": seed, "step": r["step"], **{k: r.get(k, "") for k in KEYS}}
                )
            print(f"seed {seed} {mode}: {wall:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    with open(args.out / "routing_replay.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["mode", "seed", "step", *KEYS])
        writer.writeheader()
        writer.writerows(rows)
    header = [
        "| routing_replay | logp_diff_max | logp_diff_mean | moe/routing_mismatch "
        "| moe/routing_mismatch_update |",
        "|---|---|---|---|---|",
    ]
    lines = ["Step 1 (every mode generates the same samples from the same weights):", "", *header]
    lines += table(rows, 1)
    lines += ["", f"Each seed's mean over steps 1-{args.steps}:", "", *header, *table(rows, None)]
    (args.out / "routing_replay.md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out / "routing_replay.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
