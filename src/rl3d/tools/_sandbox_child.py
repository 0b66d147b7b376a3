"""The sandbox worker's last steps (stdlib only, imported by `_sandbox_init`): resource limits,
an audit hook, and running the code.

The audit hook (`sys.addaudithook`) is a fast, readable error for honest code, never the
boundary: code can switch it off from inside. Under ``isolation: kernel`` it only names
network use (which the empty network namespace refuses anyway, less readably; unix sockets are
no network use); under
``isolation: process``, where nothing else stands, it also refuses writes outside the scratch
directory, starting or signalling processes and ctypes.
"""

import os
import resource
import sys

_OWN_FILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_")
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
AF_UNIX = 1
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


def set_limits(settings: dict) -> None:
    cpu = int(settings["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit
    memory = int(settings["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    file_size = int(settings["file_bytes"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    files = int(settings["open_files"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
    if settings.get("max_processes") is not None:
        # No cgroup's pids.max: the kernel counts the processes of this real uid in this user
        # namespace, which are the run's alone: a uid leased to it, or its own user namespace,
        # where two more are that uid (the launcher, and the `unshare` that entered it first).
        processes = int(settings["max_processes"]) + (2 if settings["drop_to"] is None else 0)
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))


def _make_hook(scratch: str, block_network: bool, strict: bool):
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep

    def inside(path, dir_fd=None) -> bool:
        if isinstance(path, int):
            return True  # an fd the code already opened: the open itself was checked
        try:
            path = fsdecode(path)
            if dir_fd is not None and dir_fd >= 0 and not path.startswith(sep):
                path = os.readlink(f"/proc/self/fd/{dir_fd}") + sep + path
            real = realpath(path)
        except Exception:
            return False
        return real == scratch or real.startswith(scratch + sep)

    def unix_socket(event: str, args: tuple) -> bool:
        """A unix socket is no network: creating one (asyncio's socketpair) is fine; binding or
        connecting one too under kernel isolation, whose mount namespace holds no host socket."""
        if event == "socket.__new__":
            return args[1] == AF_UNIX
        return not strict and event != "socket.getaddrinfo" and getattr(args[0], "family", None) == AF_UNIX

    def hook(event: str, args: tuple) -> None:
        if block_network and event in _NETWORK_EVENTS and not unix_socket(event, args):
            raise PermissionError(f"sandbox: network access is not allowed ({event})")
        if not strict:
            return
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

    return hook


def run(code: str, settings: dict) -> int:
    """Run `code` as the program ``<sandbox>``; its exit status."""
    scratch = os.path.realpath(settings["scratch"])
    sys.dont_write_bytecode = True
    sys.addaudithook(_make_hook(scratch, settings["block_network"], settings["isolation"] == "process"))
    sys.argv = ["<sandbox>"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<sandbox>", "exec"), namespace)
    except SystemExit as err:
        if err.code is None or isinstance(err.code, int):
            return err.code or 0
        sys.stderr.write(f"{err.code}\n")
        return 1
    except BaseException as err:
        namespace.clear()  # free what the code allocated (a MemoryError needs room to be printed)
        import traceback  # only now: its imports cost every call's start-up several milliseconds

        # Show the code's frames only: not the sandbox's, nor the audit hook's.
        frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_OWN_FILES)]
        lines = traceback.format_list(frames) + traceback.format_exception_only(type(err), err)
        sys.stderr.write("Traceback (most recent call last):\n" + "".join(lines))
        return 1
    return 0
