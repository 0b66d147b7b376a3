"""Experiment trackers: a W&B offline run and an MLflow file store are written and read back
by the trackers' own libraries; a tracker whose package is missing fails at config load."""

import sys
import time
from pathlib import Path

import pytest

from rl3d.config import ConfigError, load_config
from rl3d.config.tracking import trackers_of
from rl3d.logging.trackers import flatten, make_trackers

ROOT = Path(__file__).resolve().parents[3]
GRPO = ROOT / "recipes/quickstart_cpu_grpo.yaml"
CONFIG = {"trainer": {"seed": 3, "val_pass_k": [1, 4]}, "model": {"name": "tiny-llama"}, "description": ""}
ROWS = {1: {"reward/score_mean": 0.25, "val/pass_at_1": 0.5, "note": "text"}, 2: {"reward/score_mean": 0.75}}


def _log(sink):
    for step, metrics in ROWS.items():
        sink.log(step, metrics)
    sink.close()


def test_wandb_offline_run_is_written_and_read_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from rl3d.logging.trackers import WandbWriter, read_wandb_file

    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    writer = WandbWriter(tmp_path, project="rl3d-test", name="run", config=CONFIG)
    _log(writer)
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1 and files[0].parent == writer.directory
    deadline = time.monotonic() + 60  # wandb's service may still be writing after finish()
    while len(read_wandb_file(files[0])[1]) < len(ROWS) and time.monotonic() < deadline:
        time.sleep(0.2)
    config, history = read_wandb_file(files[0])
    assert config["trainer"] == {"seed": 3, "val_pass_k": [1, 4]} and config["model"]["name"] == "tiny-llama"
    assert [(row["_step"], row["reward/score_mean"]) for row in history] == [(1, 0.25), (2, 0.75)]
    assert history[0]["val/pass_at_1"] == 0.5 and "note" not in history[0]  # scalars only


def test_mlflow_file_store_is_written_and_read_back(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from rl3d.logging.trackers import MlflowWriter

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the writer sets it for a run
    writer = MlflowWriter(tmp_path, experiment="rl3d-test", name="run", config=CONFIG)
    _log(writer)
    assert writer.tracking_uri == (tmp_path / "mlruns").resolve().as_uri()
    client = MlflowClient(writer.tracking_uri)  # a new client reads the store from disk
    history = client.get_metric_history(writer.run_id, "reward/score_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    assert [m.value for m in client.get_metric_history(writer.run_id, "val/pass_at_1")] == [0.5]
    run = client.get_run(writer.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["trainer.seed"] == "3" and run.data.params["trainer.val_pass_k"] == "[1, 4]"
    assert client.get_experiment(run.info.experiment_id).name == "rl3d-test"
    assert [a.path for a in client.list_artifacts(writer.run_id)] == ["config.json"]


def test_make_trackers_builds_each_named_sink(tmp_path):
    from rl3d.logging import TensorBoardWriter

    sinks = make_trackers(["tensorboard"], tmp_path, experiment="e", config=CONFIG)
    assert [type(s) for s in sinks] == [TensorBoardWriter]
    _log(sinks[0])
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    with pytest.raises(ValueError, match="unknown tracker"):
        make_trackers(["nope"], tmp_path, experiment="e", config=CONFIG)


def test_flatten_names_params_by_dotted_key():
    assert flatten({"a": {"b": {"c": 1}, "d": [1, 2]}, "e": {}, "f": None}) == {
        "a.b.c": "1",
        "a.d": "[1, 2]",
        "e": "{}",
        "f": "None",
    }


def test_default_trackers_keep_tensorboard_behaviour():
    assert trackers_of(load_config(GRPO).config.logging) == ["tensorboard"]
    assert trackers_of(load_config(GRPO, ["logging.tensorboard=false"]).config.logging) == []
    listed = load_config(GRPO, ["logging.trackers=[tensorboard]"]).config.logging
    assert trackers_of(listed) == ["tensorboard"]


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_missing_tracker_package_fails_at_config_load(tracker, monkeypatch):
    monkeypatch.setitem(sys.modules, tracker, None)  # `import wandb` now raises ImportError
    with pytest.raises(ConfigError, match=r"not installed: pip install 'rl3d\[track\]'") as err:
        load_config(GRPO, [f"logging.trackers=[tensorboard,{tracker}]"])
    assert err.value.key == "logging.trackers[1]" and tracker in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "text"),
    [
        (["logging.trackers=[wandbb]"], "unknown tracker 'wandbb' \\(did you mean 'wandb'\\?\\)"),
        (["logging.trackers=[tensorboard]", "logging.tensorboard=false"], "logging.tensorboard is false"),
    ],
)
def test_bad_trackers_fail_at_config_load(overrides, text):
    with pytest.raises(ConfigError, match=text) as err:
        load_config(GRPO, overrides)
    assert err.value.key == "logging.trackers[0]"
