"""Logging: per-rank console logger, JSONL metrics, TensorBoard, console progress.

Named `rl3d.logging`; inside this package the standard library module is imported as
`logging` via absolute imports, which is unaffected by this package's name.
"""

from rl3d.logging.logger import get_logger, setup_logging
from rl3d.logging.metrics import JsonlMetricsWriter, MetricsSink, TensorBoardWriter, drop_rows_after
from rl3d.logging.progress import Progress

__all__ = [
    "JsonlMetricsWriter",
    "MetricsSink",
    "Progress",
    "TensorBoardWriter",
    "drop_rows_after",
    "get_logger",
    "setup_logging",
]
