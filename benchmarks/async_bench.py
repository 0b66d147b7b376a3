"""Synchronous vs one-step off-policy on a separate rollout rank: wall time per step, side by side.

Runs `recipes/quickstart_cpu_grpo_async.yaml` (one training rank, one rollout rank) with
`rollout.async.max_staleness` 0 and 1, alternating (0, 1, 0, 1, ...: `--repeats` pairs) so that
the machine's load drifts over both alike, with a small batch (`SHAPE`: 2 prompts x 4 samples)
and long responses (`--max-new-tokens`) so that generation takes about as long as training. Per
run: wall seconds per step over the steps after `--warmup` (from the metrics' wall-clock
stamps), the rollout rank's generation seconds and the training rank's own seconds per step
(its step time less its wait for samples). Writes
`async_bench.csv` and `async_bench.md` (the table, the ratio s1/s0, the command and the load
average before and after) into `--out`.

    python benchmarks/async_bench.py                      # 3 pairs x 24 steps, ~3 min on 2 cores
    python benchmarks/async_bench.py --steps 40 --repeats 3

The goal: max_staleness 1 at <= 0.75x the synchronous wall time per step.
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

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/quickstart_cpu_grpo_async.yaml"
# A small batch with long responses: token-by-token decoding then costs about what the batched
# update of the same tokens costs (with the recipe's 8 prompts x 4, training dominates on CPU).
SHAPE = ("data.prompts_per_step=2", "actor.mini_batch_size=8", "actor.micro_batch_size=8")
COLUMNS = ("run", "max_staleness", "steps", "wall_per_step_s", "generate_s", "train_s", "wait_trainer_s",
           "staleness_mean", "reward_mean")  # fmt: skip


def run_one(staleness: int, args, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "rl3d.cli", "train", str(RECIPE), f"trainer.run_dir={run_dir}"]
    cmd += [f"rollout.async.max_staleness={staleness}", f"trainer.total_steps={args.steps}"]
    cmd += [
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "checkpoint.save_every=0",
        "logging.tensorboard=false",
    ]
    cmd += [*SHAPE, *args.overrides, "--overwrite"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"max_staleness={staleness} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])
    timed = rows[args.warmup :]
    wall = (timed[-1]["time"] - rows[args.warmup - 1]["time"]) / len(timed)

    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in timed)

    return {
        "max_staleness": staleness,
        "steps": len(timed),
        "wall_per_step_s": wall,
        "generate_s": mean("async/rollout_generate_s"),
        "train_s": mean("time/step") - mean("async/wait_trainer_s"),
        "wait_trainer_s": mean("async/wait_trainer_s"),
        "staleness_mean": mean("async/staleness_mean"),
        "reward_mean": mean("reward/score_mean"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of (s0, s1) runs")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/async")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for staleness in (0, 1):
                start = time.monotonic()
                row = {"run": i} | run_one(staleness, args, Path(tmp) / f"s{staleness}_{i}")
                rows.append(row)
                print(  # noqa: T201 - progress of a benchmark script
                    f"pair {i + 1}/{args.repeats} max_staleness={staleness}: "
                    f"{row['wall_per_step_s']:.3f} s/step "
                    f"(generate {row['generate_s']:.3f} s, train {row['train_s']:.3f} s; "
                    f"{time.monotonic() - start:.0f} s)",
                    flush=True,
                )
    load_after = os.getloadavg()
    s0 = statistics.fmean(r["wall_per_step_s"] for r in rows if r["max_staleness"] == 0)
    s1 = statistics.fmean(r["wall_per_step_s"] for r in rows if r["max_staleness"] == 1)
    pairs = [b["wall_per_step_s"] / a["wall_per_step_s"] for a, b in zip(rows[::2], rows[1::2])]
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "async_bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    command = shlex.join(
        ["python", "benchmarks/async_bench.py", *(argv if argv is not None else sys.argv[1:])]
    )
    lines = [
        "| run | max_staleness | wall s/step | generate s | train s | trainer waits s | staleness | reward |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['run']} | {r['max_staleness']} | {r['wall_per_step_s']:.3f} | {r['generate_s']:.3f} | "
            f"{r['train_s']:.3f} | {r['wait_trainer_s']:.3f} | {r['staleness_mean']:.2f} | "
            f"{r['reward_mean']:.3f} |"
            for r in rows
        ),
        "",
        f"wall time per step, max_staleness 1 / 0: {s1 / s0:.2f} (mean {s1:.3f} / {s0:.3f} s; per pair "
        f"{', '.join(f'{p:.2f}' for p in pairs)}); goal <= 0.75",
        f"load average (1, 5, 15 min) before {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
        f"after {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}; {os.cpu_count()} cores",
        f"command: `{command}`",
    ]
    (args.out / "async_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-3:]))  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
