"""The sandbox's launcher, run as a script by ``python -I -S -B`` (stdlib only).

Under ``isolation: kernel`` it starts as root (real, or of a fresh user namespace) and as PID 1
of the run's own PID, mount, network, IPC and UTS namespaces (`unshare` made them). It reads its
settings (a length, then a marshalled dict) and then the code from stdin, moves itself into the run's cgroup,
builds the run's file system and pivots into it: a read-only tmpfs root holding read-only binds
of the system directories and the Python installation, a minimal ``/dev`` (with a devpts of its
own for ``pty``), a ``/proc`` of the run's own PID namespace, and the only writable place, a
size-limited tmpfs seen at ``/sandbox`` (``/tmp`` points there) and at ``/dev/shm``. Then it
forks the worker, which sets the rlimits, drops to the unprivileged uid with no capabilities,
turns on no-new-privs and the seccomp filter, and runs the code (`_sandbox_child`). The launcher
waits for the worker and writes its wait status and own CPU time to the status pipe (every
signal blocked: nothing the code sends ends it or decides what it reports); when it exits, the
kernel kills whatever the code left in the namespace. Under ``isolation: process`` the file
system steps are skipped.
"""

import ctypes
import errno
import marshal
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's directory out
import _sandbox_child  # noqa: E402
import _sandbox_seccomp  # noqa: E402

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (Linux 5.12)
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
# mount_setattr's attributes are MS_'s first four bits, in the same order
MOUNT_ATTRS = {MS_RDONLY: 0x1, MS_NOSUID: 0x2, MS_NODEV: 0x4, MS_NOEXEC: 0x8}
DEVICES = ("null", "zero", "full", "random", "urandom")
TREE_POLL_S = 0.05  # how often the launcher measures the run's memory when no cgroup bounds it
PTYS = 16  # terminals a run may open (its own devpts); each also counts in the host's kernel.pty.max


class _Mounter:
    def __init__(self, libc):
        self.libc = libc

    def __call__(self, source, target, fstype, flags, data=None) -> None:
        args = [None if s is None else s.encode() for s in (source, target, fstype, data)]
        if self.libc.mount(args[0], args[1], args[2], flags, args[3]) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")

    def bind_read_only(self, source: str, target: str, extra: int = MS_NODEV) -> None:
        """Bind `source`, and every mount under it, read-only and nosuid (plus `extra`) on `target`.

        A bind remount changes one mount only: a mount under a bound directory (a container's
        volume under /usr or /etc) would stay writable. mount_setattr sets the flags on the whole
        tree at once; without it (before Linux 5.12) each mount under `target` is remounted."""
        self(source, target, None, MS_BIND | MS_REC)
        flags = MS_RDONLY | MS_NOSUID | extra
        attr = (ctypes.c_uint64 * 4)(sum(bit for ms, bit in MOUNT_ATTRS.items() if flags & ms), 0, 0, 0)
        call = self.libc.syscall(
            SYS_MOUNT_SETATTR, AT_FDCWD, target.encode(), AT_RECURSIVE, attr, ctypes.sizeof(attr)
        )
        if call == 0:
            return
        # ENOSYS: a kernel before 5.12; EPERM: a container's seccomp profile that does not list
        # it (a remount that is not allowed either fails below, naming the mount)
        if ctypes.get_errno() not in (errno.ENOSYS, errno.EPERM):
            raise OSError(ctypes.get_errno(), f"mount_setattr on {target}: {os.strerror(ctypes.get_errno())}")
        self.remount_each(target, flags)

    def remount_each(self, target: str, flags: int) -> None:
        """Bind-remount every mount at or under `target` with `flags`, parents first."""
        for point in _mounts_under(target):
            self(None, point, None, MS_BIND | MS_REMOUNT | flags)


def _mounts_under(target: str) -> list[str]:
    """The mount points at or under `target`, parents first (from /proc/self/mountinfo)."""
    with open("/proc/self/mountinfo") as info:
        points = [line.split()[4].encode().decode("unicode_escape") for line in info]
    return sorted({p for p in points if p == target or p.startswith(target + "/")}, key=len)


def build_root(libc, settings: dict) -> None:
    """Make the run's file system (see the module docstring) and pivot into it."""

    mount = _Mounter(libc)
    root = "/tmp"  # any directory will do: the tmpfs covers it in this mount namespace only
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("rl3d-sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for source in settings["binds"]:
        target = root + source
        if os.path.islink(source):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
            mount.bind_read_only(source, target)
    os.mkdir(root + "/dev")
    mount("rl3d-dev", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        mount.bind_read_only(f"/dev/{name}", f"{root}/dev/{name}", extra=MS_NOEXEC)
    for name, target in [("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")]:  # fmt: skip
        os.symlink(target, f"{root}/dev/{name}")
    # pty: a devpts of this run's own (newinstance) holding at most PTYS terminals
    os.mkdir(root + "/dev/pts")
    mount(
        "devpts",
        root + "/dev/pts",
        "devpts",
        MS_NOSUID | MS_NOEXEC,
        f"newinstance,ptmxmode=0666,mode=0600,max={PTYS}",
    )
    os.symlink("pts/ptmx", root + "/dev/ptmx")
    os.mkdir(root + "/dev/shm")
    mount(None, root + "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _scratch(mount, libc, root, settings)
    os.symlink(settings["scratch"], root + "/tmp")
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    if libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b".") != 0:
        raise OSError(ctypes.get_errno(), "pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "unmounting the old root")
    os.chdir("/")


def _scratch(mount: _Mounter, libc, root: str, settings: dict) -> None:
    """One tmpfs of ``disk_mb`` and ``max_files``, seen at the scratch and at ``/dev/shm`` (POSIX
    semaphores and shared memory: multiprocessing): one budget for both, which the cgroup's
    memory limit counts once."""
    store = root + "/.rl3d-store"
    os.mkdir(store)
    owner = settings["drop_to"] if settings["drop_to"] is not None else os.getuid()
    size, files = settings["disk_mb"], settings["max_files"]
    options = f"size={size}m,nr_inodes={files},mode=0700,uid={owner},gid={owner}"
    mount("rl3d-scratch", store, "tmpfs", MS_NOSUID | MS_NODEV, options)
    for name, target, mode in (("scratch", settings["scratch"], 0o700), ("shm", "/dev/shm", 0o1777)):
        os.mkdir(f"{store}/{name}")
        os.chown(f"{store}/{name}", owner, owner)
        os.chmod(f"{store}/{name}", mode)
        if not os.path.isdir(root + target):
            os.mkdir(root + target)
        mount(f"{store}/{name}", root + target, None, MS_BIND)  # keeps nosuid, nodev
    if libc.umount2(store.encode(), MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "unmounting the scratch's store")
    os.rmdir(store)


def _worker(libc, code: str, settings: dict) -> int:
    # The kernel's OOM killer takes the code (and what it forks, which inherits this) before
    # anything else: the launcher, which must report, and the trainer, when a run fills the
    # trainer's own cgroup. Raising the score needs no privilege; lowering it again does.
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    os.chdir(settings["scratch"])
    _sandbox_child.set_limits(settings)
    if os.geteuid() == 0:
        uid = settings["drop_to"]
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
        _sandbox_seccomp.drop_bounding_set(libc)  # needs CAP_SETPCAP, which setuid takes away
        if uid is not None:
            os.setuid(uid)
            if os.getuid() != uid or os.geteuid() != uid:
                raise SystemExit("sandbox: could not drop privileges")
        else:
            _sandbox_seccomp.clear_capabilities(libc)
    _sandbox_seccomp.confine(libc)
    return _sandbox_child.run(code, settings)


def read_settings(stream) -> dict:
    """The settings the caller wrote first: a 4-byte length, then a `marshal`led dict (not JSON:
    importing `json` takes `re` and about 40 ms of each call's start-up)."""
    size = int.from_bytes(stream.read(4), "little")
    return marshal.loads(stream.read(size))


def main() -> int:
    settings = read_settings(sys.stdin.buffer)
    code = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    status = os.fdopen(settings["status_fd"], "wb")
    try:
        for procs in settings["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write("0")  # this process; what it forks from now on starts inside
        libc = ctypes.CDLL(None, use_errno=True)
        if settings["isolation"] == "kernel":
            build_root(libc, settings)
    except Exception as err:  # the parent raises this as an isolation failure, never runs the code
        status.write(marshal.dumps({"setup_error": f"{type(err).__name__}: {err}"}))
        return 1
    # Every signal stays blocked in the launcher: the code (the same uid in a user namespace)
    # can send it SIGALRM, SIGINT or SIGCHLD, and none may end it or change what it reports.
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    worker = os.fork()
    if worker == 0:
        rc = 1
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            status.close()
            rc = _worker(libc, code, settings)
        except SystemExit as err:
            sys.stderr.write(f"{err}\n")
        except BaseException:
            import traceback  # only now: its imports cost a call tens of milliseconds

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    status.write(
        marshal.dumps(wait_for(worker, settings["wall_seconds"] + 2, settings.get("tree_memory_bytes")))
    )
    return 0


def wait_for(worker: int, wall_seconds: float, tree_memory_bytes: int | None = None) -> dict:
    """Wait for the worker, reaping what the code orphaned, until it exits or `wall_seconds`
    pass on this process's own monotonic clock (a second clock should the caller be gone); its
    wait status and CPU time, measured here: nothing the code sends decides them.

    With `tree_memory_bytes` (no cgroup bounds the run's memory) it also measures, every
    `TREE_POLL_S`, the anonymous memory of every process of the run's PID namespace (this
    process is its PID 1) and kills them all once the sum passes the bound."""
    deadline, wall_killed, memory_killed = time.monotonic() + wall_seconds, False, False
    while True:
        if not wall_killed and time.monotonic() >= deadline:
            os.kill(worker, signal.SIGKILL)
            wall_killed = True
        if tree_memory_bytes is not None and not memory_killed and tree_memory() > tree_memory_bytes:
            os.kill(-1, signal.SIGKILL)  # as PID 1: every process of the namespace but this one
            memory_killed = True
        exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if exited is not None and exited.si_pid == worker:
            cpu = _own_cpu_seconds(worker)  # read while it is a zombie, before it is reaped
            _, wait_status, usage = os.wait4(worker, 0)
            break
        if exited is not None:  # an orphan re-parented to this process
            os.waitpid(exited.si_pid, 0)
            continue
        # SIGCHLD is blocked: it stays pending and ends this wait (or the code sent it: loop again)
        wait = max(deadline - time.monotonic(), 0.01)
        signal.sigtimedwait({signal.SIGCHLD}, wait if tree_memory_bytes is None else min(wait, TREE_POLL_S))
    return {
        "wait_status": wait_status,
        "cpu_seconds": cpu if cpu is not None else usage.ru_utime + usage.ru_stime,
        "wall_killed": wall_killed,
        "memory_killed": memory_killed,
    }


def tree_memory() -> int:
    """Bytes of anonymous memory of every other process in this PID namespace: proportional
    (`Pss_Anon`), so pages a fork shares copy-on-write count once; each process's `RssAnon`
    where the kernel has no `Pss_Anon`. The scratch's tmpfs is bounded by its own size."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            kib = _field(f"/proc/{entry}/smaps_rollup", "Pss_Anon")
            if kib is None:
                kib = _field(f"/proc/{entry}/status", "RssAnon")
            total += (kib or 0) << 10
        except (OSError, ValueError):
            continue  # exited meanwhile, or a kernel thread
    return total


def _field(path: str, key: str) -> int | None:
    """A "Key:  N kB" line's N from a /proc file (None: no such line)."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def _own_cpu_seconds(pid: int) -> float | None:
    """The process's CPU time, all its threads, without its children's (what RLIMIT_CPU counts)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


if __name__ == "__main__":
    sys.exit(main())
