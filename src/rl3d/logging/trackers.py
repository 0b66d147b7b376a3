"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases, MLflow.

A run writes to the trackers `logging.trackers` names (`rl3d.config.tracking` checks they are
installed); each is a metrics sink like `JsonlMetricsWriter`, made on the writing process only
(spmd rank 0, the Ray driver). All of them keep their files under the run directory:

- tensorboard: `run_dir/tensorboard/` event files.
- wandb: offline unless `WANDB_MODE` says otherwise (`WANDB_MODE=online` after `wandb login`
  uploads as it goes); the run is `run_dir/wandb/offline-run-*/run-*.wandb` (upload it later
  with `wandb sync`). The resolved config is the run's config.
- mlflow: the local file store `file:run_dir/mlruns` unless `MLFLOW_TRACKING_URI` names another
  (a server, a database). The experiment is `trainer.experiment`, the resolved config is
  logged as params (flattened, `actor.parallel.tp`) and as the artifact `config.json`. MLflow
  3 keeps its file store behind `MLFLOW_ALLOW_FILE_STORE=true`, which this sets for the run.

A resumed run starts a new W&B / MLflow run (its metrics continue from the resumed step).
"""

from __future__ import annotations

import atexit
import os
import re
import time
from pathlib import Path
from typing import Any

from rl3d.logging.metrics import TensorBoardWriter, _plain


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        value = _plain(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"actor": {"parallel": {"tp": 2}}}` -> `{"actor.parallel.tp": "2"}`."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out |= flatten(value, f"{name}.")
        else:
            out[name] = str(value)
    return out


class WandbWriter:
    """A W&B run (offline by default) under `run_dir/wandb`."""

    def __init__(self, run_dir: Path, *, project: str, name: str, config: dict[str, Any]):
        import wandb

        self._run = wandb.init(
            project=project,
            name=name,
            dir=str(run_dir),
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
            reinit="create_new",  # its own run, whatever else this process has open
        )
        self._closed = False
        atexit.register(self.close)  # the trainer does not close its sinks; the process's end does

    @property
    def directory(self) -> Path:
        return Path(self._run.dir).parent  # .../wandb/offline-run-*/files -> the run's directory

    def log(self, step: int, metrics: dict[str, Any], *, worker: str = "trainer") -> None:
        values = _scalars(metrics)
        if values:
            self._run.log(values, step=step)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._run.finish()


_MLFLOW_KEY = re.compile(r"[^\w\-./ ]")  # MLflow names: alphanumerics, _ - . / and space


class MlflowWriter:
    """An MLflow run in a local file store under `run_dir/mlruns` (or `MLFLOW_TRACKING_URI`)."""

    def __init__(self, run_dir: Path, *, experiment: str, name: str, config: dict[str, Any]):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        self.client = client = MlflowClient(self.tracking_uri)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(experiment)
        self.run_id = client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(_MLFLOW_KEY.sub("_", k), v[:6000]) for k, v in flatten(config).items()]
        for lo in range(0, len(params), 100):  # log_batch takes at most 100 params
            client.log_batch(self.run_id, params=params[lo : lo + 100])
        client.log_dict(self.run_id, config, "config.json")
        self._closed = False
        atexit.register(self.close)

    def log(self, step: int, metrics: dict[str, Any], *, worker: str = "trainer") -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_MLFLOW_KEY.sub("_", k), v, now, step) for k, v in _scalars(metrics).items()]
        for lo in range(0, len(batch), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=batch[lo : lo + 1000])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.set_terminated(self.run_id)


def make_trackers(names: list[str], run_dir: Path, *, experiment: str, config: dict[str, Any]) -> list[Any]:
    """The sinks of `names` (see the module docstring); the run is named after `run_dir`."""
    run_dir = Path(run_dir)
    sinks: list[Any] = []
    for name in names:
        if name == "tensorboard":
            sinks.append(TensorBoardWriter(run_dir / "tensorboard"))
        elif name == "wandb":
            sinks.append(WandbWriter(run_dir, project=experiment, name=run_dir.name, config=config))
        elif name == "mlflow":
            sinks.append(MlflowWriter(run_dir, experiment=experiment, name=run_dir.name, config=config))
        else:
            raise ValueError(f"unknown tracker {name!r}")  # rl3d.config.tracking rejects it first
    return sinks


_WANDB_BLOCK, _WANDB_HEADER = 32768, 7  # the .wandb file: LevelDB-log blocks of wandb records


def read_wandb_file(path: str | os.PathLike) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(config, history rows) of an offline run file `run-*.wandb`, each record decoded with
    wandb's own protobuf `Record` (wandb ships no reader of its own any more). The file is a
    LevelDB log: a 7-byte header (":W&B", magic, version), then chunks (checksum, length, kind:
    1 whole, 2 first, 3 middle, 4 last) that never straddle a 32 KiB block.

    wandb's service writes the file on its own schedule: it can still be growing for a moment
    after `run.finish()` returns (the records read so far are returned)."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    pos, pending, config, history = _WANDB_HEADER, b"", {}, []
    while pos + _WANDB_HEADER <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left < _WANDB_HEADER:  # the block's tail is padding
            pos += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + _WANDB_HEADER])
        if kind == 0:  # zero padding at the end of a block
            pos += left
            continue
        if pos + _WANDB_HEADER + length > len(data):  # a chunk still being written
            break
        pending += data[pos + _WANDB_HEADER : pos + _WANDB_HEADER + length]
        pos += _WANDB_HEADER + length
        if kind in (2, 3):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        kind_name = record.WhichOneof("record_type")
        if kind_name in ("run", "config"):  # the config comes with the run, updates after it
            update = record.run.config.update if kind_name == "run" else record.config.update
            config |= {item.key: json.loads(item.value_json) for item in update if item.key != "_wandb"}
        elif kind_name == "history":
            items = record.history.item
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
            history.append(row | {"_step": record.history.step.num})
    return config, history
