"""Validation during training, end to end (real torchrun / Ray, the GRPO quickstart): `val/*` at
steps 0, 2 and the last; the val curve in validation.csv, metrics.csv, the PNG and the summary;
the same metrics in W&B's offline run file and MLflow's file store; and the training metrics
bit for bit those of a run without validation, on both backends (slow)."""

import csv
import importlib.util
import json
import time

import pytest
from train_helpers import GRPO, assert_same_metrics, metrics_by_step, run_train

pytestmark = pytest.mark.e2e
STEPS = ("trainer.total_steps=3", "checkpoint.save_every=0")
TRACKERS = ["tensorboard"] + [t for t in ("wandb", "mlflow") if importlib.util.find_spec(t)]
VALIDATE = (
    "trainer.val_every=2",
    "trainer.val_before_train=true",
    "trainer.val_pass_k=[1,4]",
    "trainer.val_pass_threshold=0.75",  # parity: 6 of 8 tokens right; pass@k is then not all 0
    f"logging.trackers=[{','.join(TRACKERS)}]",
)
VAL_STEPS = [0, 2, 3]  # before training, every 2nd step, the last step


def training(metrics: dict) -> dict:
    return {s: {k: v for k, v in row.items() if not k.startswith("val/")} for s, row in metrics.items() if s}


def validation(metrics: dict) -> dict:
    return {s: {k: v for k, v in row.items() if k.startswith("val/")} for s, row in metrics.items()}


@pytest.fixture(scope="module")
def val_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("val") / "run"
    proc = run_train(GRPO, run_dir, *STEPS, *VALIDATE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_validation_metrics_curve_and_trackers(val_run, monkeypatch):
    steps = metrics_by_step(val_run)
    assert sorted(steps) == [0, 1, 2, 3]
    val = {s: v for s, v in validation(steps).items() if v}
    assert sorted(val) == VAL_STEPS
    for row in val.values():
        assert 0 <= row["val/pass_at_1"] <= row["val/pass_at_4"] <= 1
        assert 0 <= row["val/score_greedy"] <= 1 and 0 <= row["val/score_sampled"] <= 1
        assert row["val/response_length_greedy"] > 0 and row["val/response_length_sampled"] > 0
    assert any(row["val/pass_at_4"] > 0 for row in val.values())
    assert "time/validation" in steps[2] and "reward/score_mean" not in steps[0]

    with open(val_run / "validation.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == VAL_STEPS
    assert [float(r["val/pass_at_4"]) for r in rows] == [val[s]["val/pass_at_4"] for s in VAL_STEPS]
    with open(val_run / "metrics.csv", newline="") as f:
        by_step = {int(r["step"]): r for r in csv.DictReader(f)}
    assert (
        by_step[1]["val/score_greedy"] == ""
        and float(by_step[2]["val/score_greedy"]) == val[2]["val/score_greedy"]
    )
    assert "validation: greedy score" in (val_run / "summary.txt").read_text()
    samples = [json.loads(line) for line in (val_run / "samples.jsonl").read_text().splitlines()]
    val_samples = [s for s in samples if s["split"] == "val"]  # the greedy answers, 4 per validation
    assert [s["step"] for s in val_samples] == [0] * 4 + [2] * 4 + [3] * 4
    assert [s["step"] for s in samples if s["split"] == "train"] == [1] * 4 + [2] * 4 + [3] * 4
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(val_run / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    tags = set(events.Tags()["tensors"])
    assert {"samples/train/text_summary", "samples/val/text_summary"} <= tags
    assert [e.step for e in events.Tensors("samples/val/text_summary")] == VAL_STEPS
    assert (val_run / "reward_curve.png").stat().st_size > 0

    if "wandb" in TRACKERS:
        from rl3d.logging.trackers import read_wandb_file

        (run_file,) = (val_run / "wandb").glob("offline-run-*/run-*.wandb")
        deadline = time.monotonic() + 60  # wandb's service may finish writing after the run exits
        while len(read_wandb_file(run_file)[1]) < len(steps) and time.monotonic() < deadline:
            time.sleep(0.2)
        config, history = read_wandb_file(run_file)
        assert config["trainer"]["val_every"] == 2 and config["rollout"]["n"] == 4
        assert [r["_step"] for r in history] == [0, 1, 2, 3]
        for row in history:
            step = row["_step"]
            assert {k: row[k] for k in val.get(step, {})} == val.get(step, {})
            if step:
                assert row["reward/score_mean"] == steps[step]["reward/score_mean"]
    if "mlflow" in TRACKERS:
        from mlflow.tracking import MlflowClient

        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only so
        client = MlflowClient((val_run / "mlruns").resolve().as_uri())
        (experiment,) = [e for e in client.search_experiments() if e.name == "quickstart_cpu_grpo"]
        (run,) = client.search_runs([experiment.experiment_id])
        history = client.get_metric_history(run.info.run_id, "val/score_greedy")
        assert [(m.step, m.value) for m in history] == [(s, val[s]["val/score_greedy"]) for s in VAL_STEPS]
        assert run.data.params["trainer.val_pass_k"] == "[1, 4]" and run.info.status == "FINISHED"


@pytest.mark.slow
def test_validation_leaves_training_unchanged_on_both_backends(val_run, tmp_path):
    pytest.importorskip("ray")
    plain = tmp_path / "plain"
    proc = run_train(GRPO, plain, *STEPS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    on_ray = tmp_path / "ray"
    proc = run_train(GRPO, on_ray, *STEPS, *VALIDATE[:-1], "launch.backend=ray")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = metrics_by_step(plain)
    for run_dir in (val_run, on_ray):
        assert_same_metrics(reference, training(metrics_by_step(run_dir)), exact=True)
    assert validation(metrics_by_step(on_ray)) == validation(metrics_by_step(val_run))  # same seeds
    assert json.loads((on_ray / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0
