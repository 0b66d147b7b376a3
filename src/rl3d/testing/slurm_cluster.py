"""A real one-node SLURM cluster on localhost, for the tests of `rl3d slurm`.

    reason = slurm_unavailable_reason(install=True)   # None when the daemons are there
    with LocalSlurmCluster(tmp_dir) as cluster:        # munged, slurmctld, slurmd; ~4 s
        os.environ["SLURM_CONF"] = str(cluster.conf)   # sbatch, squeue, ... find it here
        state = cluster.wait_for_job(job_id, {"COMPLETED", "FAILED"})

Debian's `slurmctld slurmd slurm-client munge` packages (SLURM 22.05) are enough: everything
lives under one folder (config, state, spool, logs, pid files, the munge key and socket), the
daemons run as root without systemd on their own free ports, and each is stopped by the PID it
recorded. No fake binaries: jobs really run under slurmd.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from rl3d.utils.net import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "sinfo", "scontrol", "scancel")
PARTITION = "debug"
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}
)


class SlurmClusterError(RuntimeError):
    """The local cluster did not come up (the message holds the daemon logs' tails)."""


def _missing_binaries() -> list[str]:
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin"])
    return [name for name in BINARIES if shutil.which(name, path=search) is None]


def slurm_unavailable_reason(*, install: bool = True) -> str | None:
    """None when the SLURM and munge daemons are usable here; else why not.

    With `install`, missing packages are installed with apt-get when running as root.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the local SLURM cluster needs root (slurmd runs jobs as their user)"
    if not _missing_binaries():
        return None
    if not install:
        return f"SLURM binaries missing: {', '.join(_missing_binaries())}"
    if shutil.which("apt-get") is None:
        return f"SLURM binaries missing ({', '.join(_missing_binaries())}) and apt-get is not available"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install_cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    proc = subprocess.run(install_cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:  # the package lists may be missing or stale: refresh once
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        proc = subprocess.run(install_cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        return f"apt-get install {' '.join(PACKAGES)} failed: {proc.stderr.strip()[-500:]}"
    missing = _missing_binaries()
    return f"still missing after apt-get install: {', '.join(missing)}" if missing else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _sbin(name: str) -> str:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"])) or name


class LocalSlurmCluster:
    """slurmctld + slurmd (+ munged) for one node named after this host, all under `root`."""

    def __init__(self, root: str | os.PathLike, *, cpus: int | None = None, min_job_age_s: int = 3600):
        self.root = Path(root).resolve()
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 1
        self.min_job_age_s = min_job_age_s
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket.2"
        self._pid_files = {
            "slurmd": self.root / "run" / "slurmd.pid",
            "slurmctld": self.root / "run" / "slurmctld.pid",
            "munged": self.root / "run" / "munged.pid",
        }
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> LocalSlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> None:
        running = [name for name, pid in self._recorded_pids().items() if _alive(pid)]
        if running:
            raise SlurmClusterError(f"{', '.join(running)} already running under {self.root}")
        for sub in ("state", "spool", "log", "run", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o711)  # munged insists the socket's folder is not world-writable
        self._start_munge()
        self.conf.write_text(self._slurm_conf())
        self._start_daemons()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.client(["sinfo", "-h", "-N", "-o", "%t"])  # a line per node
            states = proc.stdout.split()
            if proc.returncode == 0 and len(states) == self.num_nodes and set(states) == {"idle"}:
                return
            time.sleep(0.25)
        logs = self.daemon_logs(15)
        self.stop()
        raise SlurmClusterError(f"the local SLURM node never became idle within {timeout_s:.0f}s\n{logs}")

    def _start_daemons(self) -> None:
        self._run([_sbin("slurmctld"), "-f", str(self.conf)])
        self._run([_sbin("slurmd"), "-f", str(self.conf)])

    @property
    def num_nodes(self) -> int:
        return 1

    def client(self, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a SLURM client command (sbatch, squeue, ...) where it reaches slurmctld."""
        return subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout)

    def stop(self) -> None:
        for name, pid in self._recorded_pids().items():
            self._kill_and_wait(pid)
            self._pid_files[name].unlink(missing_ok=True)

    def _recorded_pids(self) -> dict[str, int]:
        pids = {}
        for name in ("slurmd", "slurmctld", "munged"):  # stop order: node, controller, auth
            try:
                pids[name] = int(self._pid_files[name].read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
        return pids

    # -- jobs ----------------------------------------------------------------------------
    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...); {} when unknown."""
        proc = self.client(["scontrol", "show", "job", "-o", str(job_id)])
        if proc.returncode != 0:
            return {}
        fields = {}
        for token in proc.stdout.split():
            key, sep, value = token.partition("=")
            if sep:
                fields.setdefault(key, value)
        return fields

    def wait_for_job(self, job_id: str, states=TERMINAL_STATES, timeout_s: float = 300.0) -> str:
        """Poll until the job's state is one of `states` (polling beats `sbatch --wait`'s delay)."""
        deadline = time.monotonic() + timeout_s
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_fields(job_id).get("JobState", "UNKNOWN")
            if state in states:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {state} after {timeout_s:.0f}s")

    def daemon_logs(self, lines: int = 30) -> str:
        """The tails of slurmctld's and slurmd's logs, for a failing test's message."""
        logs = sorted((self.root / "log").glob("slurm*.log"))  # slurmctld, then each slurmd
        return "\n".join(self._tail(path, lines) for path in logs)

    # -- internals -----------------------------------------------------------------------
    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            os.chmod(key, 0o400)
        self._run(
            [
                _sbin("munged"),
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self._pid_files['munged']}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            ]  # fmt: skip
        )

    def _slurm_conf(self) -> str:
        return "\n".join(self._conf_lines()) + "\n"

    def _conf_lines(self) -> list[str]:
        r = self.root
        return [
            "ClusterName=rl3dtest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={free_port('127.0.0.1')}",
            f"SlurmdPort={free_port('127.0.0.1')}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={self._pid_files['slurmctld']}",
            f"SlurmdPidFile={self._pid_files['slurmd']}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            f"MinJobAge={self.min_job_age_s}",
            "SchedulerType=sched/backfill",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]

    def _run(self, cmd: list[str]) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=60)
        if proc.returncode != 0:
            logs = "\n".join(self._tail(p) for p in sorted((self.root / "log").glob("*.log")))
            self.stop()
            raise SlurmClusterError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}\n{logs}")

    @staticmethod
    def _tail(path: Path, lines: int = 15) -> str:
        try:
            return f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"--- {path.name}: (none)"

    @staticmethod
    def _kill_and_wait(pid: int, timeout_s: float = 15.0) -> None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
