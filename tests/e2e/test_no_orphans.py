"""A run killed hard leaves nothing behind: `rl3d train` killed with SIGKILL while its ranks
train takes every process it started with it (torchrun, the ranks, what they started), within
`GRACE_S`, also after a checkpoint was saved (megatron-core's checkpoint writer leaves a
multiprocessing spawn child, a Manager server, running under each rank: the parent-death
signal of the rank does not reach it, see `rl3d.utils.lifetime`).
Each process is found by the run's own marker in its environment, which every descendant
inherits (`RL3D_RANK_EXITS`, a path inside the run dir)."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from train_helpers import GRPO, train_command, train_env

pytestmark = pytest.mark.e2e
GRACE_S = 20.0
START_S = 300.0


def _run_processes(marker: str, *, rank: str | None = None) -> dict[int, str]:
    """pid -> command line of every process whose environment names `marker` (and `RANK=rank`)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if rank is not None and f"RANK={rank}".encode() not in environ:
                continue
            alive = (entry / "stat").read_text().split()[2] != "Z"
            if alive and any(marker.encode() in kv for kv in environ):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _wait_until_gone(marker: str) -> None:
    deadline = time.monotonic() + GRACE_S
    while (left := _run_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"{len(left)} process(es) of the killed run still alive after {GRACE_S:.0f} s: {left}"


def _kill_all(marker: str) -> None:
    for pid in _run_processes(marker):  # whatever the assertion found: not left for later tests
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigkill_of_rl3d_train_takes_every_process_of_the_run(tmp_path):
    run_dir = tmp_path / "run"
    marker = str(run_dir / "logs")
    command = train_command(GRPO, run_dir, "trainer.total_steps=200", "trainer.val_every=0")
    launcher = subprocess.Popen(command, env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + START_S
        while not (run_dir / "metrics.jsonl").exists():  # the ranks are in the loop
            assert launcher.poll() is None, launcher.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no step within the start-up time"
            time.sleep(0.5)
        started = _run_processes(marker)
        assert len(started) >= 3, started  # torchrun and two ranks at least
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        _wait_until_gone(marker)
    finally:
        _kill_all(marker)


def test_sigkill_after_a_checkpoint_takes_the_ranks_multiprocessing_children(tmp_path):
    run_dir = tmp_path / "run"
    marker = str(run_dir / "logs")
    command = train_command(
        GRPO, run_dir, "trainer.total_steps=200", "trainer.val_every=0", "checkpoint.save_every=1"
    )
    launcher = subprocess.Popen(command, env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + START_S
        while not (run_dir / "checkpoints" / "step_00000002").is_dir():  # two saves done, back in the loop
            assert launcher.poll() is None, launcher.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within the start-up time"
            time.sleep(0.5)
        spawned = [c for c in _run_processes(marker, rank="0").values() if "spawn_main" in c]
        assert spawned, "the checkpoint writer left no multiprocessing child: this test tests nothing"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        _wait_until_gone(marker)
    finally:
        _kill_all(marker)
