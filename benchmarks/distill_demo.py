"""On-policy distillation on the demo task against GRPO from the same start.

1. A teacher: the demo recipe (`recipes/quickstart_cpu_grpo.yaml`, GRPO) trained with
   `--teacher-seed`, checkpointed at its last step and exported (`rl3d export`).
2. Per seed: a fresh student (the demo's random init for that seed) trained by
   `adv_estimator: on_policy_distillation` from the teacher, and the same start trained by GRPO.

Writes into `--out`: `distill.csv` / `distill.md` (per seed: the teacher's reward (its last-20
mean), the first step whose 10-step mean reward reaches it within `--margin` for each method,
each method's last-20 mean) and `distill_reverse_kl.csv` / `.png` (the distilled students'
per-step reverse KL to the teacher and reward).

    python benchmarks/distill_demo.py --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from demo_sweep import train_run

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/quickstart_cpu_grpo.yaml"
WINDOW = 10


def steps_to_reach(rewards: list[float], target: float) -> int | None:
    """The first step whose trailing `WINDOW`-step mean reward is >= target (None: never)."""
    for end in range(WINDOW, len(rewards) + 1):
        if statistics.fmean(rewards[end - WINDOW : end]) >= target:
            return end
    return None


def train_teacher(work: Path, seed: int, steps: int) -> tuple[Path, float]:
    run = work / "teacher-run"
    rows, _ = train_run(
        RECIPE,
        run,
        [f"trainer.seed={seed}", f"trainer.total_steps={steps}", f"checkpoint.save_every={steps}"],
    )
    dst = work / "teacher"
    cmd = [sys.executable, "-m", "rl3d.cli", "export", str(run), "--dst", str(dst)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return dst, statistics.fmean(r["reward/score_mean"] for r in rows[-20:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--teacher-seed", type=int, default=1)
    parser.add_argument("--teacher-steps", type=int, default=200)
    parser.add_argument("--student-steps", type=int, default=100)
    parser.add_argument("--grpo-steps", type=int, default=200)
    parser.add_argument("--margin", type=float, default=0.02, help="'reaches' = within this of the teacher")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/losses")
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="rl3d-distill-"))
    teacher, teacher_reward = train_teacher(work, args.teacher_seed, args.teacher_steps)
    target = teacher_reward - args.margin
    rows, curves = [], []
    for seed in args.seeds:
        distilled, _ = train_run(
            RECIPE,
            work / f"distill-{seed}",
            [
                f"trainer.seed={seed}",
                f"trainer.total_steps={args.student_steps}",
                "algorithm.adv_estimator=on_policy_distillation",
                f"algorithm.distill.teacher={teacher}",
            ],
        )
        grpo, _ = train_run(
            RECIPE, work / f"grpo-{seed}", [f"trainer.seed={seed}", f"trainer.total_steps={args.grpo_steps}"]
        )
        d_rewards = [r["reward/score_mean"] for r in distilled]
        g_rewards = [r["reward/score_mean"] for r in grpo]
        rows.append(
            {
                "seed": seed,
                "teacher_reward": teacher_reward,
                "distill_steps": steps_to_reach(d_rewards, target),
                "grpo_steps": steps_to_reach(g_rewards, target),
                "distill_last20": statistics.fmean(d_rewards[-20:]),
                "grpo_last20": statistics.fmean(g_rewards[-20:]),
            }
        )
        curves.append((seed, [r["distill/reverse_kl"] for r in distilled], d_rewards))
        print(rows[-1], flush=True)
        write(args, rows, curves)  # after every seed: a cut-short sweep keeps what it measured
    return 0


def write(args: argparse.Namespace, rows: list[dict], curves: list) -> None:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "distill.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(out / "distill_reverse_kl.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seed", "step", "reverse_kl", "reward"])
        for seed, kls, rewards in curves:
            writer.writerows(
                [seed, i + 1, f"{k:.5f}", f"{r:.4f}"] for i, (k, r) in enumerate(zip(kls, rewards))
            )
    seeds = " ".join(str(r["seed"]) for r in rows)
    fmt = lambda n: "never" if n is None else str(n)  # noqa: E731
    lines = [
        "# on-policy distillation vs GRPO on the demo task",
        "",
        f"`python benchmarks/distill_demo.py --seeds {seeds} --teacher-steps {args.teacher_steps} "
        f"--student-steps {args.student_steps} --grpo-steps {args.grpo_steps}`",
        "",
        f"Steps until the {WINDOW}-step mean reward reaches the teacher's last-20 mean minus {args.margin}.",
        "",
        "| seed | teacher reward | distill: steps | GRPO: steps | distill last-20 | GRPO last-20 |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['seed']} | {r['teacher_reward']:.3f} | {fmt(r['distill_steps'])} | "
            f"{fmt(r['grpo_steps'])} | {r['distill_last20']:.3f} | {r['grpo_last20']:.3f} |"
            for r in rows
        ),
        *([args.note] if args.note else []),
    ]
    (out / "distill.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_r) = plt.subplots(1, 2, figsize=(10, 4))
    for seed, kls, rewards in curves:
        ax_kl.plot(range(1, len(kls) + 1), kls, lw=1, label=f"seed {seed}")
        ax_r.plot(range(1, len(rewards) + 1), rewards, lw=1, label=f"seed {seed}")
    ax_kl.set(xlabel="step", ylabel="reverse KL to the teacher (per token)", title="distilled student")
    ax_r.set(xlabel="step", ylabel="mean reward", ylim=(0, 1.02), title="distilled student")
    ax_r.axhline(rows[0]["teacher_reward"], color="grey", ls="--", lw=0.8, label="teacher")
    ax_kl.legend(fontsize=8)
    ax_r.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "distill_reverse_kl.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
