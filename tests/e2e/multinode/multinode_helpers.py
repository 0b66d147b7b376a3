"""Shared by the multi-node tests: the quick GRPO run, waiting on processes and metrics."""

from __future__ import annotations

import time
from pathlib import Path

STEPS = 3  # every multi-node run that must finish trains the GRPO quickstart this many steps
QUICK = (f"trainer.total_steps={STEPS}", "checkpoint.save_every=0")
TIMEOUT_S = 15  # launch.timeout_s of the fault tests
FOUR_RANKS = ("actor.parallel.dp=2",)  # the quickstart's tp=2 pair, twice: 2 nodes x 2 ranks


def metrics_lines(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.exists() else 0


def wait_until(done, alive, describe, timeout_s: float = 180) -> None:
    """Poll `done()`; fail with `describe()` when `alive()` turns false first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert alive(), describe()
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s\n{describe()}"
        time.sleep(0.2)


def wait_all(procs, timeout_s: float) -> list[tuple[int | None, float]]:
    """(exit status, seconds) of each process; None where it still ran after `timeout_s`."""
    start = time.monotonic()
    ends: dict[int, tuple[int, float]] = {}
    while len(ends) < len(procs) and time.monotonic() - start < timeout_s:
        for i, proc in enumerate(procs):
            if i not in ends and proc.poll() is not None:
                ends[i] = (proc.returncode, time.monotonic() - start)
        time.sleep(0.2)
    return [ends.get(i, (None, timeout_s)) for i in range(len(procs))]
