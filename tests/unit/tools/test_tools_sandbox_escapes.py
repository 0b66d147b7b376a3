"""Attacks on the Python sandbox through its public interface, one per class: the kernel, not the
audit hook, must stop each. Every program first switches the audit hook off (as hostile code can)
so that what is tested is the boundary behind it."""

import json
import os
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rl3d.tools import ToolBox
from rl3d.tools._sandbox_cgroup import missing_controllers
from rl3d.tools.python_sandbox import SandboxConfig, isolation_problem, run_python, to_result

FAST = {"cpu_seconds": 2, "wall_seconds": 20, "memory_mb": 256, "max_output_chars": 4000}
PROBLEM = isolation_problem(SandboxConfig(**FAST))
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"kernel isolation unavailable here: {PROBLEM}")

# Empties the tables of an audit hook that keeps them as module globals of the child script.
BYPASS = """
import sys
for _name in ("_REFUSED_EVENTS", "_REFUSED_IMPORTS", "_PATH_EVENTS", "_NETWORK_EVENTS"):
    getattr(sys.modules["__main__"], _name, set()).clear()
"""


def run(code: str, **options):
    config = SandboxConfig(**{**FAST, **options})
    raw = run_python(BYPASS + code, config)
    return raw, to_result(raw, config)


@pytest.fixture
def host_path():
    """A fresh name in a directory every user may write on the host (/tmp), removed afterwards."""
    path = Path(f"/tmp/rl3d-escape-{uuid.uuid4().hex}")
    yield path
    if path.exists():
        path.unlink()


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.system('echo pwned > {target}')",  # a shell, once the hook's tables are empty
        "import _xxsubinterpreters as i\ni.run_string(i.create(), \"open('{target}', 'w').write('x')\")",
        "import sqlite3\nsqlite3.connect('{target}').execute('create table t (x)')",  # C code: no audit event
    ],
    ids=["shell", "subinterpreter", "sqlite3"],
)
def test_no_write_reaches_the_host(host_path, code):
    run(code.format(target=host_path))
    assert not host_path.exists()


def test_hard_link_to_a_host_file_cannot_be_written_through(host_path):
    host_path.write_text("original")
    host_path.chmod(0o666)
    _, result = run(f"import os\nos.link({str(host_path)!r}, 'x')\nopen('x', 'w').write('pwned')")
    assert not result.ok and host_path.read_text() == "original"


def test_nothing_writable_outside_scratch():
    name = f".rl3d-probe-{uuid.uuid4().hex}"
    places = [
        "/",
        "/etc",
        "/usr",
        "/dev",
        "/dev/shm",
        "/run",
        "/var/tmp",
        "/root",
        os.getcwd(),
        str(Path.home()),
    ]
    script = "; ".join(f"touch {p}/{name} 2>/dev/null && echo {p}" for p in places)
    raw, result = run(f"import os\nos.system({script!r})\nprint(sorted(os.listdir('/')))")
    leaked = [p for p in places if os.path.exists(f"{p}/{name}")]
    for p in leaked:
        os.unlink(f"{p}/{name}")
    # /dev/shm inside is the run's own: the scratch's tmpfs (multiprocessing needs it), not the host's
    assert result.ok and leaked == [] and raw.stdout.splitlines()[:-1] == ["/dev/shm"]
    # the system is there read-only; no host /tmp, /run, home or project directory
    system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "sbin", "usr"}
    seen = set(json.loads(raw.stdout.splitlines()[-1].replace("'", '"')))
    assert seen <= system | {"proc", "sandbox", "tmp", "root"}  # root: /root/... holding the Python


def _alive_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # not a zombie
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_orphans_die_with_the_call_and_cannot_reach_the_next():
    marker = f"rl3d-orphan-{uuid.uuid4().hex}"
    orphan = (
        "import glob, time\n"
        "for _ in range(300):\n"
        "    for d in glob.glob('/tmp/rl3d-sandbox-*') + ['/sandbox']:\n"
        "        try: open(d + '/evil', 'w').write('x')\n"
        "        except OSError: pass\n"
        "    time.sleep(0.1)\n"
    )
    code = (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', {orphan!r}, {marker!r}])\n"
        "    os._exit(0)\n"
        "print('left')\n"
    )
    start = time.monotonic()
    try:
        _, result = run(code)
        elapsed = time.monotonic() - start
        assert result.ok and result.text == "left\n"
        assert _alive_with(marker) == []
        assert elapsed < 8  # never waits on the orphan's copy of stdout
        raw, _ = run("import os\nprint(os.listdir('.'))")
        assert raw.stdout == "[]\n"
    finally:
        for pid in _alive_with(marker):
            os.kill(pid, signal.SIGKILL)


def test_cannot_see_signal_or_throttle_other_processes_of_the_same_uid():
    victim = subprocess.Popen(["sleep", "60"], user=65534, group=65534)
    try:
        code = (
            "import os, resource, signal\n"
            "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            f"print(pids, os.path.exists('/proc/%d' % {victim.pid}))\n"
            f"for attempt in (lambda: resource.prlimit({victim.pid}, resource.RLIMIT_CPU, (1, 1)),\n"
            f"                lambda: signal.pidfd_send_signal(os.pidfd_open({victim.pid}), 9),\n"
            f"                lambda: os.kill({victim.pid}, 9)):\n"
            "    try: attempt(); print('reached')\n"
            "    except OSError: pass\n"
        )
        raw, result = run(code)
        assert result.ok and "reached" not in raw.stdout, raw
        assert raw.stdout.split("]")[0] == "[1, 2"  # only the launcher and the code itself
        assert victim.poll() is None
        assert "Max cpu time              unlimited" in Path(f"/proc/{victim.pid}/limits").read_text()
    finally:
        victim.kill()
        victim.wait()


def test_several_runs_at_once_are_apart():
    code = (
        "import os, time\n"
        "open('mine-' + os.urandom(8).hex(), 'w').close()\n"
        "time.sleep(1.5)\n"
        "print(sorted(os.listdir('.')), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
    )
    with ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(lambda _: run(code), range(3)))
    for raw, result in runs:
        assert result.ok, result
        files, pids = raw.stdout.split("] [")
        assert files.count("mine-") == 1 and pids == "1, 2]\n"  # its own file, its own processes


HOLD_INOTIFY = """
import subprocess, sys
holder = (
    "import ctypes, time\\nlibc = ctypes.CDLL(None)\\nn = 0\\n"
    "while libc.inotify_init1(0) >= 0:\\n    n += 1\\nprint(n, flush=True)\\ntime.sleep(4)"
)
for p in [subprocess.Popen([sys.executable, '-c', holder]) for _ in range(3)]:
    p.wait()
"""
TAKE_INOTIFY = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print(os.getuid(), libc.inotify_init1(0) >= 0, os.strerror(ctypes.get_errno()))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs drop to a uid of their own only under root")
def test_concurrent_runs_have_per_uid_kernel_quotas_of_their_own():
    """Inotify instances are counted per uid (fs.inotify.max_user_instances, 128 by default):
    one run holding them all must leave a concurrent run its own."""
    with ThreadPoolExecutor(2) as pool:
        hog = pool.submit(run, HOLD_INOTIFY)
        time.sleep(2)
        raw, result = run(TAKE_INOTIFY)
        hog_raw, _ = hog.result()
    held = sum(int(n) for n in hog_raw.stdout.split())
    assert held >= min(128, int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())), hog_raw
    uid, took, why = raw.stdout.split(" ", 2)
    assert result.ok and took == "True", raw.stdout  # before: "False Too many open files"
    assert int(uid) != 65534  # the lone run's uid was taken: a second uid of the pool


def test_memfd_and_disk_are_bounded():
    _, result = run("import os\nos.memfd_create('pin')")
    assert "PermissionError" in result.error
    _, result = run(
        "for i in range(4):\n    open(f'f{i}', 'wb').write(b'x' * (2 << 20))", disk_mb=4, file_mb=3
    )
    assert "No space left on device" in result.error


@pytest.mark.skipif(bool(missing_controllers()), reason=f"no cgroup controller {missing_controllers()} here")
def test_process_count_is_bounded():
    code = (
        "import subprocess\nstarted = []\n"
        "try:\n    for _ in range(60):\n        started.append(subprocess.Popen(['sleep', '5']))\n"
        "except OSError:\n    pass\nprint(len(started))\n"
    )
    raw, result = run(code)
    assert result.ok and int(raw.stdout) < 32  # max_processes, by default


def test_deep_tree_left_behind_does_not_break_the_caller():
    code = "import os\nfor _ in range(1200):\n    os.mkdir('d')\n    os.chdir('d')\nprint('built')"
    for options in ({}, {"isolation": "process"}):
        raw, result = run("import os\nprint(os.getcwd(), flush=True)\n" + code, **options)
        assert result.ok and raw.stdout.endswith("built\n"), result
        assert not options or not os.path.exists(raw.stdout.split()[0])  # a host scratch is removed


def test_confinement_of_the_process_itself():
    code = (
        "import os, resource\n"
        "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
        "print(*(status[k].strip() for k in ('NoNewPrivs', 'Seccomp', 'CapEff', 'CapBnd')))\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
        "print(open('/proc/self/cmdline', 'rb').read() + open('/proc/1/cmdline', 'rb').read())\n"
    )
    raw, result = run(code)
    assert result.ok, result
    status, files, cmdlines = raw.stdout.splitlines()
    assert status.split() == ["1", "2", "0000000000000000", "0000000000000000"]
    assert files == "64"
    assert "scratch" not in cmdlines and "{" not in cmdlines  # the settings came on stdin


def test_a_kill_is_reported_as_what_it_was():
    _, result = run("import signal\nsignal.raise_signal(signal.SIGKILL)")
    assert result.error == "killed by signal 9" and not result.timed_out
    _, result = run("while True:\n    pass", cpu_seconds=1)
    assert result.error == "CPU time limit of 1s exceeded" and result.timed_out


def test_a_signal_the_code_sends_itself_is_not_a_limit():
    """SIGXCPU is what the CPU limit sends, but the code can send it too: a CPU timeout is
    reported only when the launcher measured the CPU time at the limit."""
    _, result = run("import os, signal\nprint('x', flush=True)\nos.kill(os.getpid(), signal.SIGXCPU)")
    assert result.error == "killed by signal 24" and not result.timed_out and result.text == "x\n"
    # a child that burnt CPU (its own limit apiece) does not count towards the parent's
    burn = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'while 1: pass'])\n"
    _, result = run(burn + "import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)", cpu_seconds=1)
    assert result.error == "killed by signal 24" and not result.timed_out


SIGNAL_LAUNCHER = """
import os, signal, time
print('before', os.getppid(), flush=True)
launchers = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]
for pid in sorted(set(launchers + [os.getppid()])):  # the parent, and whatever /proc shows
    os.kill(pid, signal.{name})
time.sleep(0.5)
print('after')
"""


@pytest.mark.parametrize("name", ["SIGALRM", "SIGINT", "SIGTERM", "SIGHUP", "SIGCHLD", "SIGSTOP", "SIGKILL"])
def test_signals_sent_to_the_launcher_change_nothing(name):
    """With `user: null` the code is the launcher's uid (as in a user namespace, where it is
    root of the namespace like the launcher) and may signal it; the launcher blocks them all."""
    raw, result = run(SIGNAL_LAUNCHER.format(name=name), user=None)
    assert result.ok and result.text == "before 1\nafter\n", result
    assert not result.timed_out and not raw.wall_timed_out


def test_ordinary_file_and_process_code_works():
    code = (
        "import os, subprocess, sys\n"
        "os.makedirs('out/a')\nopen('out/a/f.txt', 'w').write('x')\nos.remove('out/a/f.txt')\n"
        "os.rmdir('out/a')\nos.mkdir('tmpdir')\nos.rename('tmpdir', 'kept')\n"
        "print(sorted(os.listdir('.')), sorted(os.listdir('out')))\n"
        "print(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True).stdout.decode())\n"
        "print(subprocess.run(['sh', '-c', 'echo hi > f && cat f'], capture_output=True, text=True).stdout)\n"
    )
    result = ToolBox.from_specs({"python": FAST}).call("python", {"code": code})
    assert result.ok, result
    assert result.text == "['kept', 'out'] []\n42\n\nhi\n\n"


def test_network_auto_is_gone():
    with pytest.raises(ValueError, match="tools.python.network"):
        SandboxConfig(network="auto")


def test_an_unprivileged_trainer_gets_the_boundary_through_a_user_namespace(as_unprivileged_trainer):
    code = "import os\nprint(os.getuid(), sorted(os.listdir('/')), open('/proc/self/status').read())"
    result = as_unprivileged_trainer(code, wall_seconds=30)
    assert result["error"] is None, result
    uid, rest = result["text"].split(" ", 1)
    listing, status = rest.split("]", 1)
    assert uid == "0" and "work" not in listing and "sandbox" in listing  # root of its own namespace only
    assert "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status and "CapEff:\t0000000000000000" in status


@pytest.mark.parametrize("name", ["SIGALRM", "SIGINT"])
def test_signals_to_the_launcher_in_a_user_namespace_change_nothing(name, as_unprivileged_trainer):
    """An unprivileged trainer's run is root of its user namespace, as its launcher is: the code
    may signal the launcher, which reports neither a wall-clock timeout nor a failure for it."""
    result = as_unprivileged_trainer(SIGNAL_LAUNCHER.format(name=name))
    assert result.get("text") == "before 1\nafter\n" and result.get("error") is None, result
    assert not result["timed_out"]


def test_asyncio_pool_and_pty_work_for_an_unprivileged_trainer(as_unprivileged_trainer):
    """The private /dev/shm and devpts are made inside a user namespace too."""
    code = (
        "import asyncio, multiprocessing, os, pty\n"
        "async def seven():\n    return 7\n"
        "print(asyncio.run(seven()))\n"
        "with multiprocessing.Pool(2) as pool:\n    print(pool.map(abs, [-1, 2]))\n"
        "parent, child = pty.openpty()\nos.write(child, b'x\\n')\nprint(os.read(parent, 9))\n"
    )
    result = as_unprivileged_trainer(code)
    assert result.get("text") == "7\n[1, 2]\nb'x\\r\\n'\n" and result.get("error") is None, result


SYSCALLS = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
calls = {
    "ptrace": (101, 0, 0, 0, 0),  # PTRACE_TRACEME
    "unshare": (272, 0x10000000),  # CLONE_NEWUSER
    "clone": (56, 0x10000000 | 17, 0, 0, 0, 0),  # a child in a new user namespace
    "mount": (165, b"none", b"/sandbox", b"tmpfs", 0, None),
    "keyctl": (250, 0, -3, 0),  # KEYCTL_GET_KEYRING_ID of the session keyring
    "bpf": (321, 0, None, 0),
    "io_uring_setup": (425, 1, None),
    "memfd_create": (319, b"x", 0),
    "userfaultfd": (323, 0),
    "perf_event_open": (298, None, 0, -1, -1, 0),
    "io_setup": (206, 1, ctypes.byref(ctypes.c_ulong(0))),  # fs.aio-max-nr is host-wide
}
for name, (nr, *args) in calls.items():
    result = libc.syscall(nr, *args)
    print(name, result, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
print("getpid", libc.syscall(39))
"""


def test_seccomp_refuses_the_calls_an_escape_needs():
    raw, result = run(SYSCALLS)
    assert result.ok, result
    *refused, allowed = raw.stdout.splitlines()
    assert len(refused) == 11 and all(line.split()[1:] == ["-1", "EPERM"] for line in refused), raw.stdout
    assert allowed == "getpid 2"  # an ordinary call goes through (the code is PID 2 of its namespace)


SOCKETS = """
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
for name in ("AF_UNIX", "AF_INET", "AF_INET6", "AF_VSOCK", "AF_PACKET", "AF_NETLINK", "AF_ALG"):
    kind = socket.SOCK_SEQPACKET if name == "AF_ALG" else socket.SOCK_DGRAM
    fd = libc.syscall(41, getattr(socket, name), kind, 0)  # socket(2), below Python's socket module
    print(name, "ok" if fd >= 0 else errno.errorcode[ctypes.get_errno()])
    if fd >= 0:
        os.close(fd)
pair = (ctypes.c_int * 2)()
print("socketpair", libc.syscall(53, socket.AF_UNIX, socket.SOCK_STREAM, 0, pair))
print("vsockpair", libc.syscall(53, socket.AF_VSOCK, socket.SOCK_STREAM, 0, pair), ctypes.get_errno())
"""


def test_only_the_socket_families_the_sandbox_needs():
    """vsock is outside the network namespace (it reaches the host's vsock ports): the kernel
    refuses it with the other families the sandbox does not need, asked for with the system call
    itself (below the in-process guard); unix and inet sockets, and a unix socketpair, work."""
    raw, result = run(SOCKETS)
    assert result.ok, result
    lines = dict(line.split(" ", 1) for line in raw.stdout.splitlines())
    assert lines["AF_UNIX"] == lines["AF_INET"] == lines["AF_INET6"] == "ok", raw.stdout
    refused = ("AF_VSOCK", "AF_PACKET", "AF_NETLINK", "AF_ALG")
    assert all(lines[f] == "EAFNOSUPPORT" for f in refused), raw.stdout
    assert lines["socketpair"] == "0" and lines["vsockpair"] == "-1 97", raw.stdout
