"""`launch.backend=ray` end to end: the GRPO quickstart gives the spmd backend's metrics step
for step, reward fan-out changes nothing, and a killed rank actor stops the driver quickly
with an error naming the role and the rank."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import GRPO, assert_same_metrics, metrics_by_step, train_command, train_env

pytest.importorskip("ray")
pytestmark = pytest.mark.e2e

STEPS = ("trainer.total_steps=3", "checkpoint.save_every=0")


def ray_env(extra_path: Path | None = None) -> dict[str, str]:
    env = train_env()
    env.pop("RAY_ADDRESS", None)  # a local Ray of the run's own, whatever else runs here
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env["PYTHONPATH"]])
    return env


def run_timed(run_dir: Path, *overrides: str, env=None, timeout: float = 600):
    """Run `rl3d train`; (process, seconds from start to the first step's metrics line)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        train_command(GRPO, run_dir, *overrides),
        env=env or ray_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = None
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None and time.monotonic() - start < timeout:
        if first is None and metrics.exists() and metrics.read_text().strip():
            first = time.monotonic() - start
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), first, time.monotonic() - start


@pytest.fixture(scope="module")
def spmd_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("spmd") / "run"
    proc, first, _ = run_timed(run_dir, *STEPS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, first


@pytest.mark.slow
@pytest.mark.parametrize("reward_workers", [0, 2], ids=["reward_in_driver", "reward_fan_out"])
def test_ray_backend_matches_spmd_step_for_step(spmd_run, reward_workers, tmp_path):
    spmd_dir, spmd_first = spmd_run
    run_dir = tmp_path / "run"
    proc, ray_first, _ = run_timed(
        run_dir, *STEPS, "launch.backend=ray", f"reward.num_workers={reward_workers}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Ray's logs: " in proc.stderr  # the session directory is printed at start
    assert sorted(metrics_by_step(run_dir)) == [1, 2, 3]
    assert_same_metrics(metrics_by_step(spmd_dir), metrics_by_step(run_dir))
    print(f"seconds to first step: spmd {spmd_first:.1f}, ray {ray_first:.1f}")  # noqa: T201
    assert (run_dir / "summary.txt").exists() and (run_dir / "logs/rank1.log").exists()


KILL_HOOK = """
def kill_rank1(step, batch, metrics):
    if step == 2:
        import ray

        ray.kill(ray.get_actor("actor/rank1"), no_restart=True)
"""


def test_killed_rank_actor_stops_the_driver_naming_role_and_rank(tmp_path):
    (tmp_path / "ray_kill_hook.py").write_text(KILL_HOOK)
    env = ray_env(tmp_path)
    run_dir = tmp_path / "run"
    proc, _, seconds = run_timed(
        run_dir,
        "trainer.total_steps=6",
        "checkpoint.save_every=0",
        "launch.backend=ray",
        "trainer.hooks.on_step_end=ray_kill_hook:kill_rank1",
        env=env,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the node the actor ran on is named too (hostname and IP, recorded at actor start)
    named = r"actor worker rank 1 on node \S+ \(\S+\) died during generate_sequences"
    assert re.search(named, proc.stderr), proc.stderr[-3000:]
    assert sorted(metrics_by_step(run_dir)) == [1, 2]
    assert seconds < 120, seconds


STOP_HOOK = """
def fail_at_5(step, batch, metrics):
    if step == 5:
        raise RuntimeError("stopped by the test")
"""


@pytest.mark.slow
def test_ray_checkpoints_resume_to_the_spmd_run(tmp_path):
    """Ray's driver-written checkpoints (every rank actor writing its files at once) resume to
    the metrics of an uninterrupted spmd run."""
    (tmp_path / "stop_hook.py").write_text(STOP_HOOK)
    env = ray_env(tmp_path)
    steps = ("trainer.total_steps=6", "checkpoint.save_every=3")
    straight, resumed = tmp_path / "spmd", tmp_path / "ray"
    proc, *_ = run_timed(straight, *steps, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, *_ = run_timed(
        resumed, *steps, "launch.backend=ray", "trainer.hooks.on_step_end=stop_hook:fail_at_5", env=env
    )
    assert proc.returncode == 1 and "stopped by the test" in proc.stderr, proc.stderr[-3000:]
    assert (resumed / "checkpoints/step_00000003/rng_actor_rank1.pt").exists()
    proc, *_ = run_timed(resumed, *steps, "launch.backend=ray", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "(step 3)" in proc.stderr
    a, b = metrics_by_step(straight), metrics_by_step(resumed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        for key in ("reward/score_mean", "actor/pg_loss", "actor/grad_norm", "kl/actor_ref_k1"):
            assert b[step][key] == a[step][key], (step, key)


def test_dry_run_names_the_ray_driver(tmp_path):
    proc = subprocess.run(
        [*train_command(GRPO, tmp_path / "run", "launch.backend=ray"), "--dry-run"],
        capture_output=True,
        text=True,
        env=ray_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Ray driver in this process on a local Ray instance: 2 rank actor(s)" in proc.stdout
    assert not (tmp_path / "run").exists()


if __name__ == "__main__":  # seconds to first step, spmd vs ray: python tests/e2e/test_ray_backend.py [N]
    import tempfile

    rows = []
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):
        for backend in ("spmd", "ray"):
            with tempfile.TemporaryDirectory() as tmp:
                proc, first, total = run_timed(Path(tmp) / "run", *STEPS, f"launch.backend={backend}")
                rows.append(
                    {"backend": backend, "rc": proc.returncode, "first_step_s": first, "total_s": total}
                )
                print(json.dumps(rows[-1]))  # noqa: T201
