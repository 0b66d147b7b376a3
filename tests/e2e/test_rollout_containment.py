"""Failure containment on a separate rollout pool (`rollout.timeout_s`), end to end on the
async quickstart (1 training rank, 1 rollout rank, max_staleness 1; spmd, and Ray where marked).

Faults are injected through the test-only variable `RL3D_TEST_ROLLOUT_FAULTS`
(`rl3d.workers.rollout_guard`), read by the rollout rank:
- a prompt whose generation hangs past `rollout.timeout_s` at step 2, on every attempt: it is
  re-issued once, then dropped; the step trains on the 7 of 8 prompts that arrived (over
  `rollout.min_fraction`) and the run finishes;
- the same with `rollout.min_fraction` 1: the run stops with an error naming the key;
- the engine raises once at step 3 of 6: it is rebuilt from the last weights received, the
  prompt re-issued on it, and the run finishes with the restart counted;
- an engine that raises at every call past `rollout.max_restarts`: the run stops naming the
  pool, the rank and the cause.
"""

import subprocess

import pytest
from train_helpers import ROOT, metrics_by_step, train_command, train_env

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

ASYNC = ROOT / "recipes/quickstart_cpu_grpo_async.yaml"
FAULTS = "RL3D_TEST_ROLLOUT_FAULTS"
CONTAINED = ("checkpoint.save_every=0", "rollout.timeout_s=3")


def run(run_dir, *overrides, backend: str = "spmd", faults: str) -> subprocess.CompletedProcess:
    env = train_env() | {FAULTS: faults}
    if backend == "ray":
        pytest.importorskip("ray")
        env.pop("RAY_ADDRESS", None)  # a local Ray of the run's own
        overrides = (*overrides, "launch.backend=ray")
    command = train_command(ASYNC, run_dir, *overrides, *CONTAINED)
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def counts(metrics: dict, step: int) -> tuple[float, float, float]:
    m = metrics[step]
    return m["rollout/dropped"], m["rollout/reissued"], m["rollout/restarts"]


BACKENDS = pytest.mark.parametrize("backend", ["spmd", pytest.param("ray", marks=pytest.mark.slow)])


@BACKENDS
def test_a_hung_sample_is_reissued_then_dropped_and_the_run_finishes(tmp_path, backend):
    # prompt 1 of step 2 sleeps 4.5 s inside the engine on every try (rollout.timeout_s is 3)
    proc = run(
        tmp_path / "run",
        "trainer.total_steps=4",
        "rollout.min_fraction=0.8",
        backend=backend,
        faults="hang:2:1:4.5",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = metrics_by_step(tmp_path / "run")
    assert sorted(metrics) == [1, 2, 3, 4]
    assert counts(metrics, 2) == (1.0, 1.0, 0.0)  # re-issued once, then dropped
    assert all(counts(metrics, s) == (0.0, 0.0, 0.0) for s in (1, 3, 4))
    assert metrics[2]["generate/padding_rows"] > 0  # 7 prompts x 4 samples, padded to deal evenly


def test_too_few_samples_stop_the_run_naming_min_fraction(tmp_path):
    proc = run(tmp_path / "run", "trainer.total_steps=4", "rollout.reissue=false", faults="hang:2:1:4.5")
    assert proc.returncode != 0
    assert "7 of 8 prompts' samples arrived" in proc.stderr and "rollout.min_fraction = 1.0" in proc.stderr


@BACKENDS
def test_an_engine_that_raises_at_step_3_is_rebuilt_and_the_run_finishes(tmp_path, backend):
    proc = run(
        tmp_path / "run", "trainer.total_steps=6", "rollout.max_restarts=1", backend=backend, faults="raise:3"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = metrics_by_step(tmp_path / "run")
    assert sorted(metrics) == list(range(1, 7))
    assert counts(metrics, 3) == (0.0, 1.0, 1.0)  # rebuilt, the prompt re-issued on the new engine
    assert all(counts(metrics, s) == (0.0, 0.0, 0.0) for s in (1, 2, 4, 5, 6))


def test_engine_failures_past_max_restarts_stop_the_run_naming_pool_rank_and_cause(tmp_path):
    proc = run(tmp_path / "run", "trainer.total_steps=4", "rollout.max_restarts=1", faults="raise:2;raise:3")
    assert proc.returncode != 0
    assert "rollout pool rank 0" in proc.stderr and "rollout.max_restarts = 1" in proc.stderr
    assert "injected engine fault" in proc.stderr
