"""The rollout rank of a separate rollout pool killed (SIGKILL) mid-run: the job ends within
seconds, non-zero, and the launcher's last line names the pool and the rank (a rank killed by a
signal writes no error line of its own; torchrun's exit codes say which one it was)."""

import os
import signal
import subprocess
import time

import pytest
from train_helpers import ROOT, metrics_by_step, train_command, train_env

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]
ASYNC = ROOT / "recipes/quickstart_cpu_grpo_async.yaml"


def rank_pid(run_dir, rank: int) -> int | None:
    """The torchrun worker of `rank` in the run writing to `run_dir`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if (
            b"rl3d.train" in cmd
            and f"trainer.run_dir={run_dir}".encode() in cmd
            and f"RANK={rank}".encode() in env
        ):
            return int(pid)
    return None


def test_killed_rollout_rank_is_named_with_its_pool(tmp_path):
    run = tmp_path / "run"
    err = tmp_path / "output.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(
            train_command(ASYNC, run, "trainer.total_steps=200", "checkpoint.save_every=0"),
            env=train_env(),
            start_new_session=True,
            stdout=stderr,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:  # a few steps in: both ranks are busy
                if (run / "metrics.jsonl").exists() and len(metrics_by_step(run)) >= 3:
                    break
                assert proc.poll() is None, err.read_text()[-3000:]
                time.sleep(0.1)
            pid = rank_pid(run, 1)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            code = proc.wait(timeout=120)
            took = time.monotonic() - killed_at
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert code != 0
    assert took < 60, took
    last = [line for line in err.read_text().splitlines() if line.startswith("rl3d: run failed:")]
    assert last, err.read_text()[-3000:]
    assert "world rank 1 (rollout pool, its rank 0) was killed by SIGKILL" in last[-1], last[-1]
