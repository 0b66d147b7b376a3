"""The launcher's own clock (`_sandbox_init.wait_for`): it kills the worker at its deadline,
should the caller be gone, and a signal sent to it decides nothing."""

import subprocess
import sys
from pathlib import Path

import rl3d.tools

TOOLS = str(Path(rl3d.tools.__file__).parent)
WAIT = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import _sandbox_init
signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # as the launcher does
worker = os.fork()
if worker == 0:
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    time.sleep(float(sys.argv[2]))
    os._exit(3)
for sig in (signal.SIGALRM, signal.SIGINT, signal.SIGCHLD):
    os.kill(os.getpid(), sig)  # what the code could send its launcher
start = time.monotonic()
report = _sandbox_init.wait_for(worker, 1.0)
code = os.waitstatus_to_exitcode(report["wait_status"])
print(report["wall_killed"], code, round(time.monotonic() - start))
"""


def _wait(sleep: float) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", WAIT, TOOLS, str(sleep)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_the_launcher_kills_at_its_own_deadline():
    assert _wait(30) == ["True", "-9", "1"]


def test_a_worker_that_ends_in_time_is_not_a_timeout_whatever_the_launcher_was_sent():
    assert _wait(0.2) == ["False", "3", "0"]
