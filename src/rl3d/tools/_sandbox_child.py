"""The Python sandbox's child: run as a script by ``python -I -S -B``, stdlib only.

It reads the code from stdin, then, before the code runs: moves into the scratch directory,
drops root to the uid it is given, sets the resource limits, and installs an audit hook
(`sys.addaudithook`, which cannot be removed) that refuses writes outside the scratch
directory, socket creation (when asked), starting processes, signalling other processes, and
ctypes. The hook is a best-effort guard for honest model code; the hard limits are the uid,
the rlimits, the network namespace and the parent's kill of the whole session.
"""

import json
import os
import resource
import sys
import traceback

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_REFUSED_EVENTS = {
    "os.fork": "starting processes",
    "os.forkpty": "starting processes",
    "os.exec": "starting processes",
    "os.posix_spawn": "starting processes",
    "os.spawn": "starting processes",
    "os.system": "starting processes",
    "subprocess.Popen": "starting processes",
    "os.kill": "signalling processes",
    "os.killpg": "signalling processes",
    "signal.pthread_kill": "signalling processes",
    "ctypes.dlopen": "ctypes",
    "ctypes.dlsym": "ctypes",
}
_REFUSED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess"}
_NETWORK_EVENTS = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto"}
# event -> positions of path arguments that the event would create or change
_PATH_EVENTS = {
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.rename": (0, 1),
    "os.symlink": (1,),
    "os.link": (1,),
    "os.truncate": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.utime": (0,),
    "os.chflags": (0,),
    "os.mkfifo": (0,),
    "os.mknod": (0,),
}


def _set_limits(settings: dict) -> None:
    cpu = int(settings["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit
    memory = int(settings["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    file_size = int(settings["file_bytes"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _make_hook(scratch: str, block_network: bool):
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep

    def inside(path, dir_fd=None) -> bool:
        if isinstance(path, int):
            return True  # an fd the code already opened: the open itself was checked
        try:
            path = fsdecode(path)
            if dir_fd is not None and not path.startswith(sep):
                path = os.readlink(f"/proc/self/fd/{dir_fd}") + sep + path
            real = realpath(path)
        except Exception:
            return False
        return real == scratch or real.startswith(scratch + sep)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if path is None:
                return
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
                (flags or 0) & _WRITE_FLAGS
            )
            if mode is None and not inside(path) and os.path.isdir(path):
                # os.open gives no dir_fd to the event, so a directory fd from outside would let a
                # relative os.open(..., dir_fd=fd) write there unseen.
                raise PermissionError(f"sandbox: opening directory {path!r} outside the scratch directory")
            if writes and not inside(path):
                raise PermissionError(
                    f"sandbox: writing {path!r} outside the scratch directory is not allowed"
                )
        elif event in _PATH_EVENTS:
            dir_fd = args[-1] if event in ("os.remove", "os.rmdir", "os.mkdir") else None
            for i in _PATH_EVENTS[event]:
                if i < len(args) and not inside(args[i], dir_fd if isinstance(dir_fd, int) else None):
                    raise PermissionError(
                        f"sandbox: changing {args[i]!r} outside the scratch directory is not allowed"
                    )
        elif event in _REFUSED_EVENTS:
            raise PermissionError(f"sandbox: {_REFUSED_EVENTS[event]} is not allowed ({event})")
        elif event == "import" and args[0] in _REFUSED_IMPORTS:
            raise ImportError(f"sandbox: importing {args[0]!r} is not allowed")
        elif block_network and event in _NETWORK_EVENTS:
            raise PermissionError(f"sandbox: network access is not allowed ({event})")

    return hook


def _drop_privileges(uid) -> None:
    """Run as root: become `uid` (gid the same number), with no supplementary groups."""
    if uid is None:
        return
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit("sandbox: could not drop privileges")


def main() -> int:
    settings = json.loads(sys.argv[1])
    code = sys.stdin.read()
    scratch = os.path.realpath(settings["scratch"])
    os.chdir(scratch)
    _drop_privileges(settings.get("drop_to"))
    _set_limits(settings)
    sys.dont_write_bytecode = True
    sys.addaudithook(_make_hook(scratch, settings["block_network"]))
    sys.argv = ["<sandbox>"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<sandbox>", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as err:
        namespace.clear()  # free what the code allocated (a MemoryError needs room to be printed)
        # Show the code's frames only: not this script's, nor the audit hook's.
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename != __file__]
        lines = traceback.format_list(frames) + traceback.format_exception_only(type(err), err)
        sys.stderr.write("Traceback (most recent call last):\n" + "".join(lines))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
