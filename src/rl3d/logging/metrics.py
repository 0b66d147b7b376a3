"""Metrics sinks: JSONL (one object per line) and TensorBoard, behind one small protocol."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol


def _plain(value: Any) -> Any:
    """A JSON-safe scalar from a python number or a 0-dim tensor; NaN/inf become strings."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, Any], *, worker: str = "trainer") -> None: ...

    def close(self) -> None: ...


class JsonlMetricsWriter:
    """Appends `{"step", "worker", "rank", "time", **metrics}` per call, flushed at once.

    Appending (never truncating) keeps a resumed run's history in the same file.
    """

    def __init__(self, path: str | os.PathLike, *, rank: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def log(self, step: int, metrics: dict[str, Any], *, worker: str = "trainer") -> None:
        record = {"step": step, "worker": worker, "rank": self.rank, "time": time.time()}
        for key, value in metrics.items():
            if key in record:
                raise ValueError(f"metric name {key!r} collides with a reserved JSONL field")
            record[key] = _plain(value)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class TensorBoardWriter:
    """Scalars into TensorBoard event files, tagged `worker/metric`."""

    def __init__(self, log_dir: str | os.PathLike):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, Any], *, worker: str = "trainer") -> None:
        for key, value in metrics.items():
            value = _plain(value)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue  # TensorBoard scalars only; JSONL keeps the rest
            tag = key if "/" in key else f"{worker}/{key}"
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
