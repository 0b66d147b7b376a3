"""Steps to a reward threshold in run directories: the first step whose trailing mean reward
(`reward/score_mean` over the last `--window` steps) reaches `--threshold`, per run.

Reads each run's `metrics.jsonl` (a demo sweep keeps them with `--runs DIR`):

    python benchmarks/steps_to_threshold.py /tmp/runs/moe_ep2-seed*
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def steps_to_threshold(rewards: list[float], threshold: float, window: int) -> int | None:
    """1-based step at which the trailing `window`-step mean first reaches `threshold`."""
    for end in range(window, len(rewards) + 1):
        if statistics.fmean(rewards[end - window : end]) >= threshold:
            return end
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--window", type=int, default=10)
    args = parser.parse_args(argv)
    for run in args.runs:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        by_step = {r["step"]: r["reward/score_mean"] for r in rows}
        rewards = [by_step[s] for s in sorted(by_step)]
        step = steps_to_threshold(rewards, args.threshold, args.window)
        print(f"{run.name}: {'never' if step is None else step} (of {len(rewards)} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
