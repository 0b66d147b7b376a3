"""The kernel's OOM killer takes the sandboxed code, never the launcher or the trainer: memory the
code holds in the kernel, or runs that together fill the trainer's own cgroup, end the code, and
the call reports a memory kill with the code's output kept."""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rl3d.tools._sandbox_cgroup import usable
from rl3d.tools.python_sandbox import SandboxConfig, isolation_problem, run_python, to_result

FAST = {"cpu_seconds": 10, "wall_seconds": 40, "memory_mb": 128}
PROBLEM = isolation_problem(SandboxConfig(**FAST))
MEMORY = usable().get("memory")
pytestmark = pytest.mark.skipif(
    PROBLEM is not None or MEMORY is None, reason=f"needs kernel isolation ({PROBLEM}) and a memory cgroup"
)

# SysV message queues until the run's cgroup is full: kernel memory, charged to the run but in no
# process's resident set, so before the worker's OOM score the launcher (the larger) was taken.
MESSAGE_QUEUES = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print("before", flush=True)
message = ctypes.create_string_buffer(8200)
ctypes.memset(message, 1, 8)  # mtype 1
for _ in range(32000):
    queue = libc.msgget(0, 0o1600)  # IPC_PRIVATE, IPC_CREAT, 0600
    if queue < 0:
        break
    while libc.msgsnd(queue, message, 8192, 0o4000) == 0:  # IPC_NOWAIT
        pass
print("not reached")
"""


def test_memory_the_code_holds_in_the_kernel_kills_the_code_and_is_reported():
    config = SandboxConfig(**FAST)
    raw = run_python(MESSAGE_QUEUES, config)
    result = to_result(raw, config)
    assert raw.oom_killed and raw.returncode == -9, raw  # the worker, not the launcher
    assert result.text == "before\n" and result.error == "memory limit of 128 MiB exceeded (killed)"


# A trainer stand-in of 400 MiB in a cgroup of 700 MiB of its own starts three runs of 200 MiB at
# once, each inside its own limit of 256 MiB: together they fill the trainer's cgroup.
TRAINER = r"""
import json, os, sys
from concurrent.futures import ThreadPoolExecutor
with open(os.path.join(sys.argv[2], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
sys.path.insert(0, sys.argv[1])
from rl3d.tools.python_sandbox import SandboxConfig, run_python, to_result
held = bytearray(b"\1") * (400 << 20)
config = SandboxConfig(cpu_seconds=10, wall_seconds=40, memory_mb=256)
code = "x = bytearray(b'\\1') * (200 << 20)\nprint('holding', flush=True)\nimport time\ntime.sleep(4)"
with ThreadPoolExecutor(3) as pool:
    results = list(pool.map(lambda _: to_result(run_python(code, config), config), range(3)))
print(json.dumps([[r.text, r.error] for r in results]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a memory cgroup for the trainer stand-in")
def test_runs_that_fill_the_trainers_cgroup_kill_runs_not_the_trainer():
    version, parent = MEMORY
    trainer_group = Path(parent) / f"rl3d-test-trainer-{uuid.uuid4().hex[:8]}"
    trainer_group.mkdir()
    try:
        limit = "memory.max" if version == 2 else "memory.limit_in_bytes"
        (trainer_group / limit).write_text(str(700 << 20))
        src = str(Path(__file__).resolve().parents[3] / "src")
        proc = subprocess.run(
            [sys.executable, "-c", TRAINER, src, str(trainer_group)],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, f"the trainer stand-in died ({proc.returncode}): {proc.stderr[-1500:]}"
        results = json.loads(proc.stdout.splitlines()[-1])
        killed = [r for r in results if r[1] is not None]
        assert killed, results  # 1000 MiB cannot fit in 700: some run was taken
        assert all(error == "memory limit of 256 MiB exceeded (killed)" for _, error in killed), results
        assert all(text == "holding\n" for text, error in results if error is None), results
    finally:
        for _ in range(50):  # rmdir fails while a killed process is still exiting
            try:
                trainer_group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


# Without a cgroup (`cgroup: off`, or any trainer that is not root): the whole tree stays bounded.
FORKS = """
import os, time
started = 0
try:
    for _ in range(100):
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        started += 1
except OSError as err:
    print("refused", err.errno)
print("started", started)
"""
# four processes of 213 MiB, each inside its own address-space limit of 256 MiB
FOUR_HOLDERS = """
import os, time
print("forking", flush=True)
for _ in range(4):
    if os.fork() == 0:
        held = bytearray(b"\\1") * (213 << 20)
        time.sleep(5)
        os._exit(0)
time.sleep(5)
print("all held")
"""
TREE = {"max_processes": 32, "memory_mb": 256}


def check_process_count(result: dict) -> None:
    """The worker and at most 31 more: the 32nd fork refused with EAGAIN (11)."""
    assert result["error"] is None and result["text"] == "refused 11\nstarted 31\n", result


def check_tree_memory(result: dict) -> None:
    assert result["text"] == "forking\n", result
    assert result["error"] == "memory limit of 256 MiB exceeded (killed)", result


@pytest.mark.skipif(os.geteuid() != 0, reason="as root: a leased uid of its own per run")
@pytest.mark.parametrize(("code", "check"), [(FORKS, check_process_count), (FOUR_HOLDERS, check_tree_memory)])
def test_a_run_without_a_cgroup_is_bounded_as_a_whole(code, check):
    config = SandboxConfig(**{**FAST, **TREE, "cgroup": "off"})
    check(to_result(run_python(code, config), config).__dict__)


@pytest.mark.parametrize(("code", "check"), [(FORKS, check_process_count), (FOUR_HOLDERS, check_tree_memory)])
def test_an_unprivileged_trainers_run_is_bounded_as_a_whole(code, check, as_unprivileged_trainer):
    """In a user namespace there is no cgroup: before, 100 processes ran under max_processes 32,
    and 4 x 213 MiB under memory_mb 256."""
    check(as_unprivileged_trainer(code, **TREE))
