"""A separate rollout pool on both backends: wall time per step, spmd (torchrun) vs Ray, side by side.

Runs `benchmarks/async_bench.py`'s setting (`recipes/quickstart_cpu_grpo_async.yaml`, one
training rank and one rollout rank, 2 prompts x 4 samples, long responses so that generation
takes about as long as training) with `launch.backend` spmd and ray, at `max_staleness` 0 and 1,
alternating (spmd s0, ray s0, spmd s1, ray s1, ... `--repeats` rounds) so that the machine's
load drifts over all alike. Per run: wall seconds per step after `--warmup` steps (from the
metrics' wall-clock stamps), so start-up (torchrun vs Ray's) is left out. Writes
`async_backends_bench.csv` and `.md` (table, ratios ray/spmd per staleness, command, load) into `--out`.

    python benchmarks/async_backends_bench.py     # 2 rounds x 4 runs x 24 steps, ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_bench import ROOT, run_one  # noqa: E402 - the same runs, one backend each

COLUMNS = ("run", "backend", "max_staleness", "steps", "wall_per_step_s", "generate_s", "train_s",
           "wait_trainer_s", "staleness_mean", "reward_mean")  # fmt: skip
BACKENDS = ("spmd", "ray")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the 4 runs")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/async")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    overrides = list(args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for staleness in (0, 1):
                for backend in BACKENDS:
                    args.overrides = [*overrides, f"launch.backend={backend}"]
                    start = time.monotonic()
                    run_dir = Path(tmp) / f"{backend}_s{staleness}_{i}"
                    row = {"run": i, "backend": backend} | run_one(staleness, args, run_dir)
                    rows.append(row)
                    print(  # noqa: T201 - progress of a benchmark script
                        f"round {i + 1}/{args.repeats} {backend} max_staleness={staleness}: "
                        f"{row['wall_per_step_s']:.3f} s/step (generate {row['generate_s']:.3f} s, "
                        f"train {row['train_s']:.3f} s; {time.monotonic() - start:.0f} s)",
                        flush=True,
                    )
    load_after = os.getloadavg()

    def mean(backend: str, staleness: int) -> float:
        return statistics.fmean(
            r["wall_per_step_s"] for r in rows if r["backend"] == backend and r["max_staleness"] == staleness
        )

    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "async_backends_bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    command = shlex.join(
        ["python", "benchmarks/async_backends_bench.py", *(argv if argv is not None else sys.argv[1:])]
    )
    summary = [
        *(
            f"max_staleness {s}: ray {mean('ray', s):.3f} s/step, spmd {mean('spmd', s):.3f} s/step, "
            f"ray/spmd {mean('ray', s) / mean('spmd', s):.2f}"
            for s in (0, 1)
        ),
        f"max_staleness 1/0: ray {mean('ray', 1) / mean('ray', 0):.2f}, "
        f"spmd {mean('spmd', 1) / mean('spmd', 0):.2f}",
    ]
    lines = [
        "| run | backend | max_staleness | wall s/step | generate s | train s | trainer waits s | stale |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['run']} | {r['backend']} | {r['max_staleness']} | {r['wall_per_step_s']:.3f} | "
            f"{r['generate_s']:.3f} | {r['train_s']:.3f} | {r['wait_trainer_s']:.3f} | "
            f"{r['staleness_mean']:.2f} |"
            for r in rows
        ),
        "",
        *summary,
        f"load average (1, 5, 15 min) before {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
        f"after {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}; {os.cpu_count()} cores",
        f"command: `{command}`",
    ]
    (args.out / "async_backends_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(summary) - 2 :]))  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
