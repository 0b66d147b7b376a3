"""Console progress for long work: step i/N, rate, ETA, and a few headline metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class Progress:
    """Tracks steps done and reports `[#####.....] 5/10 | 0.8 step/s | ETA 00:06 | reward 0.41`.

    `emit` receives each line (defaults to the rl3d logger at INFO). `start` lets a resumed run
    count its ETA only over the steps it still has to run.
    """

    def __init__(
        self,
        total: int,
        *,
        start: int = 0,
        width: int = 20,
        emit: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if total < 1:
            raise ValueError(f"progress total must be >= 1, got {total}")
        self.total, self.done, self.width = total, start, width
        self._start_step, self._clock = start, clock
        self._t0 = clock()
        self._emit = emit or logger.info

    @property
    def rate(self) -> float:
        """Steps per second since start (0 before the first step)."""
        elapsed = self._clock() - self._t0
        steps = self.done - self._start_step
        return steps / elapsed if elapsed > 0 and steps > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        rate = self.rate
        return (self.total - self.done) / rate if rate > 0 else None

    def line(self, metrics: dict[str, float] | None = None) -> str:
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        eta = self.eta_seconds
        parts = [
            f"[{bar}] {self.done}/{self.total}",
            f"{self.rate:.2f} step/s",
            f"ETA {format_duration(eta) if eta is not None else '--:--'}",
        ]
        parts += [f"{k} {v:.4g}" for k, v in (metrics or {}).items()]
        return " | ".join(parts)

    def update(self, steps: int = 1, metrics: dict[str, float] | None = None) -> str:
        self.done = min(self.total, self.done + steps)
        text = self.line(metrics)
        self._emit(text)
        return text
