"""A Python sandbox tool: run model-written code in a limited child process.

Each call:
- makes a fresh scratch directory (the child's cwd) and removes it afterwards;
- starts ``python -I -S -B`` (isolated: no user site, no PYTHON* env, no site-packages, no
  .pyc writes) in a new session, with an empty environment, the code on stdin;
- run as root, the child drops to an unprivileged uid/gid (``user``, 65534 = nobody, no
  supplementary groups) after entering its network namespace, and owns only the scratch dir;
- the child (`_sandbox_child`) sets RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE and RLIMIT_CORE before the
  code runs, and installs an audit hook refusing writes outside the scratch directory, starting
  or signalling processes, ctypes, and (``block_sockets``) socket creation;
- network: with ``network="namespace"`` the child runs under ``unshare --net`` (as root) or
  ``unshare --user --map-root-user --net`` (unprivileged user namespaces): a namespace with only a
  loopback interface that is down, so nothing (not even the host's 127.0.0.1) is reachable.
  ``"auto"`` uses a namespace when `unshare` works here, else relies on the audit hook alone;
- a wall-clock timeout kills the whole process group (``os.killpg``), and the group is killed
  again after a normal exit, so no process of the call outlives it;
- stdout keeps its first `max_output_chars`, stderr its last (where a traceback ends).

Calls are blocking and thread-safe (no ``preexec_fn``): an agent loop runs them in a thread pool.
Not a boundary against hostile code (it can read what ``nobody`` may read); it keeps honest
but buggy model code from hurting the trainer.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl3d.tools.base import Tool, ToolResult, register_tool

logger = logging.getLogger(__name__)

CHILD_SCRIPT = str(Path(__file__).with_name("_sandbox_child.py"))
_NETWORK_MODES = ("auto", "namespace", "audit")
_UNSHARE_VARIANTS = (("--net",), ("--user", "--map-root-user", "--net"))


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    cpu_seconds: float = 5.0
    wall_seconds: float = 10.0
    memory_mb: int = 512
    file_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    max_output_chars: int = 4096
    network: str = "auto"  # auto | namespace | audit (see the module docstring)
    block_sockets: bool = True  # the audit hook refuses socket creation, on top of any namespace
    # the uid/gid the child drops to when the trainer runs as root (65534: nobody); None stays root
    user: int | None = 65534

    def __post_init__(self) -> None:
        for key in ("cpu_seconds", "wall_seconds", "memory_mb", "file_mb", "max_output_chars"):
            if not getattr(self, key) > 0:
                raise ValueError(f"tools.python.{key} must be > 0, got {getattr(self, key)!r}")
        if self.network not in _NETWORK_MODES:
            raise ValueError(f"tools.python.network must be one of {_NETWORK_MODES}, got {self.network!r}")
        if self.network == "namespace" and network_namespace_prefix() is None:
            raise ValueError("tools.python.network is 'namespace' but `unshare --net` does not work here")
        if self.user is not None and not 0 < self.user < 2**32 - 1:
            raise ValueError(f"tools.python.user must be a uid > 0 or None, got {self.user!r}")
        if self.network == "audit" and not self.block_sockets:
            raise ValueError("tools.python: network 'audit' with block_sockets false leaves the network open")


@functools.cache
def network_namespace_prefix() -> tuple[str, ...] | None:
    """The `unshare` command line that gives a child its own empty network namespace here, or None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for flags in _UNSHARE_VARIANTS:
        try:
            probe = subprocess.run([unshare, *flags, "true"], capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return (unshare, *flags)
    return None


def _others_can_read(path: str) -> bool:
    """Whether a user with no rights of its own can reach and read `path` (o+x on every parent)."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i])).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o004)


@functools.cache
def unprivileged_interpreter() -> str | None:
    """A Python whose standard library an unprivileged uid can read: this one, else the system's
    ``python3`` (a trainer's Python often lives under a home directory closed to others)."""
    for candidate in (sys.executable, shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")):
        if not candidate:
            continue
        try:
            probe = subprocess.run(
                [candidate, "-I", "-S", "-c", "import os, json; print(os.__file__); print(json.__file__)"],
                capture_output=True, text=True, timeout=30, check=True,
            )  # fmt: skip
            if all(_others_can_read(f) for f in [candidate, *probe.stdout.split()]):
                return candidate
        except (OSError, subprocess.SubprocessError):
            continue
    return None


class _Capture(threading.Thread):
    """Drains a pipe, keeping its first (`keep="head"`) or last `limit` bytes: a flood of output
    costs neither memory nor a blocked child."""

    def __init__(self, stream: Any, limit: int, keep: str):
        super().__init__(daemon=True)
        self.stream, self.limit, self.keep = stream, limit, keep
        self.data = bytearray()
        self.total = 0

    def run(self) -> None:
        while chunk := self.stream.read1(65536):
            self.total += len(chunk)
            if self.keep == "head":
                self.data += chunk[: max(self.limit - len(self.data), 0)]
            else:
                self.data = (self.data + chunk)[-self.limit :]
        self.stream.close()

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        dropped = self.total - len(self.data)
        if not dropped:
            return text
        note = f"[... {dropped} bytes truncated]"
        return f"{text}\n{note}" if self.keep == "head" else f"{note}\n{text}"


@dataclass(frozen=True)
class SandboxRun:
    """The raw outcome of one run, before it becomes a `ToolResult` (tests read the pid)."""

    stdout: str
    stderr: str
    returncode: int | None
    wall_timed_out: bool
    pid: int


def run_python(code: str, config: SandboxConfig) -> SandboxRun:
    """Run `code` in a fresh limited child; see the module docstring."""
    prefix: tuple[str, ...] = ()
    if config.network in ("auto", "namespace"):
        prefix = network_namespace_prefix() or ()
    scratch = tempfile.mkdtemp(prefix="rl3d-sandbox-")
    # root outside a user namespace drops to `user`; in one (`--map-root-user`) only uid 0 exists
    drop_to = (
        config.user if config.user is not None and os.geteuid() == 0 and "--user" not in prefix else None
    )
    python = sys.executable
    if drop_to is not None:
        python = unprivileged_interpreter()
        if python is None:
            shutil.rmtree(scratch, ignore_errors=True)
            raise RuntimeError(
                "sandbox: no Python whose standard library uid nobody can read; set user: null"
            )
        os.chown(scratch, drop_to, drop_to)  # the code may write its scratch dir, nothing of root's
    settings = {
        "drop_to": drop_to,
        "scratch": scratch,
        "cpu_seconds": max(1, math.ceil(config.cpu_seconds)),
        "memory_bytes": config.memory_mb << 20,
        "file_bytes": config.file_mb << 20,
        "block_network": config.block_sockets,
    }
    argv = [*prefix, python, "-I", "-S", "-B", CHILD_SCRIPT, json.dumps(settings)]
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=scratch,
            env={"LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"},
            start_new_session=True,  # its own process group: killpg reaches everything it starts
            close_fds=True,
        )
        # Each output limit counts bytes; a char is at most 4 of them in UTF-8.
        out = _Capture(proc.stdout, 4 * config.max_output_chars, keep="head")
        err = _Capture(proc.stderr, 4 * config.max_output_chars, keep="tail")
        out.start()
        err.start()
        wall_timed_out = False
        try:
            try:
                assert proc.stdin is not None
                proc.stdin.write(code.encode("utf-8", errors="replace"))
                proc.stdin.close()
            except BrokenPipeError:
                pass  # the child died before reading it all; its exit status says why
            proc.wait(timeout=config.wall_seconds)
        except subprocess.TimeoutExpired:
            wall_timed_out = True
        finally:
            _kill_group(proc.pid)
            proc.wait()
        out.join(timeout=5)
        err.join(timeout=5)
        return SandboxRun(
            stdout=_clip(out.text(), config.max_output_chars, head=True),
            stderr=_clip(err.text(), config.max_output_chars, head=False),
            returncode=proc.returncode,
            wall_timed_out=wall_timed_out,
            pid=proc.pid,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if os.path.exists(scratch):
            logger.warning("sandbox: could not remove scratch directory %s", scratch)


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
    code = run.returncode
    if run.wall_timed_out:
        return ToolResult(
            run.stdout, error=f"timed out after {config.wall_seconds:g}s (wall clock)", timed_out=True
        )
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        # SIGKILL without a wall timeout is the hard CPU limit (or the OOM killer).
        return ToolResult(
            run.stdout, error=f"CPU time limit of {config.cpu_seconds:g}s exceeded", timed_out=True
        )
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

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        return to_result(run_python(arguments["code"], self.config), self.config)
