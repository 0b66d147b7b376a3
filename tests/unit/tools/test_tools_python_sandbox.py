"""The Python sandbox: limits kill runaway code, writes stay in the scratch directory, the
network is unreachable, and nothing the call started outlives it."""

import os
import socket
import time
from pathlib import Path

import pytest

from rl3d.tools.python_sandbox import (
    PythonSandbox,
    SandboxConfig,
    network_namespace_prefix,
    run_python,
    to_result,
)

FAST = {"cpu_seconds": 1, "wall_seconds": 20, "memory_mb": 256, "max_output_chars": 1000}


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


def test_prints_and_keeps_files_in_scratch():
    raw, result = run("open('a.txt', 'w').write('hi')\nimport os\nprint(open('a.txt').read(), os.getcwd())")
    assert result.ok, result.error
    text, cwd = result.text.split()
    assert text == "hi" and "rl3d-sandbox-" in cwd
    assert not os.path.exists(cwd)  # the scratch directory is removed afterwards


def test_infinite_loop_killed_at_cpu_limit():
    start = time.monotonic()
    _, result = run("while True:\n    pass")
    assert result.timed_out and "CPU time limit of 1s" in result.error
    assert time.monotonic() - start < 15  # well before the wall clock


def test_sleep_killed_at_wall_clock():
    start = time.monotonic()
    # 3 s: room for the child to start and print on a loaded machine before the limit
    _, result = run("import time\nprint('started', flush=True)\ntime.sleep(60)", wall_seconds=3)
    assert result.timed_out and "wall clock" in result.error
    assert result.text == "started\n"
    assert time.monotonic() - start < 20


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
    # the audit hook refuses even for root (user: null); as nobody the OS may refuse first
    _, result = run(code.format(target=target, existing=str(existing)), user=None)
    assert not result.ok and "outside the scratch directory" in result.error, result
    _, result = run(code.format(target=target, existing=str(existing)))
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
    pytest.param({}, id="default"),
    pytest.param({"network": "audit"}, id="audit-hook-only"),
    pytest.param(
        {"network": "namespace", "block_sockets": False},
        id="namespace-only",
        marks=pytest.mark.skipif(
            network_namespace_prefix() is None, reason="unshare --net does not work here"
        ),
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


def test_no_process_outlives_the_call():
    for code, options in [("print(1)", {}), ("import time\ntime.sleep(60)", {"wall_seconds": 1})]:
        raw, _ = run(code, **options)
        assert _session_members(raw.pid) == []


# Stands in for the child script: starts a grandchild the audit hook would have refused (as code
# that escaped the hook would), prints its pid and leaves it running.
ESCAPED_CHILD = """
import subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(p.pid, flush=True)
sys.stdin.read()
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""


@pytest.mark.parametrize("linger", [0, 60], ids=["child-exits", "child-times-out"])
def test_grandchildren_killed_with_the_group(tmp_path, monkeypatch, linger):
    import rl3d.tools.python_sandbox as sandbox

    script = tmp_path / "child.py"
    script.write_text(ESCAPED_CHILD.replace("float(sys.argv[2]) if len(sys.argv) > 2 else 0", str(linger)))
    monkeypatch.setattr(sandbox, "CHILD_SCRIPT", str(script))
    raw, result = run("", wall_seconds=2)
    grandchild = int(raw.stdout.split()[0])
    assert result.timed_out == bool(linger)
    assert _session_members(raw.pid) == []
    stat = Path(f"/proc/{grandchild}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_starting_or_signalling_processes_refused():
    for code in [
        "import subprocess",
        "import os\nos.fork()",
        "import os\nos.system('true')",
        "import os\nos.kill(1, 0)",
    ]:
        _, result = run(code)
        assert not result.ok and "not allowed" in result.error, (code, result)


def test_output_truncated_and_errors_readable():
    _, result = run("print('x' * 100000)", max_output_chars=100)
    assert result.ok and result.text.startswith("x" * 100) and "truncated" in result.text
    assert len(result.text) < 150
    _, result = run("def f():\n    return 1 / 0\nf()")
    assert "ZeroDivisionError" in result.error and "line 2, in f" in result.error
    assert "_sandbox_child" not in result.error  # the sandbox's own frames are hidden
    _, result = run("print(")
    assert "SyntaxError" in result.error


def test_tool_interface():
    tool = PythonSandbox(**FAST)
    assert tool.call({"code": "print(6 * 7)"}).text == "42\n"
    with pytest.raises(ValueError, match="tools.python.network"):
        SandboxConfig(network="internet")


def test_slow_call_does_not_stall_others():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        slow = pool.submit(run, "import time\ntime.sleep(60)", wall_seconds=3)
        start = time.monotonic()
        fast = [pool.submit(run, f"print({i} * 2)") for i in range(3)]
        assert [f.result()[1].text for f in fast] == ["0\n", "2\n", "4\n"]
        assert time.monotonic() - start < 2.5 or not slow.done()
        assert slow.result()[1].timed_out


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the privilege drop happens only under root")


@root_only
def test_runs_as_nobody_and_owns_only_the_scratch_dir(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("root only")
    secret.chmod(0o600)
    code = (
        "import os\n"
        "print(os.getuid(), os.getgid(), os.getgroups())\n"
        "open('mine.txt', 'w').write('ok'); print(open('mine.txt').read())\n"
        f"open({str(secret)!r}).read()\n"
    )
    raw, result = run(code)
    assert raw.stdout.splitlines() == ["65534 65534 []", "ok"]
    assert "PermissionError" in result.error  # reading is allowed by the hook, refused by the OS


@root_only
def test_user_none_stays_root():
    raw, result = run("import os; print(os.getuid())", user=None)
    assert result.ok and raw.stdout.strip() == "0"


def test_bad_user_refused():
    with pytest.raises(ValueError, match="tools.python.user"):
        SandboxConfig(user=0)
