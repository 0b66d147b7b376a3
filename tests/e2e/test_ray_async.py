"""A separate rollout pool under the Ray backend (`launch.backend=ray`, `rollout.placement:
separate`): the rollout pool is its own placement group of rank actors, the driver runs
`AsyncTrainer`, weights go over the same weight bridge as under spmd.

- max_staleness 0 gives the spmd backend's separate run bit for bit (test_ray_async_parity.py);
- max_staleness 1: no token's policy version is ever over the bound, the pool runs ahead, the
  async/* and reshard/* metrics are logged with the plan's bytes;
- the rollout rank actor killed mid-step ends the run at once, naming the pool and the rank.
"""

import os
import re
import subprocess
import time

import pytest
from test_async_training import check_staleness_within_one
from train_helpers import ROOT, metrics_by_step, train_command, train_env

pytest.importorskip("ray")
pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

ASYNC = ROOT / "recipes/quickstart_cpu_grpo_async.yaml"
RAY = "launch.backend=ray"

VERSION_HOOK = """
import json, os

def record(step, batch, metrics):
    v = batch["policy_version"]
    mask = batch["response_mask"].bool()
    mixed = sum(int(len(set(row[m].tolist())) > 1) for row, m in zip(v, mask))
    with open(os.environ["RL3D_TEST_VERSIONS"], "a") as f:
        f.write(json.dumps({"step": step, "min": int(v[mask].min()), "max": int(v[mask].max()),
                            "mixed_rows": mixed}) + "\\n")
"""

KILL_HOOK = """
import os, time

def kill_rollout_rank(step, batch, metrics):
    if step == 3:  # the trainer has step 3's samples; the pool is generating step 4's
        import ray

        ray.kill(ray.get_actor("rollout/rank0"), no_restart=True)
        with open(os.environ["RL3D_TEST_KILLED_AT"], "w") as f:
            f.write(str(time.time()))
"""


def env_with(tmp_path, **extra) -> dict[str, str]:
    env = train_env()
    env.pop("RAY_ADDRESS", None)  # a local Ray of the run's own
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    return env | extra


def train(run_dir, *overrides, env, timeout=300) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(
        train_command(ASYNC, run_dir, *overrides), capture_output=True, text=True, env=env, timeout=timeout
    )
    return proc, time.monotonic() - start


def test_ray_staleness_never_exceeds_the_bound(tmp_path):
    (tmp_path / "version_hook.py").write_text(VERSION_HOOK)
    versions = tmp_path / "versions.jsonl"
    env = env_with(tmp_path, RL3D_TEST_VERSIONS=str(versions))
    proc, _ = train(
        tmp_path / "run",
        "trainer.total_steps=8",
        "checkpoint.save_every=0",
        "trainer.hooks.on_rollout_end=version_hook:record",
        "rollout.max_new_tokens=12",
        RAY,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = check_staleness_within_one(metrics_by_step(tmp_path / "run"), versions)
    print("rows with tokens of two versions (partial rollouts):", [r["mixed_rows"] for r in rows])  # noqa: T201


def test_killed_rollout_rank_actor_ends_the_run_naming_pool_and_rank(tmp_path):
    (tmp_path / "ray_kill_rollout.py").write_text(KILL_HOOK)
    killed_at = tmp_path / "killed_at"
    proc, _ = train(
        tmp_path / "run",
        "trainer.total_steps=8",
        "checkpoint.save_every=0",
        "rollout.async.timeout_s=60",
        "trainer.hooks.on_rollout_end=ray_kill_rollout:kill_rollout_rank",
        RAY,
        env=env_with(tmp_path, RL3D_TEST_KILLED_AT=str(killed_at)),
        timeout=180,
    )
    took = time.time() - float(killed_at.read_text())
    assert proc.returncode == 1, proc.stderr[-3000:]
    named = re.search(r"WorkerDiedError: rollout pool rank 0 on node \S+ \(\S+\) died during", proc.stderr)
    assert named, proc.stderr[-3000:]
    assert "rollout/rank0" in proc.stderr
    assert sorted(metrics_by_step(tmp_path / "run")) == [1, 2]
    assert took < 20, took  # Ray's shutdown included; rollout.async.timeout_s is 60


STOP_HOOK = """
def fail_at_5(step, batch, metrics):
    if step == 5:
        raise RuntimeError("stopped by the test")
"""


@pytest.mark.slow
def test_ray_separate_pool_resumes_to_the_uninterrupted_run(tmp_path):
    """Checkpoint at step 3, fail at step 5 with step 6's rollout maybe in flight, resume: steps
    4-6 equal the uninterrupted run's (max_staleness 0: the same weights make the same samples)."""
    (tmp_path / "stop_hook.py").write_text(STOP_HOOK)
    env = env_with(tmp_path)
    steps = ("trainer.total_steps=6", "checkpoint.save_every=3", "rollout.async.max_staleness=0", RAY)
    straight, _ = train(tmp_path / "straight", *steps, env=env)
    assert straight.returncode == 0, straight.stderr[-3000:]
    failed, _ = train(tmp_path / "resumed", *steps, "trainer.hooks.on_step_end=stop_hook:fail_at_5", env=env)
    assert failed.returncode == 1 and "stopped by the test" in failed.stderr, failed.stderr[-3000:]
    resumed, _ = train(tmp_path / "resumed", *steps, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 3)" in resumed.stderr
    a, b = metrics_by_step(tmp_path / "straight"), metrics_by_step(tmp_path / "resumed")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        for key in ("reward/score_mean", "actor/pg_loss", "actor/grad_norm", "async/staleness_max"):
            assert b[step][key] == a[step][key], (step, key)
