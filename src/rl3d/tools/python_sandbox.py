"""A Python sandbox tool: run model-written code where the kernel confines it.

``isolation: kernel`` (the default) gives each call, through `unshare` and the launcher
`_sandbox_init`:
- its own PID namespace: the call's processes die with it, and ``/proc`` shows only them;
- its own mount namespace: a read-only view of the system directories and the Python
  installation, a minimal ``/dev`` (a devpts of its own for ``pty``), and one writable
  place, a tmpfs of ``disk_mb`` at ``/sandbox`` (the cwd; ``/tmp`` points there) and at
  ``/dev/shm``. No host ``/tmp``, ``/run``, ``/dev/shm``, home or project directory is
  visible, and the scratch vanishes with the namespace;
- its own network (loopback down: nothing reachable), IPC and UTS namespaces;
- a per-run cgroup when the machine has one to give (``cgroup: auto``; ``required`` refuses to
  run without it): ``max_processes``, ``memory_mb`` (+ the scratch) and ``cpus`` for everything
  the call starts, killed at the end; without one (a trainer that is not root, ``cgroup: off``)
  the run's tree is still bounded: ``max_processes`` by ``RLIMIT_NPROC`` (counted per uid in the
  run's own user namespace, or per leased uid), ``memory_mb`` by the launcher, which measures the
  anonymous memory of every process of the run every 50 ms and kills them all past it;
- an unprivileged uid (``user``, 65534 = nobody, for a lone run; concurrent runs lease distinct
  uids below it, ``user_pool`` of them, `_sandbox_uids`; root of a user namespace when the
  trainer is not root) with no capabilities, no-new-privs, and a seccomp filter
  (`_sandbox_seccomp`);
- rlimits per process: CPU seconds, address space, file size, ``open_files``;
- its settings and code on stdin, never on a command line another process could read.

``isolation: process`` is the weaker mode a recipe may opt into where namespaces cannot be made
(logged whenever the tool is built): rlimits, the uid, no-new-privs and seccomp, a host scratch
directory, an optional network namespace (``network``), and an audit hook as the only guard on
writes and processes. Code can switch an audit hook off; that mode is not a boundary.

Calls are blocking and thread-safe: the tool loop runs them in a thread pool. stdout keeps its
first `max_output_chars`, stderr its last (where a traceback ends).
"""

from __future__ import annotations

import json
import logging
import marshal
import math
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl3d.tools._sandbox_cgroup import RunCgroup, missing_controllers
from rl3d.tools._sandbox_cgroup import usable as usable_controllers
from rl3d.tools._sandbox_seccomp import supported as seccomp_problem
from rl3d.tools._sandbox_uids import lease as uid_lease
from rl3d.tools.base import Tool, ToolResult, register_tool
from rl3d.tools.sandbox_io import communicate
from rl3d.tools.sandbox_setup import (
    SandboxConfig,
    cgroup_usable,
    drop_to,
    in_user_namespace,
    interpreter,
    launch_prefix,
    log_weaker_isolation,
    read_only_binds,
)

logger = logging.getLogger(__name__)

LAUNCHER = str(Path(__file__).with_name("_sandbox_init.py"))
SCRATCH = "/sandbox"  # the run's cwd inside its own mount namespace
PATH = "/usr/local/bin:/usr/bin:/bin"
SCRATCH_INODES = 16384  # files + directories the scratch tmpfs holds (each costs kernel memory)


@dataclass(frozen=True)
class SandboxRun:
    """The raw outcome of one run, before it becomes a `ToolResult`."""

    stdout: str
    stderr: str
    returncode: int | None
    wall_timed_out: bool
    pid: int
    cpu_seconds: float | None = None  # the code's process's own CPU time, as the launcher measured it
    oom_killed: bool = False


def run_python(code: str, config: SandboxConfig) -> SandboxRun:
    """Run `code` in a fresh confined child; see the module docstring. Raises RuntimeError when
    the isolation cannot be set up (the code did not run)."""
    with uid_lease(drop_to(config), config.user_pool) as uid:  # a uid no concurrent run has
        return _run_as(uid, code, config)


def _run_as(uid: int | None, code: str, config: SandboxConfig) -> SandboxRun:
    kernel = config.isolation == "kernel"
    scratch = SCRATCH if kernel else tempfile.mkdtemp(prefix="rl3d-sandbox-")
    group = None
    status_r, status_w = os.pipe()
    try:
        if not kernel and uid is not None:
            os.chown(scratch, uid, uid)  # the code may write its scratch dir, nothing of root's
        controllers = set(usable_controllers()) if cgroup_usable(config) else set()
        if controllers:
            memory = (config.memory_mb + (config.disk_mb if kernel else 0)) << 20
            group = RunCgroup.create(
                max_processes=config.max_processes, memory_bytes=memory, cpus=config.cpus
            )
        settings = {
            "isolation": config.isolation,
            "status_fd": status_w,
            "cgroup_procs": group.procs_files if group else [],
            "binds": read_only_binds(),
            "drop_to": uid,
            "scratch": scratch,
            "disk_mb": config.disk_mb,
            "max_files": SCRATCH_INODES,
            "cpu_seconds": max(1, math.ceil(config.cpu_seconds)),
            "wall_seconds": config.wall_seconds,
            "memory_bytes": config.memory_mb << 20,
            "file_bytes": config.file_mb << 20,
            "open_files": config.open_files,
            "block_network": config.block_sockets,
            # no cgroup for it: the launcher (PID 1 of the run) bounds the whole tree itself
            "max_processes": config.max_processes if kernel and "pids" not in controllers else None,
            "tree_memory_bytes": config.memory_mb << 20 if kernel and "memory" not in controllers else None,
        }
        # -I -S -B: no PYTHON* environment, no site-packages, no .pyc writes
        proc = subprocess.Popen(
            [*launch_prefix(config), interpreter(config), "-I", "-S", "-B", LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=scratch if not kernel else "/",
            env={"LANG": "C.UTF-8", "PATH": PATH, "HOME": scratch, "TMPDIR": scratch},
            start_new_session=True,  # its own process group: killpg reaches what it starts
            pass_fds=(status_w,),
        )
        os.close(status_w)
        status_w = -1
        blob = marshal.dumps(settings)  # the launcher's `read_settings`
        stdin = len(blob).to_bytes(4, "little") + blob + code.encode("utf-8", errors="replace")
        try:
            # Each output limit counts bytes; a char is at most 4 of them in UTF-8.
            out, err, wall_timed_out = communicate(
                proc, stdin, config.wall_seconds, 4 * config.max_output_chars
            )
        finally:
            _kill_group(proc.pid)
            if group is not None:
                group.kill()
            proc.wait()
        status = _read_status(status_r)
        if "setup_error" in status:
            raise RuntimeError(f"sandbox: isolation '{config.isolation}' failed: {status['setup_error']}")
        oom_killed = group.oom_killed() if group is not None else False
        if not status and not wall_timed_out and not oom_killed:
            raise RuntimeError(
                f"sandbox: the launcher exited ({proc.returncode}) before the code ran: {err.text()[-500:]}"
            )
        returncode = os.waitstatus_to_exitcode(status["wait_status"]) if status else None
        return SandboxRun(
            stdout=_clip(out.text(), config.max_output_chars, head=True),
            stderr=_clip(err.text(), config.max_output_chars, head=False),
            returncode=returncode,
            wall_timed_out=wall_timed_out or bool(status.get("wall_killed")),
            pid=proc.pid,
            cpu_seconds=status.get("cpu_seconds"),
            oom_killed=oom_killed or bool(status.get("memory_killed")),
        )
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        if group is not None:
            group.close()
        if not kernel:
            _remove_tree(scratch)


# Run by `isolation_problem`: what the code sees of its own confinement.
PROBE = """
import json, os
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({key: status[key].strip() for key in ("NoNewPrivs", "Seccomp", "CapEff", "CapBnd")}))
"""
EXPECTED = {"NoNewPrivs": "1", "Seccomp": "2", "CapEff": "0000000000000000", "CapBnd": "0000000000000000"}


def isolation_problem(config: SandboxConfig) -> str | None:
    """Why this machine cannot give `config`'s isolation (None: it can), found by a real run."""
    key = (config.isolation, config.network, config.cgroup, config.user, os.geteuid())
    if key not in _PROBED:
        _PROBED[key] = _probe(config)
    return _PROBED[key]


_PROBED: dict[tuple, str | None] = {}


def _probe(config: SandboxConfig) -> str | None:
    problem = seccomp_problem()
    if problem is not None:
        return problem
    if not hasattr(os, "pidfd_open"):
        return "the caller needs os.pidfd_open (Linux 5.3 or later)"
    missing = missing_controllers()
    if config.cgroup == "required" and (missing or in_user_namespace(config)):
        return "tools.python.cgroup is 'required' but the per-run cgroup cannot have " + (
            ", ".join(missing) if missing else "any controller (the trainer is not root)"
        )
    probe = SandboxConfig(
        **{**config.__dict__, "cpu_seconds": 5, "wall_seconds": 30, "max_output_chars": 4096}
    )
    try:
        run = run_python(PROBE, probe)
    except (OSError, RuntimeError) as err:
        return str(err).removeprefix("sandbox: ")
    if run.returncode != 0:
        return f"the probe program failed: {to_result(run, probe).error}"
    seen = json.loads(run.stdout)
    wrong = {k: v for k, v in seen.items() if v != EXPECTED[k] and not (k == "CapBnd" and os.geteuid() != 0)}
    return f"the probe ran without its confinement: {wrong}" if wrong else None


def _read_status(fd: int) -> dict[str, Any]:
    os.set_blocking(fd, False)
    try:
        raw = os.read(fd, 65536)
    except BlockingIOError:
        return {}
    return marshal.loads(raw) if raw else {}


def _remove_tree(path: str) -> None:
    """Remove a scratch directory whatever the code left in it; logs, never raises."""
    try:
        shutil.rmtree(path)
        return
    except FileNotFoundError:
        return
    except Exception:  # a tree deeper than the recursion limit, odd permissions...
        pass
    subprocess.run(["rm", "-rf", "--one-file-system", "--", path], capture_output=True, check=False)
    if os.path.exists(path):
        logger.warning("sandbox: could not remove scratch directory %s", path)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty


def _clip(text: str, limit: int, *, head: bool) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + "\n[... truncated]" if head else "[... truncated]\n" + text[-limit:]


def to_result(run: SandboxRun, config: SandboxConfig) -> ToolResult:
    """The observation of a run; a kill is named by what caused it, as far as the kernel tells.
    A limit is reported only when the launcher's measurement shows it reached (a CPU time at the
    limit, its own clock, the cgroup's OOM count), never from the signal alone: the code can send
    itself SIGXCPU."""
    code = run.returncode
    if run.wall_timed_out:
        return ToolResult(
            run.stdout, error=f"timed out after {config.wall_seconds:g}s (wall clock)", timed_out=True
        )
    cpu_limit = max(1, math.ceil(config.cpu_seconds))
    # /proc counts CPU time in clock ticks (10 ms); the limit fires on the exact figure
    cpu_reached = run.cpu_seconds is not None and run.cpu_seconds >= cpu_limit - 0.1
    if cpu_reached and code in (-signal.SIGXCPU, -signal.SIGKILL):
        return ToolResult(
            run.stdout, error=f"CPU time limit of {config.cpu_seconds:g}s exceeded", timed_out=True
        )
    if run.oom_killed:
        return ToolResult(run.stdout, error=f"memory limit of {config.memory_mb} MiB exceeded (killed)")
    if code == -signal.SIGXFSZ:
        return ToolResult(run.stdout, error=f"file size limit of {config.file_mb} MiB exceeded")
    if code != 0:
        detail = run.stderr.strip() or (
            f"killed by signal {-code}" if code and code < 0 else f"exit code {code}"
        )
        return ToolResult(run.stdout, error=detail)
    text = run.stdout if not run.stderr else f"{run.stdout}\n[stderr]\n{run.stderr}"
    return ToolResult(text)


@register_tool
class PythonSandbox(Tool):
    name = "python"
    description = "Run a Python 3 program (standard library only) and return what it prints."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete program; use print()"}},
        "required": ["code"],
    }

    def __init__(self, **options: Any):
        self.config = SandboxConfig(**options)
        log_weaker_isolation(self.config)

    def preflight(self) -> str | None:
        """Why this machine cannot give the configured isolation (None: it can); runs a probe."""
        return isolation_problem(self.config)

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        problem = isolation_problem(self.config)
        if problem is not None:
            raise RuntimeError(f"sandbox: {problem}")  # ToolBox turns it into an error observation
        return to_result(run_python(arguments["code"], self.config), self.config)
