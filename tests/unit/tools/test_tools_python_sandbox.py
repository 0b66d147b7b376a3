"""The Python sandbox: limits kill runaway code, writes stay in the scratch directory, the
network is unreachable, and nothing the call started outlives it, under both isolation modes
(the attacks on the boundary itself: test_tools_sandbox_escapes.py)."""

import os
import socket
import time
from pathlib import Path

import pytest

from rl3d.tools.python_sandbox import PythonSandbox, SandboxConfig, isolation_problem, run_python, to_result

FAST = {"cpu_seconds": 1, "wall_seconds": 20, "memory_mb": 256, "max_output_chars": 1000}
KERNEL_PROBLEM = isolation_problem(SandboxConfig(**FAST))
PROCESS_PROBLEM = isolation_problem(SandboxConfig(**FAST, isolation="process"))
needs_kernel = pytest.mark.skipif(KERNEL_PROBLEM is not None, reason=f"kernel isolation: {KERNEL_PROBLEM}")
needs_process = pytest.mark.skipif(
    PROCESS_PROBLEM is not None, reason=f"process isolation: {PROCESS_PROBLEM}"
)
MODES = [
    pytest.param({}, id="kernel", marks=needs_kernel),
    pytest.param({"isolation": "process"}, id="process", marks=needs_process),
]


def run(code: str, **options):
    config = SandboxConfig(**{**FAST, **options})
    raw = run_python(code, config)
    return raw, to_result(raw, config)


def _session_members(sid: int) -> list[int]:
    """Live (not zombie) processes whose session id is `sid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # field 6 of /proc/<pid>/stat is the session id (after the ")" of the command name)
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


@pytest.mark.parametrize("options", MODES)
def test_prints_and_keeps_files_in_scratch(options):
    code = "open('a.txt', 'w').write('hi')\nimport os\nprint(open('a.txt').read(), os.getcwd())"
    raw, result = run(code, **options)
    assert result.ok, result.error
    text, cwd = result.text.split()
    assert text == "hi"
    if options:  # a host directory, removed afterwards
        assert "rl3d-sandbox-" in cwd and not os.path.exists(cwd)
    else:  # a tmpfs in the run's own mount namespace
        assert cwd == "/sandbox"


@pytest.mark.parametrize("options", MODES)
def test_infinite_loop_killed_at_cpu_limit(options):
    start = time.monotonic()
    _, result = run("while True:\n    pass", **options)
    assert result.timed_out and "CPU time limit of 1s" in result.error
    assert time.monotonic() - start < 15  # well before the wall clock


@needs_kernel
def test_sleep_killed_at_wall_clock():
    start = time.monotonic()
    # 3 s: room for the child to start and print on a loaded machine before the limit
    _, result = run("import time\nprint('started', flush=True)\ntime.sleep(60)", wall_seconds=3)
    assert result.timed_out and "wall clock" in result.error
    assert result.text == "started\n"
    assert time.monotonic() - start < 20


@needs_kernel
@pytest.mark.parametrize(
    "code", ["x = bytearray(8 << 30)", "x = []\nwhile True:\n    x.append(' ' * (1 << 20))"]
)
def test_memory_bomb_fails_cleanly(code):
    _, result = run(code)
    assert not result.timed_out and "MemoryError" in result.error


@pytest.mark.parametrize(
    "code",
    [
        "open({target!r}, 'w').write('x')",
        "open({target!r}, 'a')",
        "import os\nos.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))",
        "import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('x')",
        "import os\nos.rename('../' * 40 + {target!r}[1:], 'stolen')",
        "import os\nos.mkdir({target!r})",
        "import shutil\nshutil.rmtree({existing!r})",
        "import os\nfd = os.open({existing!r}, os.O_RDONLY)\nos.open('x', os.O_WRONLY|os.O_CREAT, dir_fd=fd)",
    ],
)
def test_write_outside_scratch_refused(tmp_path, code):
    target = str(tmp_path / "target")
    existing = tmp_path / "keep"
    existing.mkdir()
    (existing / "f").write_text("kept")
    code = code.format(target=target, existing=str(existing))
    if PROCESS_PROBLEM is None:  # the audit hook refuses even for root (user: null)
        _, result = run(code, isolation="process", user=None)
        assert not result.ok and "outside the scratch directory" in result.error, result
    for options in [{}, {"user": None}] if KERNEL_PROBLEM is None else []:  # the kernel refuses, even uid 0
        _, result = run(code, **options)
        assert not result.ok, result
    assert not os.path.exists(target)
    assert sorted(p.name for p in existing.iterdir()) == ["f"]
    assert (existing / "f").read_text() == "kept"


def _listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    return server


def _accepted(server) -> bool:
    try:
        conn, _ = server.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


CONNECT = "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('connected')"

NETWORK_MODES = [
    pytest.param({}, id="kernel", marks=needs_kernel),
    pytest.param({"block_sockets": False}, id="kernel-namespace-only", marks=needs_kernel),
    pytest.param({"isolation": "process", "network": "audit"}, id="audit-hook-only", marks=needs_process),
    pytest.param(
        {"isolation": "process", "block_sockets": False}, id="process-namespace", marks=needs_process
    ),
]


@pytest.mark.parametrize("options", NETWORK_MODES)
def test_cannot_reach_local_listener(options):
    server = _listener()
    port = server.getsockname()[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3):  # control: the listener works
            assert _accepted(server)
        _, result = run(CONNECT.format(port=port), **options)
        assert not result.ok and "connected" not in result.text
        assert not _accepted(server)
    finally:
        server.close()


@needs_kernel
def test_no_process_outlives_the_call():
    for code, options in [("print(1)", {}), ("import time\ntime.sleep(60)", {"wall_seconds": 1})]:
        raw, _ = run(code, **options)
        assert _session_members(raw.pid) == []


@needs_process
def test_starting_or_signalling_processes_refused_by_the_process_mode_hook():
    for code in [
        "import subprocess",
        "import os\nos.fork()",
        "import os\nos.system('true')",
        "import os\nos.kill(1, 0)",
    ]:
        _, result = run(code, isolation="process")
        assert not result.ok and "not allowed" in result.error, (code, result)


@needs_kernel
def test_output_truncated_and_errors_readable():
    _, result = run("print('x' * 100000)", max_output_chars=100)
    assert result.ok and result.text.startswith("x" * 100) and "truncated" in result.text
    assert len(result.text) < 150
    _, result = run("def f():\n    return 1 / 0\nf()")
    assert "ZeroDivisionError" in result.error and "line 2, in f" in result.error
    assert "_sandbox_child" not in result.error  # the sandbox's own frames are hidden
    _, result = run("print(")
    assert "SyntaxError" in result.error


@needs_kernel
def test_tool_interface():
    tool = PythonSandbox(**FAST)
    assert tool.call({"code": "print(6 * 7)"}).text == "42\n"
    with pytest.raises(ValueError, match="tools.python.network"):
        SandboxConfig(network="internet")


@needs_kernel
def test_slow_call_does_not_stall_others():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        slow = pool.submit(run, "import time\ntime.sleep(60)", wall_seconds=3)
        start = time.monotonic()
        fast = [pool.submit(run, f"print({i} * 2)") for i in range(3)]
        assert [f.result()[1].text for f in fast] == ["0\n", "2\n", "4\n"]
        assert time.monotonic() - start < 2.5 or not slow.done()
        assert slow.result()[1].timed_out


@needs_kernel
def test_asyncio_runs():
    """asyncio's event loop wakes itself through a unix socketpair: no network use. (Under
    `isolation: process` the hook refuses `_posixsubprocess`, which asyncio imports.)"""
    code = (
        "import asyncio\n"
        "async def square(x):\n    await asyncio.sleep(0.01)\n    return x * x\n"
        "async def main():\n    return await asyncio.gather(*(square(x) for x in range(4)))\n"
        "print(asyncio.run(main()))\n"
    )
    _, result = run(code)
    assert result.ok and result.text == "[0, 1, 4, 9]\n", result


@needs_kernel
def test_multiprocessing_pool_and_shared_memory_run_in_the_scratch_budget():
    """multiprocessing's semaphores and shared memory live in a private /dev/shm, the same tmpfs
    as the scratch: its files count in `disk_mb`, and nothing reaches the host's /dev/shm."""
    name = f"rl3d-shm-{os.getpid()}-{time.monotonic_ns()}"
    code = (
        "import multiprocessing as mp, os\n"
        "from multiprocessing import shared_memory\n"
        "with mp.Pool(2) as pool:\n    print(pool.map(abs, [-1, -2, 3]))\n"
        "block = shared_memory.SharedMemory(create=True, size=1024)\n"
        "block.buf[:2] = b'ok'\nprint(bytes(block.buf[:2]).decode())\nblock.close()\nblock.unlink()\n"
        f"open('/dev/shm/{name}', 'wb').write(b'x' * (3 << 20))\n"
        "open('big', 'wb').write(b'x' * (3 << 20))\n"
    )
    raw, result = run(code, disk_mb=5, file_mb=4)
    assert raw.stdout == "[1, 2, 3]\nok\n", raw
    assert "No space left on device" in result.error  # 3 MiB in /dev/shm + 3 MiB in the scratch > 5
    assert not os.path.exists(f"/dev/shm/{name}")


@needs_kernel
def test_pty_works_and_is_bounded():
    """A devpts of the run's own: terminals open and a child runs on one, at most 16 of them."""
    code = (
        "import os, pty\n"
        "parent, child = pty.openpty()\n"
        "os.write(child, b'hi\\n')\nprint(os.read(parent, 16), flush=True)\n"
        "pid, fd = pty.fork()\n"
        "if pid == 0:\n    print('from the child', os.isatty(1), flush=True)\n    os._exit(0)\n"
        "print(os.read(fd, 64).decode().strip())\nos.waitpid(pid, 0)\n"
        "opened = []\n"
        "try:\n    for _ in range(64):\n        opened.append(pty.openpty())\n"
        "except OSError:\n    pass\nprint(len(opened))\n"
    )
    raw, result = run(code)
    assert result.ok, result
    assert raw.stdout.splitlines() == ["b'hi\\r\\n'", "from the child True", "14"]  # 16 - the 2 above


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the privilege drop happens only under root")


@root_only
@pytest.mark.parametrize("options", MODES)
def test_runs_as_nobody_and_owns_only_the_scratch_dir(options):
    code = (
        "import os\n"
        "print(os.getuid(), os.getgid(), os.getgroups())\n"
        "open('mine.txt', 'w').write('ok'); print(open('mine.txt').read())\n"
        "open('/etc/shadow').read()\n"
    )
    raw, result = run(code, **options)
    assert raw.stdout.splitlines() == ["65534 65534 []", "ok"]
    assert "PermissionError" in result.error  # the uid may not read it


@root_only
@needs_kernel
def test_user_none_stays_root_without_capabilities():
    code = "import os\nprint(os.getuid(), open('/proc/self/status').read().split('CapEff:')[1].split()[0])"
    raw, result = run(code, user=None)
    assert result.ok and raw.stdout.split() == ["0", "0000000000000000"]


def test_bad_settings_refused_naming_the_key():
    for options, key in [
        ({"user": 0}, "user"),
        ({"isolation": "bwrap"}, "isolation"),
        ({"network": "audit"}, "network"),  # kernel isolation has its own namespace
        ({"cgroup": "maybe"}, "cgroup"),
        ({"open_files": 4}, "open_files"),
        ({"disk_mb": 0}, "disk_mb"),
        ({"user_pool": 0}, "user_pool"),
        ({"user": 10, "user_pool": 11}, "user_pool"),  # would reach uid 0
    ]:
        with pytest.raises(ValueError, match=f"tools.python.{key}"):
            SandboxConfig(**options)
