"""The launcher's side of a torchrun job (`rl3d train`, the reward-model job): the command that
starts one node's ranks, the environment they start in, and which rank's failure to name when
the job fails."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rl3d.utils.imports import LAUNCH_DIR_ENV

# glibc's malloc for the ranks (read when a process starts, so set here, before it does): every
# allocation under 4 GiB from the heap, which is kept (not returned to the system) below 16 GiB
# free at its top. glibc's default serves a block over 32 MiB with its own mmap and unmaps it on
# free, so each step's logits, activations and gradients fault their pages in again
# (docs/real_model_step.md: page faults and step time with and without). The cost: a rank's
# resident memory stays at its peak. A value the user set wins.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(16 << 30)}


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of the processes a launcher starts: the same code whatever the working
    directory. PYTHONSAFEPATH keeps the interpreter from putting that directory ahead of the
    installed packages (`python -m` would); user code named by import path (`reward.fn`,
    `trainer.hooks`) is still found there, after them (`rl3d.utils.imports`). glibc's allocator
    keeps large blocks (`ALLOCATOR_ENV`) unless the user's environment sets those keys."""
    return {**ALLOCATOR_ENV, **os.environ, "PYTHONSAFEPATH": "1", LAUNCH_DIR_ENV: os.getcwd(), **extra}


def torchrun_command(
    recipe: str, overrides: list[str], nproc_per_node: int, *, module: str = "rl3d.train"
) -> list[str]:
    """One node's ranks under rl3d's torchrun wrapper, each running `module` on the recipe."""
    return [
        sys.executable, "-m", "rl3d.launch.torchrun", "--standalone",
        f"--nproc-per-node={nproc_per_node}", "-m", module, recipe, *overrides,
    ]  # fmt: skip


RANK_EXITS = "rank_exits.json"  # in the run's logs/: torchrun's exit code of each failed rank


def _killed_rank(log_dir: Path, pools: list) -> str | None:
    import json
    import signal

    from rl3d.config.pools import pool_of

    path = log_dir / RANK_EXITS
    if not path.exists():
        return None
    exits = {int(r): c for r, c in json.loads(path.read_text()).items()}
    killed = sorted(r for r, c in exits.items() if c is not None and c < 0 and -c != signal.SIGTERM)
    if not killed:
        return None
    rank = killed[0]
    pool, name = pool_of(pools, rank), signal.Signals(-exits[rank]).name
    where = f"{pool.name} pool, its rank {rank - pool.offset}"
    return f"world rank {rank} ({where}) was killed by {name} (see {log_dir})"


def first_rank_failure(log_dir: Path, code: int, pools: list | None = None) -> str:
    """The rank that died by a signal (other than torchrun's SIGTERM: it left no line of its own,
    and the others' errors follow from it), named with its pool; else the line of the rank that
    failed first (by time: the others usually fail in a collective after it); else what
    torchrun's exit status says."""
    killed = _killed_rank(log_dir, pools) if pools else None
    if killed:
        return killed
    failures = sorted(log_dir.glob("failed_rank*.txt"), key=lambda p: p.stat().st_mtime)
    if failures:
        return failures[0].read_text().strip()
    return f"torchrun exited with status {code} (a rank died without a Python error; see {log_dir})"
