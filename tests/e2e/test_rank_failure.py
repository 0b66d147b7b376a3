"""An error on one rank mid-run: one clear line naming the rank and its log file, the traceback
in that file, a non-zero exit, and the launcher's last line names the rank that failed first."""

import os
import subprocess

import pytest
from train_helpers import GRPO, train_command, train_env

pytestmark = pytest.mark.e2e

HOOK = """
import os

def fail_on_rank1(step, batch, metrics):
    if os.environ.get("RANK") == "1" and step == 2:
        raise RuntimeError("boom on purpose")
"""


def test_rank_error_is_one_line_and_a_logged_traceback(tmp_path):
    (tmp_path / "rank_hook.py").write_text(HOOK)
    env = train_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    run = tmp_path / "run"
    overrides = (
        "trainer.total_steps=3",
        "checkpoint.save_every=0",
        "trainer.hooks.on_step_end=rank_hook:fail_on_rank1",
    )
    proc = subprocess.run(
        train_command(GRPO, run, *overrides), capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode != 0
    log = run / "logs" / "rank1.log"
    cause = "rank 1 failed: HookError: "
    rank_lines = [line for line in proc.stderr.splitlines() if line.startswith("rl3d: rank 1 failed")]
    assert len(rank_lines) == 1 and "boom on purpose" in rank_lines[0] and str(log) in rank_lines[0]
    last = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("rl3d: run failed:")]
    assert last and last[-1].startswith("rl3d: run failed: " + cause), last
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "boom on purpose" in text
