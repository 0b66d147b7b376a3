"""The Python sandbox's settings (`SandboxConfig`, the recipe's ``tools: {python: {...}}``) and
the machine facts a run is launched from: the `unshare` command, the interpreter, the directories
the run sees read-only, the uid it drops to."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from rl3d.tools._sandbox_cgroup import CONTROLLERS, missing_controllers, usable

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("kernel", "process")
NETWORK_MODES = ("namespace", "audit")
CGROUP_MODES = ("auto", "required", "off")
# What a run sees of the host, read-only (a symlink is copied as a symlink); the Python
# installation is added when it lives elsewhere.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc")
NAMESPACES = ("--mount", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts")


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    cpu_seconds: float = 5.0  # per process (RLIMIT_CPU)
    wall_seconds: float = 10.0
    memory_mb: int = 512  # address space per process; with a cgroup, all processes of the call
    file_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    disk_mb: int = 64  # the scratch tmpfs: every file of a call together (kernel isolation)
    max_output_chars: int = 4096
    isolation: str = "kernel"  # kernel | process (weaker, opt-in; see rl3d.tools.python_sandbox)
    network: str = "namespace"  # process isolation: namespace | audit (the audit hook alone)
    block_sockets: bool = True  # the audit hook names socket use with a readable error
    # the uid/gid the code runs as when the trainer is root (65534: nobody); None stays uid 0
    user: int | None = 65534
    # concurrent runs (threads, or trainers on one machine) take distinct uids: user, user - 1, ...
    user_pool: int = 16
    max_processes: int = 32  # cgroup pids.max
    cpus: float = 1.0  # cgroup CPU bandwidth, in CPUs
    open_files: int = 64  # RLIMIT_NOFILE
    cgroup: str = "auto"  # auto: when the machine has one (logged when not) | required | off

    def __post_init__(self) -> None:
        positive = ("cpu_seconds", "wall_seconds", "memory_mb", "file_mb", "disk_mb", "max_output_chars")
        for key in (*positive, "max_processes", "cpus"):
            if not getattr(self, key) > 0:
                raise ValueError(f"tools.python.{key} must be > 0, got {getattr(self, key)!r}")
        for key, modes in (
            ("isolation", ISOLATION_MODES),
            ("network", NETWORK_MODES),
            ("cgroup", CGROUP_MODES),
        ):
            if getattr(self, key) not in modes:
                raise ValueError(f"tools.python.{key} must be one of {modes}, got {getattr(self, key)!r}")
        if self.open_files < 16:
            raise ValueError(
                f"tools.python.open_files must be >= 16 (Python needs a few), got {self.open_files}"
            )
        if self.user is not None and not 0 < self.user < 2**32 - 1:
            raise ValueError(f"tools.python.user must be a uid > 0 or None, got {self.user!r}")
        if not 1 <= self.user_pool <= 1024 or (self.user is not None and self.user - self.user_pool < 0):
            raise ValueError(
                f"tools.python.user_pool must be in [1, 1024] and leave every uid of the pool > 0 "
                f"(user {self.user!r} - user_pool + 1), got {self.user_pool!r}"
            )
        if self.isolation == "kernel" and self.network != "namespace":
            raise ValueError(
                "tools.python.network 'audit' needs isolation 'process' (kernel isolation has its own)"
            )
        if self.network == "audit" and not self.block_sockets:
            raise ValueError("tools.python: network 'audit' with block_sockets false leaves the network open")


def in_user_namespace(config: SandboxConfig) -> bool:
    """Whether the run gets its namespaces through a user namespace (the trainer is not root)."""
    return os.geteuid() != 0 and (config.isolation == "kernel" or config.network == "namespace")


def launch_prefix(config: SandboxConfig) -> tuple[str, ...]:
    """The `unshare` command line the launcher runs under (empty: none)."""
    if config.isolation == "process" and config.network == "audit":
        return ()
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeError("`unshare` (util-linux) is not installed")
    user = ("--user", "--map-root-user") if in_user_namespace(config) else ()
    return (unshare, *user, *(NAMESPACES if config.isolation == "kernel" else ("--net",)))


def drop_to(config: SandboxConfig) -> int | None:
    """The uid the code runs as, when it changes (root outside a user namespace only)."""
    if config.user is None or os.geteuid() != 0 or in_user_namespace(config):
        return None
    return config.user


def interpreter(config: SandboxConfig) -> str:
    if config.isolation == "kernel":
        return os.path.realpath(sys.executable)  # bound read-only into the run (`read_only_binds`)
    if drop_to(config) is None:
        return sys.executable
    python = unprivileged_interpreter()
    if python is None:
        raise RuntimeError("no Python whose standard library uid nobody can read; set user: null")
    return python


@functools.cache
def read_only_binds() -> list[str]:
    """`SYSTEM_DIRS` and the Python installation (outside them) the launcher runs from."""
    binds = list(SYSTEM_DIRS)
    for prefix in (sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
        prefix = os.path.realpath(prefix)
        if not any(prefix == d or prefix.startswith(d + os.sep) for d in binds) and prefix != "/":
            binds.append(prefix)
    return binds


def cgroup_usable(config: SandboxConfig) -> bool:
    return config.cgroup != "off" and not in_user_namespace(config) and bool(usable())


def log_weaker_isolation(config: SandboxConfig) -> None:
    """A warning for every weaker setting in force (each time a tool is built: once per run)."""
    if config.isolation == "process":
        logger.warning(
            "sandbox: tools.python.isolation is 'process': no PID or mount namespace; writes and "
            "processes rest on an audit hook that code can switch off. Not a boundary."
        )
    missing = missing_controllers()
    if config.cgroup == "auto" and (missing or in_user_namespace(config)):
        logger.warning(
            "sandbox: no per-run cgroup for %s here (tools.python.cgroup: auto); the launcher bounds "
            "the run's process count (RLIMIT_NPROC) and memory (measured every 50 ms), CPU time is "
            "limited per process only",
            ", ".join(CONTROLLERS if in_user_namespace(config) else missing),
        )


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
    """A Python whose standard library an unprivileged uid can read (process isolation): this
    one, else the system's ``python3`` (a trainer's Python often lives in a closed home)."""
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
