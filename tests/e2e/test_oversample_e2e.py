"""Over-sampling on a separate rollout pool (`rollout.async.oversample`), end to end on the async
quickstart (1 training rank, 1 rollout rank, max_staleness 1, the tiny random model).

Response lengths are skewed: 16 of the 256 token ids stop a response, so a response stops after
~16 tokens on average and 1 in 20 runs to the 48-token budget. With 1.5x over-sampling the rank
keeps 12 prompt groups in flight for the 8 a step trains on, and the step's call ends once 8 are
complete; the stragglers are carried to the next step and trained there with the tokens' own
policy versions (staleness up to `rollout.async.drop_staleness`, by default max_staleness + 1 = 2).
With `drop_staleness` 1 the carried groups (their first tokens two versions old by then) are
dropped instead, and no trained token is more than one version old.
"""

import subprocess

import pytest
from train_helpers import ROOT, metrics_by_step, train_command, train_env

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

ASYNC = ROOT / "recipes/quickstart_cpu_grpo_async.yaml"
STOPS = "rollout.stop_token_ids=[" + ",".join(str(t) for t in range(200, 216)) + "]"
SKEWED = ("checkpoint.save_every=0", "rollout.max_new_tokens=48", STOPS, "rollout.async.oversample=1.5")


def run(run_dir, *overrides, backend: str = "spmd") -> subprocess.CompletedProcess:
    env = train_env()
    if backend == "ray":
        pytest.importorskip("ray")
        env.pop("RAY_ADDRESS", None)  # a local Ray of the run's own
        overrides = (*overrides, "launch.backend=ray")
    command = train_command(ASYNC, run_dir, "trainer.total_steps=6", *SKEWED, *overrides)
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def series(metrics: dict, key: str) -> list[float]:
    return [metrics[s][key] for s in sorted(metrics)]


@pytest.mark.parametrize("backend", ["spmd", pytest.param("ray", marks=pytest.mark.slow)])
def test_stragglers_are_carried_and_trained_with_their_versions(tmp_path, backend):
    proc = run(tmp_path / "run", backend=backend)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = metrics_by_step(tmp_path / "run")
    assert sorted(metrics) == list(range(1, 7))
    assert series(metrics, "rollout/in_flight") == [12.0] * 6  # 8 prompts a step, 1.5x
    assert series(metrics, "rollout/oversampled") == [4.0] * 6
    carried = series(metrics, "rollout/carried")
    assert all(c > 0 for c in carried)  # every step ended before its slowest groups
    trained = series(metrics, "rollout/carried_trained")
    assert trained[0] == 0 and sum(trained[1:]) > 0  # ...which later steps trained on
    assert sum(series(metrics, "rollout/aborted_samples")) > 0
    # a group carried over two steps may go past drop_staleness (2) and be dropped, which
    # depends on how far the pool ran ahead: never is a trained token over the bound
    stale = series(metrics, "async/staleness_max")
    assert max(stale) <= 2.0  # carried tokens may be one version older than max_staleness allows
    assert max(series(metrics, "response/length_max")) <= 48  # a continued sample keeps its budget


@pytest.mark.slow
def test_samples_past_drop_staleness_are_dropped(tmp_path):
    proc = run(tmp_path / "run", "rollout.async.drop_staleness=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = metrics_by_step(tmp_path / "run")
    assert sorted(metrics) == list(range(1, 7))
    assert sum(series(metrics, "rollout/stale_dropped")) > 0
    assert max(series(metrics, "async/staleness_max")) <= 1.0
