"""A run's process set up once at its start, the same in every kind of process: a torchrun rank,
the Ray driver, a Ray rank actor, a rollout-pool rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def threads_per_rank(nproc_per_node: int) -> int:
    """torch's CPU threads per rank: the node's cores split between its `nproc_per_node`
    ranks (`launch.nproc_per_node`; both backends, so they compute alike)."""
    return max(1, (os.cpu_count() or 1) // max(1, nproc_per_node))


def setup_process(
    log_cfg: Any, *, rank: int, log_dir: str | os.PathLike | None, num_threads: int | None
) -> None:
    """`kill -USR2 <pid>` prints every thread's stack (the first thing to look at in a hung job);
    megatron's UserWarnings stay quiet; the `rl3d` logger at the recipe's `logging` section's
    level (`log_cfg`) for world rank `rank` (with `log_dir`, also `log_dir/rank{N}.log`); and,
    unless None, torch's CPU thread count."""
    import faulthandler
    import signal
    import warnings

    import torch

    from rl3d.logging.logger import setup_logging

    faulthandler.register(signal.SIGUSR2, all_threads=True)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    log_dir = Path(log_dir) if log_dir is not None else None
    setup_logging(level=log_cfg.level, rank=rank, all_ranks=log_cfg.all_ranks, log_dir=log_dir)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
