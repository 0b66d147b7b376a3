"""`rl3d slurm` against a real SLURM cluster on localhost (see conftest.py): sbatch, srun,
torchrun with the c10d rendezvous, preemption by USR1, requeue, status and cancel.

Until the RL loop lands (`rl3d.train`, the controller issue), the jobs that must train run a
probe trainer (`dist_probe.py`) in the trainer's place, through the same generated scripts; the
two tests that need the real loop skip until then.
"""

import importlib.util
import json
import subprocess
import time
from pathlib import Path

import pytest

from rl3d.launch.slurm import parse_slurm_args, read_job_id, run_slurm, slurm_cancel, slurm_status, submit
from rl3d.testing.slurm_cluster import TERMINAL_STATES

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = str(ROOT / "recipes/quickstart_cpu_grpo.yaml")
PROBE = str(Path(__file__).with_name("dist_probe.py"))
NEEDS_LOOP = pytest.mark.skipif(
    importlib.util.find_spec("rl3d.train") is None, reason="needs the RL loop, rl3d.train (controller issue)"
)


def submit_job(run_dir: Path, *argv: str, entry: str | None = PROBE) -> str:
    args = parse_slurm_args([QUICKSTART, f"trainer.run_dir={run_dir}", *argv])
    assert submit(args.target, args.words, args, entry=[entry] if entry else None) == 0
    job_id = read_job_id(run_dir)
    assert job_id
    return job_id


def log_tail(run_dir: Path, lines: int = 40) -> str:
    logs = sorted((run_dir / "slurm/logs").glob("*.log"), key=lambda p: p.stat().st_mtime)
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-lines:]) for p in logs[-2:])


def wait_while_alive(slurm, job_id: str, run_dir: Path, done, what: str, timeout_s: float = 300.0) -> None:
    """Poll `done()` while the job lives; fail at once, with the logs' tails, if it ended first."""
    deadline = time.monotonic() + timeout_s
    while not done():
        state = slurm.job_fields(job_id).get("JobState")
        assert state not in TERMINAL_STATES, f"job {job_id} ended {state} before {what}\n{log_tail(run_dir)}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s\n{log_tail(run_dir)}"
        time.sleep(0.3)


def expect_state(slurm, job_id: str, run_dir: Path, expected: str, timeout_s: float = 300.0) -> None:
    try:
        state = slurm.wait_for_job(job_id, timeout_s=timeout_s)
    except TimeoutError as err:
        state = str(err)
    fields = " ".join(f"{k}={v}" for k, v in slurm.job_fields(job_id).items() if k in ("Reason", "ExitCode"))
    logs = f"{log_tail(run_dir)}\n{slurm.daemon_logs()}"
    assert state == expected, f"job {job_id} ended {state} ({fields}), expected {expected}\n{logs}"


def usr1_and_requeue(slurm, job_id: str, run_dir: Path) -> None:
    """What `#SBATCH --signal=B:USR1@120` does before the time limit; then wait for the requeue."""
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, env=slurm.env)

    def requeued() -> bool:
        fields = slurm.job_fields(job_id)
        return fields.get("JobState") == "PENDING" and fields.get("Restarts", "0") != "0"

    wait_while_alive(slurm, job_id, run_dir, requeued, "the requeue", timeout_s=180)
    # SLURM holds a requeued job for about two minutes (BeginTime), while the killed run's job
    # credential stays revoked (to the second). Release it once that second has passed.
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, env=slurm.env)


def history(run_dir: Path) -> list[str]:
    return (run_dir / "slurm/history.log").read_text().splitlines()


def test_job_runs_one_torchrun_per_node_with_c10d_rendezvous(slurm, run_root, capsys):
    run_dir = run_root / "probe"
    job_id = submit_job(run_dir, "--partition", "debug", "trainer.total_steps=4")
    # a second submission into a run dir whose job is still queued or running is refused
    again = parse_slurm_args([QUICKSTART, f"trainer.run_dir={run_dir}"])
    assert run_slurm(again) == 2
    assert f"already has job {job_id}" in capsys.readouterr().err

    expect_state(slurm, job_id, run_dir, "COMPLETED")
    result = json.loads((run_dir / "probe_result.json").read_text())
    assert (result["world_size"], result["rank_sum"], result["steps"]) == (2, 1.0, 4)
    assert result["resolved_recipe"] == str(run_dir / "slurm/resolved_config.yaml")
    events = history(run_dir)
    assert "start nodes=" in events[0] and events[-1].endswith("end rc=0")
    node_log = (run_dir / f"slurm/logs/job{job_id}-r0-node0.log").read_text()
    assert "preflight on" in node_log and ": ok" in node_log
    capsys.readouterr()
    assert slurm_status(str(run_dir)) == 0
    assert f"job      {job_id}  COMPLETED  exit 0:0" in capsys.readouterr().out


def test_failing_job_ends_failed_and_status_reports_it(slurm, run_root, capsys):
    run_dir = run_root / "failing"
    missing = "/nonexistent/rl3d/train.parquet"  # valid as config, absent on the compute node
    job_id = submit_job(run_dir, f"data.train_files=[{missing}]", entry=None)
    assert "does not exist here" in capsys.readouterr().err
    assert slurm.wait_for_job(job_id, timeout_s=180) == "FAILED"
    assert slurm.job_fields(job_id)["ExitCode"] == "2:0"
    assert history(run_dir)[-1].endswith("end rc=2")
    assert slurm_status(str(run_dir)) == 0
    out = capsys.readouterr().out
    assert f"job      {job_id}  FAILED  exit 2:0" in out
    assert f"data.train_files[0]: {missing} (not found on this node)" in out


def test_unknown_partition_is_rejected_by_sinfo(slurm, run_root, capsys):
    assert (
        run_slurm(parse_slurm_args([QUICKSTART, "--partition", "nosuch", f"trainer.run_dir={run_root}"])) == 2
    )
    err = capsys.readouterr().err
    assert "partition 'nosuch' is unknown to this cluster (sinfo lists: debug)" in err
    assert read_job_id(run_root) is None


def test_usr1_checkpoints_requeues_and_resumes(slurm, run_root):
    run_dir = run_root / "requeue"
    job_id = submit_job(run_dir, "trainer.total_steps=20")
    progress = run_dir / "probe_progress.json"
    wait_while_alive(slurm, job_id, run_dir, progress.exists, "a first step")
    usr1_and_requeue(slurm, job_id, run_dir)
    expect_state(slurm, job_id, run_dir, "COMPLETED")

    saved = json.loads((run_dir / "probe_ckpt.json").read_text())["step"]
    result = json.loads((run_dir / "probe_result.json").read_text())
    assert 0 < saved < 20 and result["start_step"] == saved and result["steps"] == 20
    assert result["restart"] == 1 and read_job_id(run_dir) == job_id
    events = " | ".join(history(run_dir))
    for event in ("restart=0 start", "restart=0 USR1", "restart=0 step ended (rc=0) after USR1: requeue",
                  "restart=1 start", "restart=1 end rc=0"):  # fmt: skip
        assert event in events
    assert (run_dir / f"slurm/logs/job{job_id}-r1-node0.log").exists()


def test_cancel_reads_the_job_id_from_the_run_dir(slurm, run_root, capsys):
    run_dir = run_root / "cancel"
    job_id = submit_job(run_dir, "trainer.total_steps=400")
    progress = run_dir / "probe_progress.json"
    wait_while_alive(slurm, job_id, run_dir, progress.exists, "a first step")
    assert slurm_cancel(str(run_dir)) == 0
    assert f"cancelled job {job_id}" in capsys.readouterr().out
    assert slurm.wait_for_job(job_id, timeout_s=60) == "CANCELLED"
    assert slurm_status(str(run_dir)) == 0
    assert "CANCELLED" in capsys.readouterr().out


def _metrics(run_dir: Path) -> list[dict]:
    from rl3d.logging.metrics import read_jsonl

    return [row for path in sorted(run_dir.rglob("*.jsonl")) for row in read_jsonl(path)]


@NEEDS_LOOP
def test_quickstart_trains_inside_the_job(slurm, run_root):
    run_dir = run_root / "quickstart"
    job_id = submit_job(run_dir, "trainer.total_steps=3", entry=None)
    expect_state(slurm, job_id, run_dir, "COMPLETED")
    steps = {row["step"] for row in _metrics(run_dir) if "step" in row}
    assert {1, 2, 3} <= steps


@NEEDS_LOOP
def test_quickstart_requeue_resumes_from_its_checkpoint(slurm, run_root):
    run_dir = run_root / "quickstart_requeue"
    job_id = submit_job(run_dir, "trainer.total_steps=40", "checkpoint.save_every=1", entry=None)
    two_steps = lambda: any(row.get("step", 0) >= 2 for row in _metrics(run_dir))
    wait_while_alive(slurm, job_id, run_dir, two_steps, "two training steps")
    usr1_and_requeue(slurm, job_id, run_dir)
    first_run_step_1 = [row for row in _metrics(run_dir) if row.get("step") == 1]
    expect_state(slurm, job_id, run_dir, "COMPLETED")
    rows = _metrics(run_dir)
    assert max(row.get("step", 0) for row in rows) == 40
    # resumed, not restarted: the second run does not log step 1 again
    assert [row for row in rows if row.get("step") == 1] == first_run_step_1
    assert "restart=1 end rc=0" in history(run_dir)[-1]


def test_ray_backend_starts_a_cluster_runs_the_driver_and_stops_it(slurm, run_root):
    run_dir = run_root / "ray"
    ray_probe = str(Path(__file__).with_name("ray_probe.py"))
    job_id = submit_job(run_dir, "launch.backend=ray", entry=ray_probe)
    expect_state(slurm, job_id, run_dir, "COMPLETED")
    result = json.loads((run_dir / "ray_result.json").read_text())
    assert result["alive_nodes"] == 1 and len(result["task_nodes"]) == 1
    assert result["ray_address"].endswith(f":{20000 + (int(job_id) * 8) % 40000}")
    assert result["resolved_recipe"] == str(run_dir / "slurm/resolved_config.yaml")
    events = history(run_dir)
    assert "ray head=" in events[0] and "ray cluster stopped" in events[-2]
    assert events[-1].endswith("end rc=0")


@pytest.mark.skipif(
    importlib.util.find_spec("rl3d.launch.ray_launch") is None, reason="needs the Ray driver (ray_launch)"
)
def test_ray_backend_quickstart_trains_inside_the_job(slurm, run_root):
    run_dir = run_root / "ray_quickstart"
    job_id = submit_job(run_dir, "launch.backend=ray", "trainer.total_steps=3", entry=None)
    expect_state(slurm, job_id, run_dir, "COMPLETED")
    assert {1, 2, 3} <= {row["step"] for row in _metrics(run_dir) if "step" in row}
    driver_log = (run_dir / f"slurm/logs/job{job_id}-r0-driver.log").read_text()
    assert "(joined)" in driver_log  # the driver used the job's Ray cluster, not a local one
    assert history(run_dir)[-1].endswith("end rc=0")
