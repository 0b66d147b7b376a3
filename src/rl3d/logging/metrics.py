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


def drop_rows_after(run_dir: str | os.PathLike, step: int) -> int:
    """Keep only rows up to `step` in ``metrics.jsonl``, ``samples.jsonl``, ``metrics.csv`` and
    ``validation.csv``.

    A resumed run continues from its checkpoint's step; rows a killed run logged after it would
    otherwise sit next to the new run's rows for the same steps. Each file is rewritten to a
    temporary name and renamed over the old one. Returns the number of rows dropped.
    """
    run_dir = Path(run_dir)
    dropped = 0
    for jsonl in (run_dir / "metrics.jsonl", run_dir / "samples.jsonl"):
        if jsonl.is_file():
            lines = jsonl.read_text(encoding="utf-8").splitlines(keepends=True)
            kept = [line for line in lines if line.strip() and _step_of_json(line) <= step]
            dropped += len([line for line in lines if line.strip()]) - len(kept)
            _replace_text(jsonl, "".join(kept))
    for csv_path in (run_dir / "metrics.csv", run_dir / "validation.csv"):  # validation's: step 0 on
        dropped += _drop_csv_rows(csv_path, step)
    return dropped


def _drop_csv_rows(csv_path: Path, step: int) -> int:
    dropped = 0
    if csv_path.is_file():
        import csv
        import io

        rows = list(csv.reader(io.StringIO(csv_path.read_text(encoding="utf-8"), newline="")))
        if rows and "step" in rows[0]:
            col = rows[0].index("step")
            kept_rows = [rows[0]] + [r for r in rows[1:] if r and int(float(r[col])) <= step]
            dropped += len(rows) - len(kept_rows)
            out = io.StringIO(newline="")
            csv.writer(out).writerows(kept_rows)
            _replace_text(csv_path, out.getvalue())
    return dropped


def _step_of_json(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 2**63  # a torn last line (the run was killed mid-write) is dropped too


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


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

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Markdown in TensorBoard's Text tab (`rl3d.logging.samples`)."""
        self._writer.add_text(tag, text, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
