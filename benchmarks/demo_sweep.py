"""The demo's learning curve over several seeds: how the demo's task and settings were chosen.

Runs `rl3d train RECIPE trainer.seed=S [overrides]` once per seed, one run at a time (each takes
both CPU cores), and writes, per sweep `--name`, into `--out`:
- `<name>.csv`: per seed, the mean reward over the first and the last 20 steps, the first step at
  which the mean of the 20 steps up to it reaches the goal's last-20 mean (`steps_to_goal`), the final
  actor-reference KL (mean of `kl/actor_ref_k1` over the last 20 steps), the training time
  (sum of the steps' `time/step`) and the wall time of the whole command (start-up included);
- `<name>.md`: the same as a table with the spread (min / mean / max) and the command;
- `<name>.png`: every seed's reward curve.

The promise the demo makes (README, docs/demo.md): every seed's last-20 mean >= 0.9 and first-20 <= 0.6, in
200 steps and under 2 minutes of training on 2 cores.

    python benchmarks/demo_sweep.py --seeds 1 2 3 4 5
    python benchmarks/demo_sweep.py data.synthetic.task=parity_match --name parity_match --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 20
GOAL_LAST, GOAL_FIRST, GOAL_TRAIN_S = 0.9, 0.6, 120.0
COLUMNS = (
    "seed", "steps", "first20", "last20", "steps_to_goal", "kl_last20", "train_s", "wall_s", "meets_goal",
)  # fmt: skip


def train_run(recipe: Path, run_dir: Path, overrides: list[str]) -> tuple[list[dict], float]:
    """`rl3d train` of `recipe` into `run_dir` (no checkpoints): its metrics rows in step order
    and the wall seconds; a failed run ends the sweep with its command and stderr."""
    cmd = [sys.executable, "-m", "rl3d.cli", "train", str(recipe), f"trainer.run_dir={run_dir}"]
    cmd += ["checkpoint.save_every=0", *overrides, "--overwrite"]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in rows}
    return [by_step[s] for s in sorted(by_step)], wall


def run_one(recipe: Path, seed: int, overrides: list[str], run_dir: Path) -> dict:
    steps, wall = train_run(recipe, run_dir, [f"trainer.seed={seed}", *overrides])
    rewards = [r["reward/score_mean"] for r in steps]
    kls = [r.get("kl/actor_ref_k1", float("nan")) for r in steps[-WINDOW:]]
    row = {
        "seed": seed,
        "steps": len(steps),
        "first20": statistics.fmean(rewards[:WINDOW]),
        "last20": statistics.fmean(rewards[-WINDOW:]),
        "steps_to_goal": steps_to_goal(rewards),
        "kl_last20": statistics.fmean(kls),
        "train_s": sum(r.get("time/step", 0.0) for r in steps),
        "wall_s": wall,
    }
    row["meets_goal"] = (
        row["last20"] >= GOAL_LAST and row["first20"] <= GOAL_FIRST and row["train_s"] < GOAL_TRAIN_S
    )
    return row | {"rewards": rewards}


def steps_to_goal(rewards: list[float]) -> int | None:
    """The first step whose trailing 20-step mean reward reaches GOAL_LAST (None: never)."""
    for step in range(WINDOW, len(rewards) + 1):
        if statistics.fmean(rewards[step - WINDOW : step]) >= GOAL_LAST:
            return step
    return None


def spread(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r[key] is not None]
    if not values:
        return "-"
    return f"{min(values):.3g} / {statistics.fmean(values):.3g} / {max(values):.3g}"


def write_seed_csv(path: Path, columns: tuple[str, ...], rows: list[dict]) -> None:
    """One line per seed, floats to 4 decimals (the sweeps' CSV)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})


def write_outputs(out: Path, name: str, rows: list[dict], command: str, note: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_seed_csv(out / f"{name}.csv", COLUMNS, rows)
    lines = [
        f"# demo sweep `{name}`",
        "",
        f"`{command}`",
        "",
        "| seed | first-20 reward | last-20 reward | steps to goal | actor-ref KL (last 20) | training s "
        "| wall s | goal |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['seed']} | {r['first20']:.3f} | {r['last20']:.3f} | {r['steps_to_goal'] or 'never'} | "
            f"{r['kl_last20']:.2f} | "
            f"{r['train_s']:.0f} | {r['wall_s']:.0f} | {'yes' if r['meets_goal'] else 'no'} |"
            for r in rows
        ),
        f"| min / mean / max | {spread(rows, 'first20')} | {spread(rows, 'last20')} | "
        f"{spread(rows, 'steps_to_goal')} | {spread(rows, 'kl_last20')} | {spread(rows, 'train_s')} | "
        f"{spread(rows, 'wall_s')} | "
        f"{sum(r['meets_goal'] for r in rows)}/{len(rows)} |",
        "",
        f"Goal: every seed's last-{WINDOW} mean >= {GOAL_LAST}, first-{WINDOW} <= {GOAL_FIRST}, "
        f"training under {GOAL_TRAIN_S:.0f} s (2 CPU cores). Steps to goal: the first step whose "
        f"trailing {WINDOW}-step mean reaches {GOAL_LAST}.",
        *([note] if note else []),
    ]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    _plot(out / f"{name}.png", name, rows)


def _plot(path: Path, name: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.plot(range(1, len(r["rewards"]) + 1), r["rewards"], lw=1, label=f"seed {r['seed']}")
    ax.axhline(GOAL_LAST, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"demo sweep: {name}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    global GOAL_FIRST, GOAL_LAST, GOAL_TRAIN_S  # another recipe's promise (the tool demo's)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every seed's run")
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes/quickstart_cpu_grpo.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--name", default="demo")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/demo")
    parser.add_argument("--runs", type=Path, default=None, help="run directories (default: a temp dir)")
    parser.add_argument("--note", default="", help="a line for the table's file (the machine, its load)")
    parser.add_argument("--goal-first", type=float, default=GOAL_FIRST, help="a seed's first-20 mean at most")
    parser.add_argument("--goal-last", type=float, default=GOAL_LAST, help="a seed's last-20 mean at least")
    parser.add_argument("--goal-train-s", type=float, default=GOAL_TRAIN_S, help="training seconds at most")
    args = parser.parse_args(argv)
    GOAL_FIRST, GOAL_LAST, GOAL_TRAIN_S = args.goal_first, args.goal_last, args.goal_train_s
    runs = args.runs or Path(tempfile.mkdtemp(prefix="rl3d-demo-sweep-"))
    # the overrides before the options: after `--seeds N...` argparse would read them as seeds
    command = shlex.join(
        [
            "python",
            "benchmarks/demo_sweep.py",
            *args.overrides,
            "--name",
            args.name,
            "--seeds",
            *map(str, args.seeds),
        ]
        + (
            ["--recipe", str(args.recipe.resolve().relative_to(ROOT))]
            if args.recipe.name != "quickstart_cpu_grpo.yaml"
            else []
        )
        + (
            ["--out", str(args.out.resolve().relative_to(ROOT))]
            if args.out.resolve() != ROOT / "benchmarks/demo"
            else []
        )
        + [
            f"--{k}={v:g}"
            for k, v, d in (
                ("goal-first", GOAL_FIRST, 0.6),
                ("goal-last", GOAL_LAST, 0.9),
                ("goal-train-s", GOAL_TRAIN_S, 120.0),
            )
            if v != d
        ]
    )
    rows = []
    for seed in args.seeds:
        row = run_one(args.recipe, seed, args.overrides, runs / f"{args.name}-seed{seed}")
        rows.append(row)
        print(
            f"seed {seed}: first-20 {row['first20']:.3f} last-20 {row['last20']:.3f} "
            f"KL {row['kl_last20']:.2f} train {row['train_s']:.0f} s wall {row['wall_s']:.0f} s",
            flush=True,
        )
        write_outputs(args.out, args.name, rows, command, args.note)
    print((args.out / f"{args.name}.md").read_text())
    return 0 if all(r["meets_goal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
