"""A per-run cgroup for the Python sandbox: process count, memory and CPU bandwidth of everything
one call starts, together, and a kill of all of it at the end.

Works on cgroup v2 (one directory, ``pids.max``, ``memory.max``, ``cpu.max``, ``cgroup.kill``)
and on v1 hierarchies (a directory per controller: ``pids.max``, ``memory.limit_in_bytes``,
``cpu.cfs_quota_us``), each made under the trainer's own cgroup so that the trainer's limits
still bound it. The run's launcher moves itself in before it forks the code (`_sandbox_init`).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CONTROLLERS = ("pids", "memory", "cpu")
CPU_PERIOD_US = 100_000


@functools.cache
def _hierarchies() -> dict[str, tuple[int, str]]:
    """controller -> (cgroup version, the trainer's directory in it), where writable."""
    mounts: dict[str, tuple[int, str]] = {}
    v2_root = None
    with open("/proc/self/mounts") as f:
        for line in f:
            _, point, fstype, options = line.split()[:4]
            if fstype == "cgroup2":
                v2_root = point
            elif fstype == "cgroup":
                for name in set(options.split(",")) & set(CONTROLLERS):
                    mounts[name] = (1, point)
    found: dict[str, tuple[int, str]] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if names == "" and v2_root is not None:
                directory = v2_root + path.rstrip("/")
                try:
                    enabled = open(os.path.join(directory, "cgroup.controllers")).read().split()
                except OSError:
                    continue
                for name in set(enabled) & set(CONTROLLERS):
                    found.setdefault(name, (2, directory))
            for name in set(names.split(",")) & set(mounts):
                found[name] = (1, mounts[name][1] + path.rstrip("/"))
    return {name: where for name, where in found.items() if os.access(where[1], os.W_OK)}


def usable() -> dict[str, tuple[int, str]]:
    """The controllers a per-run cgroup can have here."""
    return _hierarchies()


def missing_controllers() -> list[str]:
    """The controllers a per-run cgroup cannot have here (empty when it gets all of them)."""
    return [name for name in CONTROLLERS if name not in _hierarchies()]


@dataclass
class RunCgroup:
    directories: list[str]

    @classmethod
    def create(cls, *, max_processes: int, memory_bytes: int, cpus: float) -> RunCgroup:
        name = f"rl3d-sandbox-{uuid.uuid4().hex[:12]}"
        group = cls([])
        limits = {
            "pids": [("pids.max", str(max_processes))],
            "memory": [("memory.max", str(memory_bytes)), ("memory.swap.max", "0"),
                       ("memory.limit_in_bytes", str(memory_bytes)),
                       ("memory.memsw.limit_in_bytes", str(memory_bytes))],
            "cpu": [("cpu.max", f"{int(cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}"),
                    ("cpu.cfs_period_us", str(CPU_PERIOD_US)),
                    ("cpu.cfs_quota_us", str(int(cpus * CPU_PERIOD_US)))],
        }  # fmt: skip
        try:
            for controller, (_, parent) in sorted(_hierarchies().items()):
                directory = os.path.join(parent, name)
                if directory not in group.directories:
                    if not os.path.isdir(directory):  # v1 may co-mount cpu with cpuacct
                        os.mkdir(directory)
                    group.directories.append(directory)
                for file, value in limits[controller]:
                    path = os.path.join(directory, file)
                    if os.path.exists(path):
                        with open(path, "w") as f:
                            f.write(value)
        except OSError:
            group.close()
            raise
        return group

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.directories]

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer ended a process of the run (the memory limit)."""
        for directory in self.directories:
            for file in ("memory.events", "memory.oom_control"):
                try:
                    for line in open(os.path.join(directory, file)):
                        key, _, value = line.partition(" ")
                        if key == "oom_kill" and int(value) > 0:
                            return True
                except OSError:
                    continue
        return False

    def kill(self) -> None:
        """Kill every process left in the group (`cgroup.kill` where the kernel has it)."""
        for directory in self.directories:
            kill = os.path.join(directory, "cgroup.kill")
            try:
                if os.path.exists(kill):
                    with open(kill, "w") as f:
                        f.write("1")
                for _ in range(20):
                    pids = open(os.path.join(directory, "cgroup.procs")).read().split()
                    if not pids:
                        break
                    for pid in pids:
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    time.sleep(0.01)
            except OSError:
                pass

    def close(self) -> None:
        """Kill what is left and remove the directories; logs, never raises."""
        self.kill()
        for directory in reversed(self.directories):
            for _ in range(50):  # rmdir fails while a killed process is still exiting
                try:
                    os.rmdir(directory)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
            else:
                logger.warning("sandbox: could not remove cgroup %s", directory)
