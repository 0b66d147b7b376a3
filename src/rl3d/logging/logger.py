"""Per-rank logging: rank 0 talks on the console by default, every rank can log to a file."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

_FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def current_rank() -> int:
    """This process's global rank: torch.distributed if initialised, else torchrun's RANK."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return int(os.environ.get("RANK", "0"))


def setup_logging(
    *,
    level: str = "INFO",
    rank: int | None = None,
    all_ranks: bool = False,
    log_dir: str | os.PathLike | None = None,
) -> logging.Logger:
    """Configure the `rl3d` logger tree once per process.

    The console gets rank 0's records (every rank's with `all_ranks`); with `log_dir`, each rank
    also writes `log_dir/rank{N}.log`, so a failure on a silent rank is never lost.
    """
    rank = current_rank() if rank is None else rank
    root = logging.getLogger("rl3d")
    root.setLevel(level)
    root.propagate = False
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    rank_filter = _RankFilter(rank)
    formatter = logging.Formatter(_FORMAT, datefmt="%H:%M:%S")
    if rank == 0 or all_ranks:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(formatter)
        console.addFilter(rank_filter)
        root.addHandler(console)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(Path(log_dir) / f"rank{rank}.log")
        file_handler.setFormatter(formatter)
        file_handler.addFilter(rank_filter)
        root.addHandler(file_handler)
    if not root.handlers:
        root.addHandler(logging.NullHandler())
    return root


def get_logger(name: str) -> logging.Logger:
    """A logger under the `rl3d` tree (pass `__name__`)."""
    return logging.getLogger(name if name.startswith("rl3d") else f"rl3d.{name}")
