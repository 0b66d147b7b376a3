"""A role added with a worker class and one table entry (`roles.toy` in the recipe) runs in the
loop on both backends, and leaves the rest of the run's metrics bit for bit as they were."""

import pytest
from train_helpers import GRPO, TIMING, TIMING_KEYS, metrics_by_step, run_train

pytestmark = pytest.mark.e2e

STEPS = ("trainer.total_steps=2", "checkpoint.save_every=0")
TOY = (
    "roles.toy.worker=toy_role:ResponseLengthWorker",
    "roles.toy.compute=compute_length",
    "roles.toy.update=update_toy",
    "roles.toy.options.scale=2.0",
)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    proc = run_train(GRPO, run_dir, *STEPS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics_by_step(run_dir)


@pytest.mark.parametrize("backend", ["spmd", pytest.param("ray", marks=pytest.mark.slow)])
def test_toy_role_runs_in_the_loop(plain_run, backend, tmp_path):
    if backend == "ray":
        pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    proc = run_train(GRPO, run_dir, *STEPS, *TOY, f"launch.backend={backend}", "reward.num_workers=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    toy = metrics_by_step(run_dir)
    for step, row in toy.items():
        assert row["toy/updates"] == step  # one update per step, on a worker that lives across steps
        assert row["toy/saw_advantages"] == 1.0
        assert row["toy/rows"] == 32.0  # its DP share (dp=1: all 8 prompts x 4 responses)
        assert row["toy/length_mean"] == 2.0 * row["response/length_mean"]  # its batch field
        assert row["time/toy"] > 0 and row["time/update_toy"] > 0  # its stages are timed
        plain = plain_run[step]
        same = {k for k in plain if not k.startswith(TIMING) and k not in TIMING_KEYS}
        assert {k: row[k] for k in same} == {k: plain[k] for k in same}
