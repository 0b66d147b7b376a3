"""How a failed rank reports itself: one line for people, the traceback for the log (the
training ranks and the reward-model job's ranks alike)."""

from __future__ import annotations

import sys
from pathlib import Path

FAILURE_FILE = "failed_rank{rank}.txt"  # in the run's logs/: the launcher names the first one


def report_rank_failure(err: BaseException, rank: int, log_dir: Path) -> int:
    """One line on stderr naming the rank, the error and the log file; the full traceback goes
    to that rank's log file, and the line to `logs/failed_rank<N>.txt` for the launcher (the
    first rank to fail is the cause, the others usually fail in a collective after it)."""
    import traceback

    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = log_dir / f"rank{rank}.log"
    with open(log_file, "a") as f:
        f.write(f"rank {rank} failed:\n")
        traceback.print_exception(err, file=f)
    first = (str(err).strip().splitlines() or [""])[0]
    line = f"rank {rank} failed: {type(err).__name__}: {first} (traceback: {log_file})"
    (log_dir / FAILURE_FILE.format(rank=rank)).write_text(line + "\n")
    print(f"rl3d: {line}", file=sys.stderr)  # noqa: T201
    return 1
