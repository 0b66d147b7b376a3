"""SIGKILL between checkpoints, restart: the following steps equal an uninterrupted run."""

import os
import signal
import subprocess
import time

import pytest
from train_helpers import GRPO, metrics_by_step, run_train, train_command, train_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = ["trainer.total_steps=6", "checkpoint.save_every=3"]
COMPARED = (
    "reward/score_mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "kl/actor_ref_k1",
    "response/length_mean",
)


def test_killed_run_resumes_to_the_same_metrics(tmp_path):
    straight = tmp_path / "straight"
    assert run_train(GRPO, straight, *STEPS).returncode == 0

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        train_command(GRPO, killed, *STEPS),
        env=train_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # kill after checkpoint 3 and step 4, before checkpoint 6
        done = (killed / "checkpoints/step_00000003/meta.json").exists()
        if done and (killed / "metrics.jsonl").exists() and 4 in metrics_by_step(killed):
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 6 not in metrics_by_step(killed), "the run finished before it could be killed"

    resumed = run_train(GRPO, killed, *STEPS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    a, b = metrics_by_step(straight), metrics_by_step(killed)
    for step in (4, 5, 6):
        for key in COMPARED:
            assert b[step][key] == a[step][key], (step, key, a[step][key], b[step][key])
